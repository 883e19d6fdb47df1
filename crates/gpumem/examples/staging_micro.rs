//! What limits staged copies on this machine: host memcpy bandwidth from ordinary memory into
//! pinned chunks, by thread count, with ordinary and non-temporal (streaming) stores (on the
//! H100 machine: 7–9 GB/s per thread, 65–85 GB/s with 16; streaming stores no faster).
//! `cargo run --release -p gpumem --example staging_micro`

use std::time::Instant;

fn main() {
    let total: usize = 512 << 20;
    let src: Vec<u8> = (0..total).map(|i| i as u8).collect();
    #[cfg(feature = "cuda")]
    let pinned: Option<std::sync::Arc<dyn gpumem::Backend>> = if gpumem::device::cuda_available() {
        Some(std::sync::Arc::new(
            gpumem::resource::cuda::CudaPinnedHost::new(0).unwrap(),
        ))
    } else {
        None
    };
    #[cfg(not(feature = "cuda"))]
    let pinned: Option<std::sync::Arc<dyn gpumem::Backend>> = None;
    let threads_list = [1usize, 2, 4, 8, 12, 16];
    for chunk in [512usize << 10, 4 << 20] {
        for nt in [false, true] {
            for &threads in &threads_list {
                // each thread: its own two chunks (pinned where there is a GPU)
                let bufs: Vec<(u64, u64)> = (0..threads)
                    .map(|_| match &pinned {
                        Some(p) => (
                            p.allocate(gpumem::Stream::DEFAULT, chunk, 4096).unwrap(),
                            p.allocate(gpumem::Stream::DEFAULT, chunk, 4096).unwrap(),
                        ),
                        None => (
                            Box::leak(vec![0u8; chunk].into_boxed_slice()).as_mut_ptr() as u64,
                            Box::leak(vec![0u8; chunk].into_boxed_slice()).as_mut_ptr() as u64,
                        ),
                    })
                    .collect();
                let per = total / threads;
                let mut best = f64::MAX;
                for _ in 0..3 {
                    let t = Instant::now();
                    std::thread::scope(|s| {
                        for (i, &(a, b)) in bufs.iter().enumerate() {
                            let part = &src[i * per..(i + 1) * per];
                            s.spawn(move || {
                                for (k, piece) in part.chunks(chunk).enumerate() {
                                    let dst = if k & 1 == 0 { a } else { b };
                                    // SAFETY: `dst` is one of this thread's chunks of `chunk`
                                    // bytes, disjoint from `piece`.
                                    let d = unsafe {
                                        std::slice::from_raw_parts_mut(dst as *mut u8, piece.len())
                                    };
                                    if nt {
                                        copy_streaming(d, piece);
                                    } else {
                                        d.copy_from_slice(piece);
                                    }
                                }
                            });
                        }
                    });
                    best = best.min(t.elapsed().as_secs_f64());
                }
                println!(
                    "chunk {:>5} KiB {:<9} threads {threads:>2}: {:6.1} GB/s",
                    chunk >> 10,
                    if nt { "streaming" } else { "memcpy" },
                    total as f64 / best / 1e9
                );
                if let Some(p) = &pinned {
                    for (a, b) in bufs {
                        p.deallocate(a, chunk, gpumem::Stream::DEFAULT).unwrap();
                        p.deallocate(b, chunk, gpumem::Stream::DEFAULT).unwrap();
                    }
                }
            }
        }
    }
}

/// `dst.copy_from_slice(src)` with non-temporal (streaming) stores: the lines skip the caches
/// and are not first read from memory.
fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: lengths differ");
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let head = dst.as_ptr().align_offset(16).min(dst.len());
        dst[..head].copy_from_slice(&src[..head]);
        let body = (dst.len() - head) / 64 * 64;
        let (d, s) = (dst[head..].as_mut_ptr(), src[head..].as_ptr());
        let mut i = 0;
        while i < body {
            // SAFETY: `i + 64 <= body`, so the loads and stores stay inside `src[head..]` and
            // `dst[head..]`; `d + i` is 16-byte aligned; SSE2 is part of x86-64.
            unsafe {
                for j in (0..64).step_by(16) {
                    let v = _mm_loadu_si128(s.add(i + j) as *const __m128i);
                    _mm_stream_si128(d.add(i + j) as *mut __m128i, v);
                }
            }
            i += 64;
        }
        // SAFETY: orders the streaming stores before what follows.
        unsafe { _mm_sfence() };
        let tail = head + body;
        dst[tail..].copy_from_slice(&src[tail..]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}
