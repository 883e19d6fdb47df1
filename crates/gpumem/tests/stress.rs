//! Many threads allocating, writing patterns, checking them, and freeing each other's buffers.

use gpumem::workload::SplitMix;
use gpumem::Device;
use gpumem::{Config, DeviceBuffer, Stream};
use std::sync::mpsc;

#[test]
fn threads_never_see_each_others_bytes() {
    let alloc = Device::host(Config::parse("shards:4").unwrap()).unwrap();
    let threads = 8;
    let (tx, rx) = mpsc::channel::<(u64, DeviceBuffer<u64>)>();
    let mut handles = Vec::new();
    for t in 0..threads {
        let alloc = alloc.clone();
        let tx = tx.clone();
        handles.push(std::thread::spawn(move || {
            let mut r = SplitMix::new(t);
            let mut mine: Vec<(u64, DeviceBuffer<u64>)> = Vec::new();
            for i in 0..400u64 {
                let cap = if r.below(10) == 0 { 300_000 } else { 3000 };
                let len = 1 + r.below(cap) as usize;
                let tag = (t << 32) | i;
                let data: Vec<u64> = (0..len as u64)
                    .map(|k| tag ^ k.wrapping_mul(0x9e37))
                    .collect();
                let buf = DeviceBuffer::from_slice(&alloc, Stream(t), &data).unwrap();
                mine.push((tag, buf));
                if mine.len() > 16 {
                    let (tag, buf) = mine.swap_remove(r.below(mine.len() as u64) as usize);
                    if r.below(2) == 0 {
                        tx.send((tag, buf)).unwrap(); // freed by the main thread
                    } else {
                        check(tag, &buf);
                    }
                }
            }
            for (tag, buf) in mine {
                check(tag, &buf);
            }
        }));
    }
    drop(tx);
    for (tag, buf) in rx {
        check(tag, &buf);
    }
    for h in handles {
        h.join().unwrap();
    }
    let s = alloc.stats();
    assert_eq!(s.allocation.all.current, 0);
    assert_eq!(s.allocated_bytes.all.current, 0);
    alloc.check_invariants().unwrap();
    alloc.empty_cache();
    assert_eq!(alloc.stats().reserved_bytes.all.current, 0);
}

fn check(tag: u64, buf: &DeviceBuffer<u64>) {
    let v = buf.to_vec().unwrap();
    for (k, &x) in v.iter().enumerate() {
        assert_eq!(
            x,
            tag ^ (k as u64).wrapping_mul(0x9e37),
            "corrupted buffer {tag:#x} at {k}"
        );
    }
}
