//! `gpumem bench transfer`: copy bandwidth of every path between host and device memory
//! (pageable raw, pageable staged, pinned, device↔device, managed prefetch), and the cost of
//! getting pinned memory (raw vs the pinned pool).

#[cfg(feature = "cuda")]
use crate::output::device_name;
use crate::output::{emit, median, CliError, Result, Target};
use gpumem::resource::{CopyKind, StreamOps};
use gpumem::units::size_label as human;
use gpumem::{
    Device, DeviceBuffer, PinnedBuffer, PinnedHost, PinnedRegistration, Stream, Transfer,
};
use serde::Serialize;
use std::time::Instant;

/// One measured path at one size.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub path: String,
    pub direction: String,
    pub bytes: u64,
    /// median over the repetitions
    pub seconds: f64,
    pub gb_per_s: f64,
}

/// Latency of getting and giving back pinned memory.
#[derive(Debug, Clone, Serialize)]
pub struct AllocRow {
    pub allocator: String,
    pub bytes: u64,
    pub us_per_pair: f64,
}

#[derive(Debug, Serialize)]
pub struct Out {
    pub device: String,
    pub rows: Vec<Row>,
    pub pinned_alloc: Vec<AllocRow>,
    /// threads and largest slot of the staged path
    pub staging: String,
}

/// Time `f` (one untimed warm-up, then enough repetitions for ~0.25 s of copying).
fn time(bytes: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let reps = ((256usize << 20) / bytes.max(1)).clamp(3, 200);
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64());
    }
    Ok(median(t))
}

fn row(path: &str, direction: &str, bytes: usize, seconds: f64) -> Row {
    Row {
        path: path.into(),
        direction: direction.into(),
        bytes: bytes as u64,
        seconds,
        gb_per_s: bytes as f64 / seconds / 1e9,
    }
}

/// Every path at every size, on `alloc`'s device.
pub fn measure(alloc: &Device, device: String, sizes: &[usize], quiet: bool) -> Result<Out> {
    let max = sizes.iter().copied().max().unwrap_or(0);
    let stream = alloc.create_stream()?;
    let pool = alloc.pinned_pool()?;
    let engine = alloc.transfer_engine()?;
    let cfg = engine.config();
    let mut rows = Vec::new();
    // pageable memory the way users have it: an initialised Vec
    let src: Vec<u8> = (0..max).map(|i| (i % 253) as u8).collect();
    let mut dst = vec![0u8; max];
    let mut d1 = DeviceBuffer::<u8>::zeroed(alloc, stream, max)?;
    let mut d2 = DeviceBuffer::<u8>::zeroed(alloc, stream, max)?;
    let p1 = PinnedBuffer::from_slice(pool, &src)?;
    let mut p2 = PinnedBuffer::<u8>::zeroed(pool, max)?;
    for &n in sizes {
        if !quiet {
            eprintln!("  {} ...", human(n as u64));
        }
        for (name, how) in [
            ("pageable raw", Transfer::Sync),
            ("pageable staged", Transfer::Staged),
        ] {
            let t = time(n, || {
                d1.slice_mut(..n)?.copy_from_host_with(&src[..n], how)?;
                d1.synchronize().map_err(CliError::from)
            })?;
            rows.push(row(name, "h2d", n, t));
            let t = time(n, || {
                d1.slice(..n)?
                    .copy_to_host_with(&mut dst[..n], how)
                    .map_err(CliError::from)
            })?;
            rows.push(row(name, "d2h", n, t));
        }
        // the reference: one cuMemcpyAsync between the same pinned and device memory, with
        // none of gpumem's bookkeeping
        for (dir, kind, dst_ptr, src_ptr) in [
            (
                "h2d",
                CopyKind::HostToDevice,
                d1.device_ptr(),
                p1.host_ptr(),
            ),
            (
                "d2h",
                CopyKind::DeviceToHost,
                p2.host_ptr(),
                d1.device_ptr(),
            ),
        ] {
            let t = time(n, || {
                // SAFETY: both ranges are live blocks of at least `n` bytes (buffers of `max`),
                // not otherwise used until the stream is synchronised below.
                unsafe { alloc.copy(dst_ptr, src_ptr, n, kind, stream) }?;
                alloc.synchronize(stream).map_err(CliError::from)
            })?;
            rows.push(row("cuMemcpyAsync (raw)", dir, n, t));
        }
        let t = time(n, || {
            d1.copy_range_from_pinned(0, &p1, 0..n)?;
            d1.synchronize().map_err(CliError::from)
        })?;
        rows.push(row("pinned", "h2d", n, t));
        let t = time(n, || {
            d1.copy_range_to_pinned(0..n, &mut p2, 0)?;
            p2.synchronize().map_err(CliError::from)
        })?;
        rows.push(row("pinned", "d2h", n, t));
        // ordinary memory page-locked for each copy (cuMemHostRegister + copy + unregister)
        let t = time(n, || {
            let reg = PinnedRegistration::new(pool, &mut dst[..n])?;
            d2.copy_range_from_pinned(0, &reg, 0..n)?;
            reg.synchronize().map_err(CliError::from)
        })?;
        rows.push(row("pageable registered", "h2d", n, t));
        let t = time(n, || {
            d2.slice_mut(..n)?.copy_from_device(&d1.slice(..n)?)?;
            d2.synchronize().map_err(CliError::from)
        })?;
        rows.push(row("device", "d2d", n, t));
        #[cfg(feature = "cuda")]
        if let Some(r) = managed_rows(alloc, n, stream)? {
            rows.extend(r);
        }
    }
    // check what the copies moved (the last size's round trips)
    let last = *sizes.last().unwrap_or(&0);
    if dst[..last] != src[..last] {
        return Err("staged/raw device→host data differs from the source".into());
    }
    if p2.as_slice()?[..last] != src[..last] {
        return Err("pinned device→host data differs from the source".into());
    }
    drop((d1, d2, p1, p2));
    let pinned_alloc = pinned_alloc_rows(alloc)?;
    alloc.destroy_stream(stream);
    Ok(Out {
        device,
        rows,
        pinned_alloc,
        staging: format!(
            "{} threads, slots of up to {}",
            cfg.threads,
            human(cfg.chunk_bytes as u64)
        ),
    })
}

/// Managed memory prefetched each way (the reference the unified-memory work is measured
/// against). Skipped where the device has too little free memory for a safe allocation.
#[cfg(feature = "cuda")]
fn managed_rows(alloc: &Device, n: usize, stream: Stream) -> Result<Option<Vec<Row>>> {
    use gpumem::resource::cuda::CudaManaged;
    use gpumem::resource::Resource;
    let gpumem::Location::Cuda(ordinal) = alloc.backend().location() else {
        return Ok(None);
    };
    let m = CudaManaged::new(ordinal)?;
    // the resource's guard refuses anything past 0.8 x free memory; stay far below it
    let free = m.mem_info()?.free;
    if (n as u64) * 4 > free {
        return Ok(None);
    }
    let p = m.allocate(stream, n, 4096)?;
    // SAFETY: `p` is a fresh managed block of `n` bytes, host-accessible (concurrent managed
    // access is not needed: no kernel runs on it).
    unsafe { std::ptr::write_bytes(p as *mut u8, 7, n) };
    let mut rows = Vec::new();
    let mut h2d = Vec::new();
    let mut d2h = Vec::new();
    for _ in 0..((256usize << 20) / n).clamp(3, 50) {
        let s = Instant::now();
        // SAFETY: the range is the managed block from `m`.
        unsafe { m.prefetch_to_device(p, n, stream) }?;
        m.synchronize(stream)?;
        h2d.push(s.elapsed().as_secs_f64());
        let s = Instant::now();
        // SAFETY: as above.
        unsafe { m.prefetch_to_host(p, n, stream) }?;
        m.synchronize(stream)?;
        d2h.push(s.elapsed().as_secs_f64());
    }
    rows.push(row("managed prefetch", "h2d", n, median(h2d)));
    rows.push(row("managed prefetch", "d2h", n, median(d2h)));
    m.deallocate(p, n, stream)?;
    Ok(Some(rows))
}

/// Pinned alloc+free: the raw resource against the pool's cache.
fn pinned_alloc_rows(alloc: &Device) -> Result<Vec<AllocRow>> {
    let pool = alloc.pinned_pool()?;
    let raw = pool.backend().clone();
    let mut out = Vec::new();
    for bytes in [1usize << 20, 64 << 20] {
        let reps = if bytes > 1 << 20 { 5 } else { 20 };
        let mut t = Vec::new();
        for _ in 0..reps {
            let s = Instant::now();
            let p = raw.allocate(Stream::DEFAULT, bytes, 4096)?;
            raw.deallocate(p, bytes, Stream::DEFAULT)?;
            t.push(s.elapsed().as_secs_f64());
        }
        out.push(AllocRow {
            allocator: format!("{} (raw)", raw.name()),
            bytes: bytes as u64,
            us_per_pair: median(t) * 1e6,
        });
        let b = pool.allocate(bytes)?;
        pool.free(b, vec![])?;
        let pairs = 100_000;
        let s = Instant::now();
        for _ in 0..pairs {
            let b = pool.allocate(bytes)?;
            pool.free(b, vec![])?;
        }
        out.push(AllocRow {
            allocator: "gpumem pinned pool (cached)".into(),
            bytes: bytes as u64,
            us_per_pair: s.elapsed().as_secs_f64() * 1e6 / pairs as f64,
        });
    }
    Ok(out)
}

/// One line per direction and size (16 MiB and up) with path `num` as a share of path `den`.
fn ratios(out: &Out, sizes: &[u64], label: &str, num: &str, den: &str) {
    for dir in ["h2d", "d2h"] {
        for s in sizes.iter().filter(|&&s| s >= 16 << 20) {
            let get = |p: &str| {
                out.rows
                    .iter()
                    .find(|r| r.path == p && r.direction == dir && r.bytes == *s)
                    .map(|r| r.gb_per_s)
            };
            if let (Some(a), Some(b)) = (get(num), get(den)) {
                println!("{label} {dir} at {}: {:.0}%", human(*s), 100.0 * a / b);
            }
        }
    }
}

pub fn print(out: &Out) {
    println!(
        "copy bandwidth on {} (GB/s, median; staged: {})",
        out.device, out.staging
    );
    let mut sizes: Vec<u64> = out.rows.iter().map(|r| r.bytes).collect();
    sizes.dedup();
    let mut paths: Vec<(String, String)> = Vec::new();
    for r in &out.rows {
        let k = (r.path.clone(), r.direction.clone());
        if !paths.contains(&k) {
            paths.push(k);
        }
    }
    print!("{:<20} {:<5}", "path", "dir");
    for s in &sizes {
        print!(" {:>9}", human(*s));
    }
    println!();
    for (p, d) in &paths {
        print!("{p:<20} {d:<5}");
        for s in &sizes {
            match out
                .rows
                .iter()
                .find(|r| &r.path == p && &r.direction == d && r.bytes == *s)
            {
                Some(r) => print!(" {:>9.2}", r.gb_per_s),
                None => print!(" {:>9}", "-"),
            }
        }
        println!();
    }
    ratios(out, &sizes, "staged/pinned", "pageable staged", "pinned");
    ratios(
        out,
        &sizes,
        "pinned/raw cuMemcpyAsync",
        "pinned",
        "cuMemcpyAsync (raw)",
    );
    println!("pinned alloc+free:");
    for r in &out.pinned_alloc {
        println!(
            "  {:<32} {:>8} {:>12.3} us",
            r.allocator,
            human(r.bytes),
            r.us_per_pair
        );
    }
}

/// Peer copies between devices 0 and 1: gpumem buffers (pooled, virtual-memory pages with
/// peer access granted) against a bare cuMemcpyPeerAsync between cuMemAlloc blocks, with
/// peer access enabled both ways.
#[cfg(feature = "cuda")]
pub fn measure_peer(max_mib: usize) -> Result<Out> {
    use crate::output::msg;
    use gpumem::resource::cuda::{primary_context, CudaDevice};
    use gpumem::resource::Resource;
    let set = gpumem::DeviceSet::new(gpumem::Config::default());
    set.enable_peer_access(0, 1)?;
    set.enable_peer_access(1, 0)?;
    let sizes: Vec<usize> = [1usize << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]
        .into_iter()
        .filter(|&s| s <= (max_mib << 20).max(1 << 20))
        .collect();
    let max = *sizes.last().unwrap_or(&(1 << 20));
    let ctx = [primary_context(0)?, primary_context(1)?];
    let st = [
        ctx[0].new_stream().map_err(msg)?,
        ctx[1].new_stream().map_err(msg)?,
    ];
    let s = [Stream::from(&*st[0]), Stream::from(&*st[1])];
    let a = [set.device(0)?, set.device(1)?];
    let mut b0 = DeviceBuffer::<u8>::zeroed(a[0], s[0], max)?;
    let mut b1 = DeviceBuffer::<u8>::zeroed(a[1], s[1], max)?;
    let raw = [
        CudaDevice::new(0)?.without_vmm(),
        CudaDevice::new(1)?.without_vmm(),
    ];
    let r0 = raw[0].allocate(s[0], max, 256)?;
    let r1 = raw[1].allocate(s[1], max, 256)?;
    let mut rows = Vec::new();
    for &n in &sizes {
        let t = time(n, || {
            b1.slice_mut(..n)?.copy_from_device(&b0.slice(..n)?)?;
            b1.synchronize().map_err(CliError::from)
        })?;
        rows.push(row("gpumem peer", "0->1", n, t));
        let t = time(n, || {
            b0.slice_mut(..n)?.copy_from_device(&b1.slice(..n)?)?;
            b0.synchronize().map_err(CliError::from)
        })?;
        rows.push(row("gpumem peer", "1->0", n, t));
        for (dir, dst, src, i) in [("0->1", r1, r0, 1usize), ("1->0", r0, r1, 0usize)] {
            let t = time(n, || {
                // SAFETY: both are live cuMemAlloc blocks of `max >= n` bytes; the contexts are
                // the devices' primary contexts; the stream is device i's.
                let r = unsafe {
                    cudarc::driver::sys::cuMemcpyPeerAsync(
                        dst,
                        ctx[i].cu_ctx(),
                        src,
                        ctx[1 - i].cu_ctx(),
                        n,
                        st[i].cu_stream(),
                    )
                };
                if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
                    return Err(format!("cuMemcpyPeerAsync: {r:?}").into());
                }
                raw[i].synchronize(s[i]).map_err(CliError::from)
            })?;
            rows.push(row("raw cuMemcpyPeerAsync", dir, n, t));
        }
    }
    raw[0].deallocate(r0, max, s[0])?;
    raw[1].deallocate(r1, max, s[1])?;
    let names: Vec<String> = gpumem::device::devices()?
        .into_iter()
        .take(2)
        .map(|d| d.name)
        .collect();
    Ok(Out {
        device: format!("devices 0 and 1 ({})", names.join(", ")),
        rows,
        pinned_alloc: Vec::new(),
        staging: "peer access enabled both ways".into(),
    })
}

pub fn run(json: bool, max_mib: usize, target: &Target) -> Result<()> {
    let config = target.config()?;
    let sizes: Vec<usize> = [
        64usize << 10,
        1 << 20,
        16 << 20,
        64 << 20,
        256 << 20,
        1 << 30,
    ]
    .into_iter()
    .filter(|&s| s <= (max_mib << 20).max(64 << 10))
    .collect();
    let gpu = target.gpu();
    let (alloc, name) = if gpu {
        #[cfg(feature = "cuda")]
        {
            let name = device_name(target.device)?;
            (gpumem::Device::cuda(target.device, config)?, name)
        }
        #[cfg(not(feature = "cuda"))]
        {
            return Err("built without the cuda feature".into());
        }
    } else {
        (
            gpumem::Device::host(config)?,
            "host (no GPU: every path is a host memcpy; h2d/d2h name the direction a GPU \
             would copy)"
                .to_string(),
        )
    };
    let mut out = measure(&alloc, name, &sizes, json)?;
    if !gpu {
        // nothing here is a driver copy: say what each row really is
        for r in &mut out.rows {
            r.path = r.path.replace("cuMemcpyAsync", "host memcpy");
        }
    }
    emit(json, &out, print)
}

#[cfg(feature = "cuda")]
pub fn run_peer(json: bool, max_mib: usize) -> Result<()> {
    let n = gpumem::device::device_count();
    if n < 2 {
        return Err(format!("bench transfer --peer needs two CUDA GPUs (found {n})").into());
    }
    let out = measure_peer(max_mib)?;
    emit(json, &out, print)
}

#[cfg(not(feature = "cuda"))]
pub fn run_peer(_: bool, _: usize) -> Result<()> {
    Err("built without the cuda feature".into())
}
