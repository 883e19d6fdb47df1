//! Cost of virtual-memory page operations on a CUDA device (diagnostics for the expandable
//! segments): reserve, map (cuMemCreate + cuMemMap + cuMemSetAccess) and unmap (cuMemUnmap +
//! cuMemRelease) of runs of pages, against cuMemAlloc / cuMemFree of the same bytes.
//! `cargo run --release --example vmm_micro` on a GPU machine.

#[cfg(feature = "cuda")]
fn main() {
    use gpumem::resource::cuda::CudaDevice;
    use gpumem::{Resource, Stream};
    use std::time::Instant;
    if !gpumem::device::cuda_available() {
        eprintln!("vmm_micro: no CUDA device");
        return;
    }
    let dev = CudaDevice::new(0).expect("device 0");
    let Some(page) = dev.vmm_page_size() else {
        eprintln!("vmm_micro: device 0 has no virtual-memory management");
        return;
    };
    println!("page {} KiB", page >> 10);
    let va = 64u64 << 30;
    let base = dev.reserve_address(va).expect("reserve");
    for run in [1u64, 10, 100, 1000] {
        let bytes = run * page;
        let reps = (2000 / run).clamp(2, 200);
        let t = Instant::now();
        for r in 0..reps {
            let a = base + (r % 8) * bytes.min(va / 8);
            dev.map(a, bytes).expect("map");
            dev.unmap(a, bytes).expect("unmap");
        }
        let pair = t.elapsed().as_secs_f64() / reps as f64;
        let t = Instant::now();
        for _ in 0..reps {
            let p = dev
                .allocate(Stream::DEFAULT, bytes as usize, 256)
                .expect("cuMemAlloc");
            dev.deallocate(p, bytes as usize, Stream::DEFAULT)
                .expect("cuMemFree");
        }
        let classic = t.elapsed().as_secs_f64() / reps as f64;
        println!(
            "{:>6} MiB: map+unmap {:>9.1} us ({:>6.1} us/page)   cuMemAlloc+cuMemFree {:>9.1} us",
            bytes >> 20,
            pair * 1e6,
            pair * 1e6 / run as f64,
            classic * 1e6
        );
    }
    dev.release_address(base, va).expect("release");
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("vmm_micro: built without the cuda feature");
}
