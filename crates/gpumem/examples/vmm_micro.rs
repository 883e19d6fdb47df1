//! Cost of virtual-memory page operations on a CUDA device (diagnostics for the expandable
//! segments): moves of runs of pages through gpumem's page engine (what the caller's thread
//! pays, and what runs on the engine's thread), against cuMemAlloc / cuMemFree of the same
//! bytes; then the raw driver calls one by one (create/release, and map + set-access + unmap of
//! a kept handle).
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
    let device = CudaDevice::new(0).expect("device 0");
    let Some(dev) = device.virtual_memory() else {
        eprintln!("vmm_micro: device 0 has no virtual-memory management");
        return;
    };
    let page = dev.page_size();
    println!("page {} KiB", page >> 10);
    let va = 64u64 << 30;
    let base = dev.reserve_address(va).expect("reserve");
    // the page engine: a move (unmap a run here, map one there) as the pool makes it; the
    // caller's thread pays the map (kept handles after the first rounds, one set-access per
    // run) and only queues the unmap, which the engine's thread does
    for run in [1u64, 10, 100, 1000] {
        let bytes = run * page;
        let reps = (2000 / run).clamp(2, 200);
        let before = dev.calls();
        let (mut map_s, mut unmap_s) = (0.0f64, 0.0f64);
        let slots = (va / bytes).min(8);
        dev.map(base, bytes).expect("map");
        for r in 1..=reps {
            let (from, to) = (base + ((r - 1) % slots) * bytes, base + (r % slots) * bytes);
            let t = Instant::now();
            dev.unmap(from, bytes).expect("unmap");
            unmap_s += t.elapsed().as_secs_f64();
            let t = Instant::now();
            dev.map(to, bytes).expect("map");
            map_s += t.elapsed().as_secs_f64();
        }
        dev.unmap(base + (reps % slots) * bytes, bytes)
            .expect("unmap");
        let t = Instant::now();
        dev.trim();
        let drain = t.elapsed().as_secs_f64();
        let c = dev.calls();
        let t = Instant::now();
        for _ in 0..reps {
            let p = device
                .allocate(Stream::DEFAULT, bytes as usize, 256)
                .expect("cuMemAlloc");
            device
                .deallocate(p, bytes as usize, Stream::DEFAULT)
                .expect("cuMemFree");
        }
        let classic = t.elapsed().as_secs_f64() / reps as f64;
        // moves as the pool makes them now: the unmapped pages' handles go straight to the
        // next map of the same stream (idle pages: old addresses unmapped by the worker)
        let before_aliased = dev.calls();
        dev.map(base, bytes).expect("map");
        let t = Instant::now();
        for r in 1..=reps {
            let (from, to) = (base + ((r - 1) % slots) * bytes, base + (r % slots) * bytes);
            dev.unmap_after(from, bytes, Stream::DEFAULT, false)
                .expect("unmap_after");
            dev.map_on(to, bytes, Stream::DEFAULT).expect("map_on");
        }
        let aliased = t.elapsed().as_secs_f64();
        dev.unmap(base + (reps % slots) * bytes, bytes)
            .expect("unmap");
        dev.trim();
        let ca = dev.calls();
        let per = |x: f64| x * 1e6 / (reps * run) as f64;
        println!(
            "{:>6} MiB moves: caller {:>6.1} us/page (map {:>6.1}, unmap {:>5.2})  creates {} \
             set-access {} waits {}  background unmaps {} (drain {:.1} ms)  \
             cuMemAlloc+cuMemFree {:>9.1} us",
            bytes >> 20,
            per(map_s + unmap_s),
            per(map_s),
            per(unmap_s),
            c.creates - before.creates,
            c.set_access - before.set_access,
            c.waits - before.waits,
            c.background - before.background,
            drain * 1e3,
            classic * 1e6
        );
        println!(
            "{:>6} MiB moves to the same stream: caller {:>6.1} us/page, creates {}, aliased {}",
            bytes >> 20,
            aliased * 1e6 / (reps * run) as f64,
            ca.creates - before_aliased.creates,
            ca.aliased - before_aliased.aliased
        );
    }
    // where the time goes: one handle created and released once, mapped and unmapped again
    // and again (what moving pages would cost if handles were reused)
    use cudarc::driver::sys;
    let _ctx = gpumem::resource::cuda::primary_context(0).expect("context");
    for handle_mib in [2u64, 20, 64] {
        let size = (handle_mib << 20) as usize;
        // SAFETY: all-zero CUmemAllocationProp is the documented default; fields set below.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: 0,
        };
        let access = sys::CUmemAccessDesc {
            location: prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let reps = 50;
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        let t = Instant::now();
        for _ in 0..reps {
            // SAFETY: valid out-pointer and properties; the handle is released at once.
            unsafe {
                sys::cuMemCreate(&mut h, size, &prop, 0)
                    .result()
                    .expect("create");
                sys::cuMemRelease(h).result().expect("release");
            }
        }
        let create = t.elapsed().as_secs_f64() / reps as f64;
        // SAFETY: as above; `h` stays alive for the map/unmap loop below.
        unsafe { sys::cuMemCreate(&mut h, size, &prop, 0) }
            .result()
            .expect("create");
        let t = Instant::now();
        for r in 0..reps as u64 {
            let a = base + (r % 8) * size as u64;
            // SAFETY: `a` is unmapped reserved space of `size` bytes; `h` is one handle of
            // `size` bytes; unmapped again before the next round.
            unsafe {
                sys::cuMemMap(a, size, 0, h, 0).result().expect("map");
                sys::cuMemSetAccess(a, size, &access, 1)
                    .result()
                    .expect("access");
                sys::cuMemUnmap(a, size).result().expect("unmap");
            }
        }
        let remap = t.elapsed().as_secs_f64() / reps as f64;
        // SAFETY: `h` is unmapped.
        unsafe { sys::cuMemRelease(h) }.result().expect("release");
        println!(
            "handle {handle_mib:>3} MiB: create+release {:>8.1} us   map+access+unmap of a kept handle {:>8.1} us",
            create * 1e6,
            remap * 1e6
        );
    }
    dev.release_address(base, va).expect("release");
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("vmm_micro: built without the cuda feature");
}
