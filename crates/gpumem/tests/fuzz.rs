//! A stable random-input fuzz driver (no nightly needed): the trace readers (JSON Lines, gzip,
//! PyTorch pickles), the configuration parser, and replaying whatever parses, fed mutations of
//! valid inputs and random bytes. Every input must give a value or an error, never a panic or
//! a runaway replay. CI runs a bounded number of inputs per target (`GPUMEM_FUZZ_ITERS`,
//! default 2000); `scripts/fuzz` runs many more in release mode. The seed is printed, and an
//! input that panics is written to a file for replaying.

use gpumem::trace::{parse_trace, read_pickle, replay, SIM_CAPACITY};
use gpumem::workload::SplitMix;
use gpumem::Config;
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};

#[path = "common/data.rs"]
mod common_data;

fn iters() -> usize {
    std::env::var("GPUMEM_FUZZ_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000)
}

fn seed() -> u64 {
    std::env::var("GPUMEM_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed)
}

/// Mutate `input`: flip, insert, delete, duplicate or truncate a few bytes.
fn mutate(r: &mut SplitMix, input: &[u8]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..=r.below(8) {
        let n = v.len() as u64;
        match r.below(6) {
            0 if n > 0 => {
                let i = r.below(n) as usize;
                v[i] ^= 1 << r.below(8);
            }
            1 => {
                let i = r.below(n + 1) as usize;
                v.insert(i, r.below(256) as u8);
            }
            2 if n > 0 => {
                let i = r.below(n) as usize;
                v.remove(i);
            }
            3 if n > 0 => {
                let i = r.below(n) as usize;
                let j = (i + r.below(32) as usize).min(v.len());
                let piece = v[i..j].to_vec();
                v.splice(i..i, piece);
            }
            4 => v.truncate(r.below(n + 1) as usize),
            _ => {
                // an interesting token: huge and negative numbers, odd actions
                let tokens: [&[u8]; 8] = [
                    b"18446744073709551615",
                    b"-1",
                    b"1e308",
                    b"\"free_completed\"",
                    b"\"segment_map\"",
                    b"null",
                    b"{}",
                    b"\n",
                ];
                let t = tokens[r.below(tokens.len() as u64) as usize];
                let i = r.below(n + 1) as usize;
                v.splice(i..i, t.iter().copied());
            }
        }
    }
    v
}

/// Run `f` on `input`; a panic fails the test after saving the input.
fn guard(target: &str, i: usize, input: &[u8], f: impl FnOnce()) {
    if catch_unwind(AssertUnwindSafe(f)).is_err() {
        let path = std::env::temp_dir().join(format!("gpumem-fuzz-{target}-{i}.bin"));
        let _ = std::fs::write(&path, input);
        panic!(
            "{target}: input {i} (seed {}) panicked; saved to {}",
            seed(),
            path.display()
        );
    }
}

fn valid_trace() -> Vec<u8> {
    let mut t = Vec::new();
    for i in 0..24u64 {
        let size = 512 << (i % 11);
        writeln!(
            t,
            "{{\"action\": \"alloc\", \"addr\": {}, \"size\": {size}, \"stream\": {}, \"time_us\": {i}}}",
            4096 * (i + 1),
            i % 2
        )
        .unwrap();
        if i % 3 == 2 {
            writeln!(
                t,
                "{{\"action\": \"free_completed\", \"addr\": {}, \"size\": {size}, \"stream\": {}, \"time_us\": {i}}}",
                4096 * (i + 1),
                i % 2
            )
            .unwrap();
        }
    }
    t
}

/// Replay what parsed, on the bounded simulator: an error is fine, a panic or hang is not.
fn replay_parsed(events: &[gpumem::trace::TraceEvent]) {
    if events.len() <= 200 {
        let _ = replay("fuzz", events, &Config::default(), SIM_CAPACITY);
    }
}

#[test]
fn fuzz_trace_json_lines() {
    let mut r = SplitMix::new(seed());
    let base = valid_trace();
    let n = iters();
    let mut parsed = 0;
    for i in 0..n {
        let input = if r.below(10) == 0 {
            (0..r.below(512)).map(|_| r.below(256) as u8).collect()
        } else {
            mutate(&mut r, &base)
        };
        guard("jsonl", i, &input, || {
            if let Ok(events) = parse_trace("fuzz", &input[..]) {
                parsed += 1;
                replay_parsed(&events);
            }
        });
    }
    println!("jsonl: {n} inputs, {parsed} parsed and replayed, no panic");
}

#[test]
fn fuzz_trace_gzip() {
    let mut r = SplitMix::new(seed() ^ 1);
    let base = valid_trace();
    let n = iters() / 2;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    for i in 0..n {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&mutate(&mut r, &base)).unwrap();
        let mut bytes = gz.finish().unwrap();
        // damage the compressed stream too, sometimes
        if r.below(2) == 0 {
            bytes = mutate(&mut r, &bytes);
        }
        let path = dir.join(format!("{i}.jsonl.gz"));
        std::fs::write(&path, &bytes).unwrap();
        guard("gzip", i, &bytes, || {
            if let Ok(events) = gpumem::trace::read_trace(&path) {
                replay_parsed(&events);
            }
        });
        let _ = std::fs::remove_file(&path);
    }
    println!("gzip: {n} inputs, no panic");
}

#[test]
fn fuzz_trace_pickle() {
    let mut r = SplitMix::new(seed() ^ 2);
    let base = std::fs::read(common_data::data("torch_tiny_train.pickle")).unwrap();
    let n = iters() / 2;
    for i in 0..n {
        let input = mutate(&mut r, &base);
        guard("pickle", i, &input, || {
            if let Ok(events) = read_pickle("fuzz", &input[..]) {
                replay_parsed(&events);
            }
        });
    }
    println!("pickle: {n} inputs, no panic");
}

#[test]
fn fuzz_configuration_strings() {
    let mut r = SplitMix::new(seed() ^ 3);
    let pieces: Vec<String> = gpumem::config::keys::KEYS
        .iter()
        .map(|k| k.name.to_string())
        .chain(
            [
                ":",
                ",",
                "[",
                "]",
                ">",
                "0",
                "1",
                "-1",
                "0.5",
                "1e400",
                "NaN",
                "inf",
                "auto",
                "none",
                "True",
                "18446744073709551615",
                "256:1",
                " ",
                "",
                "\u{0}",
                "é",
            ]
            .map(String::from),
        )
        .collect();
    let n = iters() * 5;
    let mut ok = 0;
    for i in 0..n {
        let s: String = (0..r.below(12))
            .map(|_| pieces[r.below(pieces.len() as u64) as usize].as_str())
            .collect();
        guard("config", i, s.as_bytes(), || {
            if let Ok(c) = Config::parse(&s) {
                ok += 1;
                // whatever parses prints back to itself
                assert_eq!(Config::parse(&c.to_string()).unwrap(), c, "{s}");
            }
        });
    }
    println!("config: {n} inputs, {ok} valid, no panic");
}
