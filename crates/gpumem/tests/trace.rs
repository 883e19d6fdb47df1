//! Trace reading and replay.

use gpumem::trace::{parse_trace, read_trace, recorded, replay, Action};
use gpumem::Device;
use gpumem::{Config, Error};
use std::io::Write;

const TIB: u64 = 1 << 40;

#[path = "common/data.rs"]
mod common_data;
use common_data::data;

#[path = "common/budget.rs"]
mod budget;
use budget::assert_within_budget;

/// With classic segments, gpumem's policy is PyTorch's native one: replaying a real PyTorch
/// trace reproduces what PyTorch's allocator reserved, to the byte and segment.
#[test]
fn replay_of_real_pytorch_traces_matches_the_recorded_allocator() {
    for (name, events) in [
        ("resnet50_train.jsonl.gz", 15_356),
        ("gpt_train.jsonl.gz", 26_973),
    ] {
        let ev = read_trace(&data(name)).unwrap();
        assert_eq!(ev.len(), events);
        let rec = recorded(&ev);
        let classic = Config::parse("expandable_segments:False").unwrap();
        let ours = replay("gpumem", &ev, &classic, TIB).unwrap();
        assert_eq!(ours.peak_live_bytes, rec.peak_live_bytes, "{name}");
        assert_eq!(ours.peak_reserved_bytes, rec.peak_reserved_bytes, "{name}");
        assert_eq!(ours.segments_at_peak, rec.segments_at_peak, "{name}");
        assert!(ours.ns_per_event > 0.0);
    }
}

#[test]
fn a_replay_models_driver_time_at_the_cost_it_is_given() {
    // classic segments make the same calls whatever they cost (no time budget decides
    // anything there): their modelled time scales with the cost, call for call
    use gpumem::trace::{replay_simulated_at, CostModel};
    let ev = read_trace(&data("resnet50_train.jsonl.gz")).unwrap();
    let classic = Config::parse("expandable_segments:False").unwrap();
    let at = |f: f64| {
        replay_simulated_at(
            "c",
            &ev,
            &classic,
            TIB,
            None,
            CostModel::default().scaled(f),
        )
        .unwrap()
        .report
    };
    let (one, two) = (at(1.0), at(2.0));
    assert_eq!(one.device_calls, two.device_calls);
    assert!(one.critical_path_us > 0.0);
    assert!((two.critical_path_us / one.critical_path_us - 2.0).abs() < 1e-9);
    // and the default is the model's own figures
    let plain = replay("c", &ev, &classic, TIB).unwrap();
    assert_eq!(plain.critical_path_us, one.critical_path_us);
}

#[test]
fn recorded_figures_follow_the_segment_events() {
    let text = r#"{"action": "segment_alloc", "addr": 0, "size": 2097152, "stream": 0, "time_us": 1}
{"action": "alloc", "addr": 0, "size": 1000, "stream": 0, "time_us": 2}
{"action": "alloc", "addr": 1024, "size": 3000, "stream": 0, "time_us": 3}
{"action": "free_requested", "addr": 0, "size": 1000, "stream": 0, "time_us": 4}
{"action": "free_completed", "addr": 0, "size": 1000, "stream": 0, "time_us": 5}

{"action": "free_completed", "addr": 1024, "size": 3000, "stream": 0, "time_us": 6}
{"action": "segment_free", "addr": 0, "size": 2097152}
"#;
    let ev = parse_trace("t", text.as_bytes()).unwrap();
    assert_eq!(ev.len(), 7);
    assert_eq!(ev[3].action, Action::FreeRequested);
    let r = recorded(&ev);
    assert_eq!(
        (r.peak_live_bytes, r.peak_reserved_bytes, r.segments_at_peak),
        (4000, 2 << 20, 1)
    );
    // the segment came with the trace's first event
    assert_eq!(r.peak_reserved_at, Some(0.0));
    let ours = replay("gpumem", &ev, &Config::default(), TIB).unwrap();
    assert_eq!(ours.peak_reserved_bytes, 2 << 20);
    assert!((ours.ratio - (2 << 20) as f64 / 4000.0).abs() < 1e-9);
    // gpumem's came with the first allocation, the trace's second event of seven
    assert_eq!(ours.peak_reserved_at, Some(1.0 / 7.0));
}

/// A trace's `empty_cache` event (the program called `torch.cuda.empty_cache()`) empties the
/// replayed pool's cache there: the next, smaller block does not find the freed 100 MiB still
/// reserved, as it does in the same trace without the event.
#[test]
fn a_traces_empty_cache_empties_the_replayed_pools_cache() {
    let event = |action: &str, addr: u64, size: u64| {
        format!(
            r#"{{"action": "{action}", "addr": {addr}, "size": {size}, "stream": 0, "time_us": 1}}"#
        )
    };
    let big = 100 << 20;
    let mut lines = vec![
        event("alloc", 0, big),
        event("free_completed", 0, big),
        event("empty_cache", 0, 0),
        event("alloc", 1 << 30, 10 << 20),
        event("free_completed", 1 << 30, 10 << 20),
    ];
    for config in [
        Config::default(),
        Config::parse("expandable_segments:False").unwrap(),
    ] {
        let reserved_at_the_small_block = |lines: &[String]| {
            let ev = parse_trace("t", lines.join("\n").as_bytes()).unwrap();
            let r = gpumem::trace::replay_simulated("m", &ev, &config, TIB, None).unwrap();
            // (the timeline has a point per allocation and free: the small block's is the third)
            r.timeline[2].2
        };
        let emptied = reserved_at_the_small_block(&lines);
        let kept = reserved_at_the_small_block(
            &lines
                .iter()
                .filter(|l| !l.contains("empty_cache"))
                .cloned()
                .collect::<Vec<_>>(),
        );
        assert!(
            emptied < big && kept >= big,
            "{emptied} and {kept} bytes reserved"
        );
    }
    // the event is read by its name, and a trace with it replays to the end
    lines.push(event("alloc", 0, 8));
    let ev = parse_trace("t", lines.join("\n").as_bytes()).unwrap();
    assert_eq!(ev[2].action, Action::EmptyCache);
    assert!(replay("gpumem", &ev, &Config::default(), TIB).is_ok());
}

/// A job that empties its cache after every step (`torch.cuda.empty_cache()`, as some training
/// loops do) keeps its plan: gptfix's trace with an `empty_cache` where each step's live bytes
/// come down to their floor (the weights, gradients and optimizer state, 2.8 GB). Before, the
/// event dissolved the plans and reset the repeat detector, so every step was mapped again
/// block by block on the allocating thread (about 9 ms of page work a step in this replay);
/// now the plan leaves its region there and takes it up again at its next start, its pages
/// mapped ahead on the resource's thread. From the third step after the first emptying the
/// allocating thread's page work is the few calls the small pool makes after each (0-0.12
/// ms a step, against 11 and 9 ms in the two steps before), and the peak is no higher than
/// the trace's without the events (1.0101 against 1.0115, the GPU in step or 300 calls
/// behind).
#[test]
fn a_job_that_empties_its_cache_every_step_keeps_its_plan() {
    let events = read_trace(&data("torch_gptfix_train.jsonl.gz")).unwrap();
    let mut live = 0u64;
    let lv: Vec<u64> = events
        .iter()
        .map(|e| {
            match e.action {
                Action::Alloc => live += e.size,
                Action::FreeCompleted => live -= e.size,
                _ => {}
            }
            live
        })
        .collect();
    let n = events.len();
    let floor = *lv[n / 4..3 * n / 4].iter().min().unwrap();
    let low = |i: usize| lv[i] * 1000 <= floor * 1001;
    // the trace with the events, and where they fall among the replayed events
    let (mut with, mut marks, mut last, mut replayed) = (Vec::new(), Vec::new(), 0, 0);
    for (i, e) in events.iter().enumerate() {
        with.push(*e);
        if matches!(e.action, Action::Alloc | Action::FreeCompleted) {
            replayed += 1;
        }
        if i > 0 && low(i) && !low(i - 1) && (marks.is_empty() || i >= last + n / 20) {
            let mut ec = *e;
            (ec.action, ec.addr, ec.size) = (Action::EmptyCache, 0, 0);
            with.push(ec);
            marks.push(replayed);
            last = i;
        }
    }
    assert!(marks.len() >= 8, "{marks:?}");
    for lag in [None, Some(300)] {
        let r = gpumem::trace::replay_simulated("m", &with, &Config::default(), TIB, lag).unwrap();
        let per_step: Vec<f64> = marks
            .windows(2)
            .map(|w| (r.page_ns[w[1] - 1] - r.page_ns[w[0] - 1]) as f64 / 1e6)
            .collect();
        println!(
            "lag {lag:?}: {:.4}, page work on the allocating thread by step (ms) {per_step:.2?}",
            r.report.ratio
        );
        assert!(per_step[..2].iter().all(|&ms| ms > 5.0), "{per_step:?}");
        assert!(per_step[2..].iter().all(|&ms| ms < 0.3), "{per_step:?}");
        assert!(r.report.ratio <= 1.0116, "{}", r.report.ratio);
    }
}

#[test]
fn malformed_traces_are_errors_with_line_numbers() {
    let line = |action: &str, size: &str| {
        format!(
            r#"{{"action": "{action}", "addr": 4096, "size": {size}, "stream": 0, "time_us": 1}}"#
        )
    };
    for (text, needle) in [
        (
            format!("{}\n{}", line("alloc", "8"), line("explode", "8")),
            "t:2:",
        ),
        (
            format!("{}\n{}", line("alloc", "8"), line("alloc", "-8")),
            "t:2:",
        ),
        ("{\"action\": \"alloc\"\n".to_string(), "t:1:"),
        ("not json".to_string(), "t:1:"),
    ] {
        let e = parse_trace("t", text.as_bytes()).unwrap_err();
        assert!(matches!(e, Error::Trace(_)));
        assert!(e.to_string().contains(needle), "{e}");
    }
    // a free of an address that is not live names the event
    let ev = parse_trace("t", format!("{}\n", line("free_completed", "8")).as_bytes()).unwrap();
    let e = replay("gpumem", &ev, &Config::default(), TIB).unwrap_err();
    assert!(
        e.to_string()
            .contains("line 1: free of unknown address 0x1000"),
        "{e}"
    );
    // an unknown action names it
    let text = format!("{}\n{}", line("alloc", "8"), line("explode", "8"));
    let e = parse_trace("t", text.as_bytes()).unwrap_err().to_string();
    assert!(e.contains("explode") && e.contains("t:2:"), "{e}");
}

#[test]
fn pickles_whose_stack_frames_refer_to_themselves_are_read() {
    // a snapshot with stack traces (`_record_memory_history(context="all")`) shares frame
    // objects through the pickle's memo, which can make a structure refer to itself; the
    // events are read, the frames (which replay does not use) become None. Made with Python:
    // frames = []; frames.append(frames); {"segments": [], "device_traces": [[{"action":
    // "alloc", "addr": 4096, "size": 512, "stream": 0, "time_us": 1, "frames": frames}]]}
    let hex = "80027d71002858080000007365676d656e747371015d7102580d0000006465766963655f74726163\
               657371035d71045d71057d7106285806000000616374696f6e71075805000000616c6c6f63710858\
               040000006164647271094d0010580400000073697a65710a4d0002580600000073747265616d710b\
               4b00580700000074696d655f7573710c4b0158060000006672616d6573710d5d710e680e61756161\
               752e";
    let bytes: Vec<u8> = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let ev = gpumem::trace::read_pickle("p", &bytes[..]).unwrap();
    assert_eq!(ev.len(), 1);
    assert_eq!(
        (ev[0].action, ev[0].addr, ev[0].size),
        (Action::Alloc, 4096, 512)
    );
}

#[test]
fn pickles_with_bad_entries_are_errors_naming_the_entry() {
    use serde_pickle::{HashableValue as K, Value as V};
    let entry = |action: &str, size: i64| {
        let mut d = std::collections::BTreeMap::new();
        d.insert(K::String("action".into()), V::String(action.into()));
        d.insert(K::String("addr".into()), V::I64(4096));
        d.insert(K::String("size".into()), V::I64(size));
        d.insert(K::String("frames".into()), V::List(vec![]));
        V::Dict(d)
    };
    let snapshot = |entries: Vec<V>| {
        let mut top = std::collections::BTreeMap::new();
        top.insert(K::String("segments".into()), V::List(vec![]));
        top.insert(
            K::String("device_traces".into()),
            V::List(vec![V::List(entries)]),
        );
        serde_pickle::value_to_vec(&V::Dict(top), Default::default()).unwrap()
    };
    let ok = snapshot(vec![entry("alloc", 100), entry("free_completed", 100)]);
    let ev = gpumem::trace::read_pickle("p", &ok[..]).unwrap();
    assert_eq!(ev.len(), 2);
    assert_eq!(
        (ev[0].action, ev[0].size, ev[1].line),
        (Action::Alloc, 100, 2)
    );
    let e =
        gpumem::trace::read_pickle("p", &snapshot(vec![entry("alloc", 1), entry("zap", 1)])[..])
            .unwrap_err()
            .to_string();
    assert!(e.contains("entry 2") && e.contains("zap"), "{e}");
    let e = gpumem::trace::read_pickle("p", &snapshot(vec![entry("alloc", -5)])[..])
        .unwrap_err()
        .to_string();
    assert!(e.contains("entry 1") && e.contains("size"), "{e}");
    let e = gpumem::trace::read_pickle("p", &ok[..ok.len() - 3])
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a readable pickle"), "{e}");
}

/// gpumem records its own events; the recording replays to the same reserved peak, and
/// survives a JSON Lines round trip.
#[test]
fn recorded_traces_replay_to_the_same_peak() {
    use gpumem::workload::SplitMix;
    use gpumem::Stream;
    // no page moves (map and keep): the time budget that decides them runs on the device's
    // clock, which a live run and its replay read differently
    let mut keep = Config::parse("shards:1").unwrap();
    keep.pool.page_moves = false;
    for (conf, config) in [
        ("shards:1 (page moves off)", keep),
        (
            "shards:1,expandable_segments:False",
            Config::parse("shards:1,expandable_segments:False").unwrap(),
        ),
    ] {
        let (a, dev) = Device::simulated(TIB, config.clone()).unwrap();
        let mut live = Vec::new();
        let mut r = SplitMix::new(9);
        a.start_recording();
        for _ in 0..3000 {
            if live.len() > 40 || (r.below(3) == 0 && !live.is_empty()) {
                let i = r.below(live.len() as u64) as usize;
                a.deallocate(live.swap_remove(i)).unwrap();
            } else {
                let size = 256 << r.below(18);
                live.push(a.allocate(Stream(r.below(2)), size as usize, 256).unwrap());
            }
        }
        for x in live.drain(..) {
            a.deallocate(x).unwrap();
        }
        let events = a.stop_recording();
        assert!(a.stop_recording().is_empty(), "recording is off");
        let rec = recorded(&events);
        let peak = a.stats().reserved_bytes.all.peak;
        assert_eq!(rec.peak_reserved_bytes, peak, "{conf}");
        let again = replay("again", &events, &config, TIB).unwrap();
        assert_eq!(again.peak_reserved_bytes, peak, "{conf}");
        assert_eq!(again.peak_live_bytes, rec.peak_live_bytes);
        // round trip through a gzip file
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rec.jsonl.gz");
        gpumem::trace::write_trace(&path, &events).unwrap();
        let back = read_trace(&path).unwrap();
        assert_eq!(back.len(), events.len());
        assert!(back
            .iter()
            .zip(&events)
            .all(|(x, y)| (x.action, x.addr, x.size, x.stream)
                == (y.action, y.addr, y.size, y.stream)));
        drop(dev);
    }
}

#[test]
fn truncated_gzip_is_an_error_not_a_panic() {
    let full = std::fs::read(data("resnet50_train.jsonl.gz")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let cut = dir.join("cut.jsonl.gz");
    std::fs::File::create(&cut)
        .unwrap()
        .write_all(&full[..full.len() / 2])
        .unwrap();
    let e = read_trace(&cut).unwrap_err().to_string();
    assert!(
        e.contains("cut.jsonl.gz:") && e.contains("cannot read"),
        "{e}"
    );
    assert!(matches!(
        read_trace(&dir.join("missing.jsonl")),
        Err(Error::Trace(_))
    ));
}

/// Replay `events` with gpumem's default policy and with classic segments (PyTorch's native
/// policy); assert the default keeps its page moves within their time budget, its peak
/// reserved within `bound` of peak live bytes, and never above classic segments.
fn assert_replay(name: &str, events: &[gpumem::trace::TraceEvent], bound: f64) {
    let classic = Config::parse("expandable_segments:False").unwrap();
    let ours = replay("gpumem", events, &Config::default(), TIB).unwrap();
    let old = replay("classic", events, &classic, TIB).unwrap();
    println!(
        "{name:<26} {:>7} events  gpumem {:.4}  classic segments {:.4}  peak live {:.2} GiB  moves {:.1} ms",
        events.len(),
        ours.ratio,
        old.ratio,
        ours.peak_live_bytes as f64 / (1u64 << 30) as f64,
        ours.move_us / 1e3
    );
    assert_within_budget(name, events, &ours);
    assert!(
        ours.ratio >= 1.0 && ours.ratio <= bound,
        "{name}: {} above {bound}",
        ours.ratio
    );
    assert!(
        ours.ratio <= old.ratio + 1e-9,
        "{name}: {} > {}",
        ours.ratio,
        old.ratio
    );
}

fn real(name: &str, bound: f64) {
    assert_replay(name, &read_trace(&data(name)).unwrap(), bound);
}

fn synthetic(kind: gpumem::trace::synthetic::Kind, bound: f64) {
    assert_replay(kind.name(), &kind.generate(7, 1), bound);
}

// The workload kinds: real PyTorch traces (shared, and recorded on an H100 with
// scripts/record_torch_trace.py) and synthetic patterns. Each bound is the best of PyTorch's
// own settings (the trace README's and the README's real-run figures: gpt_train
// cudaMallocAsync 1.082 and expandable segments 1.105, resnet50 expandable 1.017, KV decoding
// expandable 1.036, varlen 1.069, MoE 1.087, resres 1.025): since handles span runs of pages,
// gpumem's budgeted policy is within every one. The synthetic kinds' bounds are measured
// (seed 7; 50 µs an event).
#[test]
fn fixed_shape_transformer_training() {
    // 1.020 measured (cudaMallocAsync 1.082, expandable segments 1.105)
    real("gpt_train.jsonl.gz", 1.082);
}

#[test]
fn convnet_training() {
    // 1.014 measured (expandable segments 1.017)
    real("resnet50_train.jsonl.gz", 1.017);
}

#[test]
fn pytorch_kv_cache_decoding() {
    // 1.042 measured (1.028 while the time budget started with a second's credit and did not
    // charge growth; expandable segments 1.036 in a real run, native 1.503)
    real("torch_kv_decode.jsonl.gz", 1.043);
}

#[test]
fn pytorch_variable_sequence_length() {
    real("torch_varlen_train.jsonl.gz", 1.069);
}

#[test]
fn synthetic_variable_sequence_length() {
    synthetic(gpumem::trace::synthetic::Kind::VariableSeqLen, 1.049);
}

#[test]
fn synthetic_kv_cache_by_concatenation() {
    synthetic(gpumem::trace::synthetic::Kind::KvCacheDecode, 1.026);
}

#[test]
fn synthetic_tiny_next_to_huge() {
    synthetic(gpumem::trace::synthetic::Kind::MixedTinyHuge, 1.179);
}

#[test]
fn synthetic_several_streams() {
    synthetic(gpumem::trace::synthetic::Kind::MultiStream, 1.018);
}

#[test]
fn synthetic_convnet_training() {
    synthetic(gpumem::trace::synthetic::Kind::ConvTraining, 1.02);
}

#[test]
fn synthetic_traces_are_deterministic_and_well_formed() {
    use gpumem::trace::synthetic::Kind;
    for kind in Kind::ALL {
        let a = kind.generate(3, 1);
        assert_eq!(a, kind.generate(3, 1), "{}", kind.name());
        assert_ne!(a, kind.generate(4, 1), "{}", kind.name());
        let mut live = std::collections::HashSet::new();
        for e in &a {
            match e.action {
                Action::Alloc => assert!(live.insert(e.addr)),
                Action::FreeCompleted => assert!(live.remove(&e.addr)),
                _ => panic!("unexpected {:?}", e.action),
            }
        }
        assert!(live.is_empty(), "{}: everything is freed", kind.name());
        assert_eq!(Kind::from_name(kind.name()), Some(kind));
    }
}

/// A real PyTorch snapshot pickle (`scripts/record_torch_trace.py --pickle` on an H100 with
/// `scripts/workloads/tiny_train.py`) is read directly.
#[test]
fn reads_a_real_pytorch_snapshot_pickle() {
    let ev = read_trace(&data("torch_tiny_train.pickle")).unwrap();
    assert_eq!(ev.len(), 204);
    let count = |a: Action| ev.iter().filter(|e| e.action == a).count();
    assert_eq!(count(Action::FreeRequested), count(Action::FreeCompleted));
    assert_eq!(
        (count(Action::Alloc), count(Action::FreeCompleted)),
        (78, 60)
    );
    assert!(count(Action::SegmentAlloc) >= 1);
    assert!(ev.windows(2).all(|w| w[0].time_us <= w[1].time_us));
    let rec = recorded(&ev);
    assert_eq!(rec.peak_reserved_bytes, 72 << 20);
    assert!((rec.ratio - 1.024).abs() < 0.001, "{}", rec.ratio);
    let ours = replay("gpumem", &ev, &Config::default(), TIB).unwrap();
    assert!(ours.ratio <= rec.ratio + 1e-9);
}

/// The replay's driver cost model: every real trace gets its modelled driver time (the page
/// engine's counted calls at H100 costs) and its share of the trace's wall time, at most 1% on
/// every one, with pages (the default) and with classic segments, with the GPU in step with
/// the host and 3000 calls behind it: moves (and the maps below the high-water mark their
/// unmaps make necessary) are paid from 1% of the time and from what growth took (traces of
/// a few steps, whose first step maps everything, included).
#[test]
fn the_cost_model_keeps_driver_time_within_one_percent_on_every_real_trace() {
    use gpumem::trace::CostModel;
    for name in [
        "gpt_train.jsonl.gz",
        "resnet50_train.jsonl.gz",
        "torch_kv_decode.jsonl.gz",
        "torch_varlen_train.jsonl.gz",
        "torch_gptfix_train.jsonl.gz",
        "torch_moe_train.jsonl.gz",
        "torch_moe16_train.jsonl.gz",
        "torch_moe40_train.jsonl.gz",
        "torch_resres_train.jsonl.gz",
        "torch_serve.jsonl.gz",
        "torch_vit_train.jsonl.gz",
        "torch_gptenc_train.jsonl.gz",
        "torch_accum_train.jsonl.gz",
        "torch_streams_train.jsonl.gz",
        "torch_lora_train.jsonl.gz",
        "torch_prefill.jsonl.gz",
        "torch_phases_train.jsonl.gz",
        "torch_traineval_train.jsonl.gz",
        "torch_detect_train.jsonl.gz",
        "torch_effnet_train.jsonl.gz",
        // held-out jobs, recorded (H200) after the policy was set (stop 92)
        "torch_lstm_train.jsonl.gz",
        "torch_points_train.jsonl.gz",
        "torch_bertamp_train.jsonl.gz",
        "torch_offload_train.jsonl.gz",
        "torch_sample.jsonl.gz",
    ] {
        let events = read_trace(&data(name)).unwrap();
        for conf in ["", "expandable_segments:False"] {
            // the GPU in step with the host, and 3000 allocator calls behind it
            for lag in [None, Some(3000)] {
                let config = Config::parse(conf).unwrap();
                let r = gpumem::trace::replay_simulated("m", &events, &config, TIB, lag)
                    .unwrap()
                    .report;
                let share = r.critical_path_share.expect("real traces have times");
                println!(
                    "{name} [{conf}] lag {lag:?}: {:.2} ms, {:.2}% of wall",
                    r.critical_path_us / 1e3,
                    share * 100.0
                );
                assert!(
                    r.critical_path_us > 0.0 && share > 0.0 && share <= 0.01,
                    "{name} [{conf}] lag {lag:?}: {:.2}% of wall ({r:?})",
                    share * 100.0
                );
            }
        }
    }
    // the arithmetic: the page engine's calls (4 creates, 10 maps, 2 set-access calls over
    // the 10 pages, 3 unmaps of which 1 in the background, 2 releases, 1 event record, 1
    // wait) and one host synchronisation
    let s = gpumem::Stats {
        num_unmap_syncs: 1,
        ..Default::default()
    };
    let c = gpumem::resource::VmmCalls {
        creates: 4,
        maps: 10,
        set_access: 2,
        unmaps: 3,
        unmaps_background: 1,
        releases: 2,
        records: 1,
        waits: 1,
        ..Default::default()
    };
    let m = CostModel::default();
    let (fg, bg) = m.cost(&s, Some(&c));
    let want = 4.0 * m.create_us
        + 10.0 * m.map_us
        + 10.0 * m.set_access_us
        + 2.0 * m.unmap_us
        + m.record_us
        + 2.0 * m.sync_stall_us;
    assert!((fg - want).abs() < 1e-9 && (bg - 2.0 * m.release_us - m.unmap_us).abs() < 1e-9);
    // classic segments: every cuMemAlloc and cuMemFree on the allocating thread
    let mut s = gpumem::Stats {
        num_device_alloc: 3,
        num_device_free: 1,
        ..Default::default()
    };
    s.reserved_bytes.all.allocated = 4 << 20;
    let (fg, bg) = m.cost(&s, None);
    assert!((fg - (4.0 * m.segment_us + 4.0 * m.segment_us_per_mib)).abs() < 1e-9 && bg == 0.0);
}

/// An inference loop at a batch drawn per request (`bench_torch.py`'s sample job, recorded on
/// an H200 after the policy was set): residual blocks of one width twice in a row repeat
/// inside each denoising step, and the detector finds those short periods over and over.
/// Their plans are given up before they serve a whole cycle; past `MAX_WASTED` of them the
/// job gets no new plan (`pool/plan`). Measured: 1.2624 / 1.2006 / 1.2212 of the live peak
/// with 230 / 203 / 202 driver calls, with the GPU in step, 300 and 3,000 calls behind;
/// 1.2727 / 1.2418 / 1.2470 and 267 / 240 / 239 while each such period was planned anew
/// (over 60 requests, 356-501 calls); PyTorch recorded 1.2933.
#[test]
fn an_inference_loop_whose_short_periods_never_last_is_not_planned_over_and_over() {
    let events = read_trace(&data("torch_sample.jsonl.gz")).unwrap();
    let rec = recorded(&events);
    for lag in [None, Some(300), Some(3000)] {
        let r = gpumem::trace::replay_simulated("m", &events, &Config::default(), TIB, lag)
            .unwrap()
            .report;
        assert!(
            r.ratio <= rec.ratio && r.device_calls <= 235,
            "lag {lag:?}: {:.4} (recorded {:.4}), {} calls",
            r.ratio,
            rec.ratio,
            r.device_calls
        );
    }
}

/// The time budget's windows (`pool/budget.rs`): after the warm-up (a second past the last
/// time the live bytes' peak grew by 1% or more), no second of any real trace's time holds more
/// page work on the allocating thread than 1% of it (`PolicyReport::worst_window_share`: the
/// work as the pool measured it, on the simulator the modelled calls), with the GPU in step,
/// 300 and 3000 calls behind. The MoE job over 40 steps is the trace whose windows were
/// passed (2.46% / 2.07% with the GPU in step / 3000 behind, its moves right up to the credit's
/// overdraft), as its real run on an H200 was (1.62% over steps 11-20, 1.03 s, moves resumed
/// as its peak grew by a few MB); most traces end within a second or two of their warm-up.
#[test]
fn after_the_warm_up_no_second_of_page_work_passes_one_percent_on_any_real_trace() {
    let mut windows = 0;
    for name in [
        "gpt_train.jsonl.gz",
        "torch_kv_decode.jsonl.gz",
        "torch_varlen_train.jsonl.gz",
        "torch_moe16_train.jsonl.gz",
        "torch_moe40_train.jsonl.gz",
        "torch_serve.jsonl.gz",
        "torch_streams_train.jsonl.gz",
        "torch_accum_train.jsonl.gz",
        "torch_unet_train.jsonl.gz",
        "torch_lora_train.jsonl.gz",
        "torch_prefill.jsonl.gz",
        "torch_phases_train.jsonl.gz",
        "torch_traineval_train.jsonl.gz",
        "torch_buckets_train.jsonl.gz",
        "torch_detect_train.jsonl.gz",
        "torch_effnet_train.jsonl.gz",
        "torch_lstm_train.jsonl.gz",
        "torch_points_train.jsonl.gz",
        "torch_bertamp_train.jsonl.gz",
        "torch_offload_train.jsonl.gz",
        "torch_sample.jsonl.gz",
    ] {
        let events = read_trace(&data(name)).unwrap();
        for lag in [None, Some(300), Some(3000)] {
            let r = gpumem::trace::replay_simulated("m", &events, &Config::default(), TIB, lag)
                .unwrap()
                .report;
            println!(
                "{name} lag {lag:?}: worst second {:?}",
                r.worst_window_share
            );
            if let Some(w) = r.worst_window_share {
                windows += 1;
                assert!(
                    w <= 0.01,
                    "{name} lag {lag:?}: {:.2}% of a second",
                    w * 100.0
                );
            }
        }
    }
    assert!(
        windows >= 24,
        "{windows} replays with a second after their warm-up"
    );
    // the MoE job's seconds after its warm-up (from 2.6 s of its 7.1 s)
    let events = read_trace(&data("torch_moe40_train.jsonl.gz")).unwrap();
    let r = gpumem::trace::replay_simulated("m", &events, &Config::default(), TIB, None).unwrap();
    assert!(r.report.worst_window_share.is_some_and(|w| w > 0.002));
}

#[test]
fn pytorch_moe_training() {
    real("torch_moe_train.jsonl.gz", 1.087);
}

/// The same MoE job over 16 steps (`bench_torch.py --worker moe native --steps 16`).
#[test]
fn pytorch_moe_training_16_steps() {
    real("torch_moe16_train.jsonl.gz", 1.087);
}

/// The fixed-shape GPT of `scripts/bench_torch.py` (gptfix) over 10 steps, as benchmarked on
/// the H100 (`record_torch_trace.py -- bench_torch.py --worker gptfix native --steps 10`):
/// native 1.062, expandable segments 1.110 in the same session.
#[test]
fn pytorch_fixed_shape_gpt_as_benchmarked() {
    real("torch_gptfix_train.jsonl.gz", 1.062);
}

/// The same job is planned: its optimizer's state, created in the first step, lies in the
/// holes the step's activations left, and the plan fills the gaps between those blocks before
/// it places the rest above them (the fixed blocks plus the step's peak of live bytes, 9.997
/// GB; 10.52 GB around them block by block). At step 4's start the logits step 3 keeps (500
/// MiB) lie high in the segment, where the dynamic layout left them: placed from the bottom up
/// around them the plan spanned 10,034 MiB, past the 9,738 it may, and was declined until step
/// 5's start. Placed upside down (`place_reflected`) it spans 9,536 and is taken at step 4's.
/// The allocating thread's last page work comes at a third of the events, at every lag; the
/// only driver calls after it give back, once, what the region does not use (see
/// `a_planned_job_holds_what_its_plan_needs`), a step or two later (with the GPU 300 calls
/// behind, at 0.66 of the events, in the idle stretch of the handle's slots), none in the
/// last three steps. gpt_train's plan was declined at its step 4 the same way with the GPU
/// behind (page work until 0.76 of its events; then 0.41). The plan's first period maps the
/// pages its slots use in the holes the dynamic layout left (398 MiB of gptfix's) on the
/// resource's thread, from its start (`plan_map_ahead`): that period made 16 calls and 0.6
/// ms of page work on the allocating thread (its last at 0.33 of gptfix's events; 0.39-0.41
/// of gpt_train's), now none (0.23-0.31 and 0.29-0.38: the last are step 3's, or the event
/// recorded for the pages the plan does not use, with the GPU behind).
#[test]
fn the_fixed_shape_gpt_is_planned_and_its_later_steps_make_no_driver_call() {
    for (name, most) in [
        ("torch_gptfix_train.jsonl.gz", 32),
        ("gpt_train.jsonl.gz", 39),
    ] {
        for lag in [None, Some(300), Some(3000)] {
            let r = default_replay(name, lag, gpumem::trace::CostModel::default());
            let n = r.calls.len();
            let quiet = |v: &[u64]| v.iter().position(|&x| x == v[n - 1]).unwrap();
            let (work, calls) = (quiet(&r.page_ns), quiet(&r.calls));
            println!(
                "{name} lag {lag:?}: page work until event {work}, calls until {calls}, of {n}"
            );
            assert!(work * 100 < n * most, "{name} lag {lag:?}: {work} of {n}");
            assert!(calls * 10 < n * 7, "{name} lag {lag:?}: {calls} of {n}");
        }
    }
}

/// Trace `name` replayed with the default policy, the GPU `lag` calls behind, on a device
/// whose driver calls cost `cost`.
fn default_replay(
    name: &str,
    lag: Option<u64>,
    cost: gpumem::trace::CostModel,
) -> gpumem::trace::Replay {
    use gpumem::trace::{replay_simulated_at, SIM_CAPACITY};
    let events = read_trace(&data(name)).unwrap();
    replay_simulated_at(
        "gpumem",
        &events,
        &Config::default(),
        SIM_CAPACITY,
        lag,
        cost,
    )
    .unwrap()
}

/// Trace `name` replayed with the default policy, the GPU `lag` calls behind: the replay, the
/// replayed event at which its last driver call was made, and how many events it replayed.
fn last_driver_call(name: &str, lag: Option<u64>) -> (gpumem::trace::Replay, usize, usize) {
    let r = default_replay(name, lag, gpumem::trace::CostModel::default());
    let n = r.calls.len();
    let last = r.calls[n - 1];
    let quiet_from = r.calls.iter().position(|&c| c == last).unwrap();
    (r, quiet_from, n)
}

/// The UNet of `scripts/bench_torch.py` (recorded on an H200 with the native allocator, 12
/// steps; held out from the policy, see `real_traces_with_a_lagging_gpu`) is the one real
/// trace whose modelled driver time over the whole run passes 1% of its wall time: 1.11% with
/// the GPU in step and 1.48% with it 3000 calls behind (growth 10.5 / 14.4 ms, moves 21.1 /
/// 28.1 ms of a 2.87 s trace). All but 0.5 ms of it falls in the trace's first 30% of lines,
/// about the job's first three steps (its first step alone takes 1.5 s of the trace), the
/// rest where the job's plan takes its region (the last call at 42% of the replayed events):
/// the issue's budget holds over every window after that (no call at all there), and the
/// whole-run share falls with every further step (1.72% / 2.35% over that first 30%). What
/// is asserted: no driver call in the second half of the events, and the whole-run share as
/// measured.
#[test]
fn the_unet_makes_its_driver_calls_in_its_first_steps_only() {
    for lag in [None, Some(3000)] {
        let (r, quiet_from, n) = last_driver_call("torch_unet_train.jsonl.gz", lag);
        let share = r
            .report
            .critical_path_share
            .expect("real traces have times");
        println!(
            "lag {lag:?}: the last driver call at event {quiet_from} of {n}; {:.2}% of wall",
            share * 100.0
        );
        assert!(
            quiet_from * 2 < n,
            "lag {lag:?}: calls until event {quiet_from} of {n}"
        );
        assert!(
            share <= 0.0149,
            "lag {lag:?}: {:.2}% of wall",
            share * 100.0
        );
    }
}

/// The bucketing job of `scripts/bench_torch.py` (`buckets`: a length drawn per step from
/// four, in no order; recorded on an H200 with the native allocator in stop 83, 24 steps,
/// held out from the policy) passes 1% of its wall time over its whole run with the GPU 3000
/// calls behind: 1.02% (0.76% in step, 0.95% 300 behind). Its page work is the growth and
/// moves of its first steps, each of the four lengths a new peak when it first comes (16.5
/// of its 23 ms in the first tenth of its events), then 1 ms in its last tenth. Asserted as
/// measured, and that four fifths of it falls in the first fifth of the events; issue 31's 1%
/// over the whole run is missed here.
#[test]
fn the_bucketing_job_makes_its_driver_calls_in_its_first_steps() {
    for (lag, most) in [(None, 0.0077), (Some(300), 0.0096), (Some(3000), 0.0103)] {
        let r = default_replay(
            "torch_buckets_train.jsonl.gz",
            lag,
            gpumem::trace::CostModel::default(),
        );
        let share = r
            .report
            .critical_path_share
            .expect("real traces have times");
        let n = r.page_ns.len();
        let (early, all) = (r.page_ns[n / 5], r.page_ns[n - 1]);
        println!(
            "lag {lag:?}: {:.2}% of wall; {:.1} of {:.1} ms of page work in the first fifth",
            share * 100.0,
            early as f64 / 1e6,
            all as f64 / 1e6
        );
        assert!(share <= most, "lag {lag:?}: {:.2}% of wall", share * 100.0);
        assert!(
            early * 5 >= all * 4,
            "lag {lag:?}: {early} of {all} ns early"
        );
    }
}

/// The real traces of fixed-shape jobs, once their plans have served a cycle: the pages of
/// the region that no slot uses (fragmentation left by the dynamic layout of the first
/// steps, the plan's peak being the job's) go back, and what the job holds from then on is
/// within 0.3% of what is live (the UNet's 0.8%), where the whole run's peak stays where the
/// first steps put it (ViT 1.0248, gptfix 1.0115: it was that from the plan's first step on
/// before, 1.0224 and 1.0063, and the same with the GPU 3000 calls behind, whose checkpoints
/// complete too late for the handles to be split now). Measured over the last 30% of each
/// trace (its last three steps of ten), the GPU in step with the host and 300 calls behind.
#[test]
fn a_planned_job_holds_what_its_plan_needs() {
    for (name, bound) in [
        ("torch_vit_train.jsonl.gz", 1.003),
        ("torch_gptfix_train.jsonl.gz", 1.001),
        ("torch_gptenc_train.jsonl.gz", 1.002),
        // a handle of its region had a slot taken before each try's checkpoint completed,
        // at the same point of every cycle, with the GPU 300 calls behind (1.0148); a try
        // now comes again where that handle's slots are idle longest (`plan_retry_when_idle`)
        ("torch_unet_train.jsonl.gz", 1.009),
        // held out (stop 84): 1.0036 / 1.0045
        ("torch_effnet_train.jsonl.gz", 1.005),
    ] {
        for lag in [None, Some(300)] {
            let (settled, run) = settled_ratio(name, lag);
            println!("{name} lag {lag:?}: {settled:.4} over the last 30%, {run:.4} over the run");
            assert!(settled <= bound, "{name} lag {lag:?}: {settled:.4}");
        }
    }
}

/// Trace `name` replayed with the GPU `lag` calls behind: peak reserved over peak live over
/// its last 30% (a plan's settled state), and over the whole run.
fn settled_ratio(name: &str, lag: Option<u64>) -> (f64, f64) {
    let events = read_trace(&data(name)).unwrap();
    let r = gpumem::trace::replay_simulated("m", &events, &Config::default(), TIB, lag).unwrap();
    let late = &r.timeline[r.timeline.len() * 7 / 10..];
    let live = late.iter().map(|x| x.1).max().unwrap();
    let reserved = late.iter().map(|x| x.2).max().unwrap();
    (reserved as f64 / live as f64, r.report.ratio)
}

/// A handle of a plan's region is split (unmapped whole, its slots' pages mapped again) only
/// once the GPU is known done with it: with a GPU that never catches up (no event completes
/// until the pool synchronises), no handle is split, and only the handles no slot uses go
/// back, in stream order (ViT 1.0129 over the last 30% where a GPU in step gives 1.0029).
#[test]
fn a_plan_splits_a_handle_only_once_the_gpu_is_done_with_it() {
    for name in ["torch_vit_train.jsonl.gz", "torch_gptfix_train.jsonl.gz"] {
        let (done, never) = (
            settled_ratio(name, None).0,
            settled_ratio(name, Some(u64::MAX)).0,
        );
        println!("{name}: {done:.4} with the GPU in step, {never:.4} with it never done");
        assert!(done < never - 0.005, "{name}: {done:.4} against {never:.4}");
    }
}

#[test]
fn pytorch_resnet_variable_resolution() {
    real("torch_resres_train.jsonl.gz", 1.025);
}

/// The real traces on a simulated GPU that runs behind the host (by 300 and 3000 allocator
/// calls; see `replay_simulated`): what a real run looks like, where pages freed during a step
/// are not known idle at once. Page moves stay within their time budget; each ratio stays
/// within its bound, measured on this code (the worst of the three lags).
#[test]
fn real_traces_with_a_lagging_gpu() {
    let cases = [
        // 1.0223 / 1.0118 / 1.0118 since growth takes nothing from the moves' credit (1.0173
        // at worst before, with 1.034 at 1.7 times the model's driver costs, where it now
        // gives 1.019); 1.0909 with the GPU behind before moves could be paid from growth's
        // account; native 1.137, expandable segments 1.105
        ("gpt_train.jsonl.gz", 1.023),
        // 1.0155 with the GPU 300 calls behind (1.015 before growth's account)
        ("resnet50_train.jsonl.gz", 1.016),
        ("torch_varlen_train.jsonl.gz", 1.026),
        ("torch_kv_decode.jsonl.gz", 1.043),
        // 1.0266 / 1.0164 / 1.0296 at the three lags since maps below the high-water mark
        // are charged to the moves' credit (1.0251 with the GPU 3000 calls behind before, at
        // 1.13% of the trace's time, now 0.81%); the same with a quick cache of one block (1.028 /
        // 1.040 / 1.078 with 16); expandable segments 1.087. The real job on the H100:
        // 1.109 before growth's account, 1.056-1.121 with it, 1.039 and 1.054 with the quick
        // cache of one block
        ("torch_moe_train.jsonl.gz", 1.03),
        // 1.0687 / 1.0631 / 1.0853 since maps below the high-water mark are charged to the
        // moves' credit (1.069 / 1.068 / 1.084 before, at 1.03% of the trace's time with the
        // GPU 3000 calls behind, now 0.82%); 1.0378 / 1.0401 / 1.0631 before growth took
        // nothing from the credit; 1.0744 / - / 1.0699 with a quick cache of 16 blocks;
        // expandable segments 1.087
        ("torch_moe16_train.jsonl.gz", 1.086),
        // 1.0106 / 1.0129 / 1.0129 (1.018 at worst with 16 blocks)
        ("torch_resres_train.jsonl.gz", 1.013),
        // 1.0331 at every lag since moves in stream order pass over stretches of free pages
        // too short to move for longer ones, once the job has repeated and while no plan
        // follows it (1.0461 / 1.0677 / 1.0720 before; 1.072 / - / 1.089 with 16 blocks)
        ("torch_serve.jsonl.gz", 1.034),
        // 1.0115 / 1.0122 / 1.0122 (1.0119 at every lag with 16 blocks; 1.0587 with the GPU 3000
        // calls behind before growth's account)
        ("torch_gptfix_train.jsonl.gz", 1.013),
        // ViT-B/16, batch 32, AdamW (bench_torch's vit, recorded on the H100 with the native
        // allocator, 10 steps; native 1.098 there): 1.0248 / 1.0248 / 1.0248, set in step 2
        // by free memory inside handles live blocks hold part of, before a plan can exist
        // (the H100: 1.028)
        ("torch_vit_train.jsonl.gz", 1.025),
        // bench_torch's `gpt` (nn.TransformerEncoder, 12 layers, d 1024, batch 8 x 1024, bf16
        // autocast, AdamW; recorded on the H100 with the native allocator, 12 steps; native
        // 1.090): 1.0098 / 1.0124 / 1.0129. The H100 with gpumem gives 1.010, 1.025 or 1.057
        // by process: the first steps' moves are paid from a credit that accrues with wall time
        // since the first page call, and whether a request that needs pages in step 1 or 2
        // finds credit at its moment differs from process to process (README, "Every workload,
        // every setting"). At three times the model's driver costs the replay gives 1.0251.
        ("torch_gptenc_train.jsonl.gz", 1.013),
        // Three jobs of `scripts/bench_torch.py` recorded on an H200 (2026-11-28,
        // `record_torch_trace.py -- bench_torch.py --worker W native --steps 12`) after the
        // policy was written, so held out from it. accum (gradient accumulation over 4
        // micro-batches, GradScaler, clipping, AdamW; native 1.193): 1.0624 / 1.0652 / 1.0652,
        // set in the first micro-batches, where 142 MiB of free pages lie in handles live
        // blocks also cover (the H200 with gpumem: 1.076).
        ("torch_accum_train.jsonl.gz", 1.066),
        // unet (a diffusion UNet, bf16, AdamW; native 1.070): 1.0415 / 1.0352 / 1.0352 (the
        // H200: 1.043)
        ("torch_unet_train.jsonl.gz", 1.042),
        // streams (two decoders on two streams, a length drawn per step; native 2.894):
        // 1.1573 / 1.1565 / 1.1501 (the H200: 1.106)
        ("torch_streams_train.jsonl.gz", 1.158),
        // the MoE job over 40 steps (recorded on an H200 2026-11-28, `record_torch_trace.py --
        // bench_torch.py --worker moe native --steps 40`; native 1.356): 1.0637 / 1.0675 /
        // 1.0901, its peak creeping step by step once moves stop (1.0938 / 1.0803 / 1.0957
        // before the windows of page work after the warm-up, whose refused moves overdraw
        // nothing and so do not stop the rest; the H200 with gpumem over 30 steps: 1.080-1.090)
        ("torch_moe40_train.jsonl.gz", 1.091),
        // Two jobs of the kinds the brief's held-out runs named, added to `bench_torch.py`
        // and recorded on an H200 2026-11-28 (`record_torch_trace.py -- bench_torch.py
        // --worker W native --steps N`) after the policy was written. LoRA fine-tuning with
        // gradient checkpointing (10 steps; native 1.292): 1.0186 at every lag. Before a
        // plan's first take-up warmed the job up, 1.1286 / 1.0936 (the region's moves refused
        // by the window, grown instead); before a block live across a plan's start could be
        // held where it lies only until its free, 1.1578 with the GPU 3,000 calls behind (its
        // plan declined at both starts, 6,174 and 5,634 MiB against a high-water mark of 5,558,
        // and the dynamic layout, which moves 1.3 GB of pages a step around the loss, grew 704
        // MiB in step 4). The H200 with gpumem: 1.019 (expandable segments 1.125).
        ("torch_lora_train.jsonl.gz", 1.019),
        // Long-context prefill (16 steps, a length drawn per step from 512 to 16,384 tokens;
        // native 1.551): 1.0055 / 1.0986 / 1.0944. With the GPU behind, a longer prompt's
        // logits come while the last one's free pages are not yet known idle: growth, as
        // each longer prompt raises the peak (the H200 with gpumem: 1.005 and 1.023 in two
        // calls; expandable segments 1.111).
        ("torch_prefill.jsonl.gz", 1.099),
        // Training in phases (`bench_torch.py`'s phases: the GPT at 512 then 1,024 tokens in
        // runs of 6 steps, each length coming back, an evaluation pass after each run;
        // recorded on an H200 2026-11-29, `record_torch_trace.py -- bench_torch.py --worker
        // phases native --steps 30`; native 1.085): 1.0088 / 1.0075 / 1.0075, three plans. A
        // plan taken up again maps its holes on the resource's thread (`plan_map_ahead`): the
        // allocating thread's calls 849 / 815 / 809 -> 823 / 786 / 780 (the H200 with gpumem:
        // 1.008, step 20's calls 31 -> 1-2 on the allocating thread).
        ("torch_phases_train.jsonl.gz", 1.009),
        // Two more jobs new to `bench_torch.py` in stop 83, recorded the same way (24 steps):
        // traineval (the GPT at 1,024 tokens, an evaluation pass every 4 steps; native 1.307):
        // 1.0102 / 1.0120 / 1.0120 (the H200 with gpumem: 1.025, expandable segments 1.062).
        ("torch_traineval_train.jsonl.gz", 1.013),
        // buckets (a length drawn per step from 256, 512, 768 and 1,024 tokens, in no order;
        // native 1.062): 1.0251 / 1.0087 / 1.0087 (the H200 with gpumem: 1.025, expandable
        // segments 1.063).
        ("torch_buckets_train.jsonl.gz", 1.026),
        // Two jobs new to `bench_torch.py` in stop 84, recorded the same way (16 steps) after
        // the policy was written. detect: Faster R-CNN (ResNet-50 FPN) trained on images of a
        // size drawn per image, with 1-8 random boxes each, so the padded batch, the proposals
        // and the sampled boxes change size every step (native 1.212): 1.0022 / 1.0037 /
        // 1.0085 (the H200 with gpumem: 1.005; native 1.209, expandable segments 1.013,
        // cudaMallocAsync 1.059).
        ("torch_detect_train.jsonl.gz", 1.009),
        // effnet: EfficientNet-B0 at a fixed shape, many small tensors (native 1.097): 1.0068 /
        // 1.0068 / 1.0095, its peak in its first steps, 1.0036-1.0045 over its last 30%.
        ("torch_effnet_train.jsonl.gz", 1.010),
    ];
    for (name, bound) in cases {
        let events = read_trace(&data(name)).unwrap();
        for lag in [None, Some(300), Some(3000)] {
            let r = gpumem::trace::replay_simulated(
                "gpumem",
                &events,
                &Config::default(),
                gpumem::trace::SIM_CAPACITY,
                lag,
            )
            .unwrap()
            .report;
            println!(
                "{name:<28} lag {lag:>10?}: ratio {:.4}, {} driver calls, {} waits, moves {:.1} ms",
                r.ratio,
                r.device_calls,
                r.unmap_syncs,
                r.move_us / 1e3
            );
            assert_within_budget(name, &events, &r);
            assert!(
                r.ratio >= 1.0 && r.ratio <= bound,
                "{name} lag {lag:?}: {} above {bound}",
                r.ratio
            );
        }
    }
}

/// A run of pages a block needs is one physical handle (up to 32 pages): setting access and
/// unmapping cost per handle (measured on the H100), so a training job maps far fewer handles
/// than pages; `expandable_page_mb:8` cuts them further at little memory.
#[test]
fn a_run_of_pages_is_one_handle() {
    let events = read_trace(&data("resnet50_train.jsonl.gz")).unwrap();
    let run = |conf: &str| {
        let r = replay("m", &events, &Config::parse(conf).unwrap(), TIB).unwrap();
        (r.vmm_calls.expect("expandable segments"), r.ratio)
    };
    let (small, small_ratio) = run("");
    let (large, large_ratio) = run("expandable_page_mb:8");
    // ~1,550 pages of 2 MiB at the peak (3.0 GiB)
    assert!(small.maps < 450 && small.creates < 400, "{small:?}");
    assert!(large.maps < small.maps, "2 MiB {small:?}\n8 MiB {large:?}");
    assert!(
        small_ratio < 1.017 && large_ratio < 1.02,
        "{small_ratio} {large_ratio}"
    );
}

/// `gpumem advise` tries page sizes and policies, and names the one that reserves least among
/// those within 1% of the trace's wall time: the default (2 MiB pages) is within it on every
/// trace (resnet50 and MoE needed 8 and 16 MiB pages before the time budget), and the advice
/// reserves no more than the default.
#[test]
fn advice_within_the_time_budget_reserves_no_more_than_the_default() {
    use gpumem::trace::advise::advise;
    for name in [
        "gpt_train.jsonl.gz",
        "resnet50_train.jsonl.gz",
        "torch_moe_train.jsonl.gz",
    ] {
        let events = read_trace(&data(name)).unwrap();
        let a = advise(name, &events, &[]).unwrap();
        assert!(a.candidates[0].within_time_budget, "{name}: 2 MiB pages");
        let w = &a.candidates[a.best_within_budget.expect("the default is")];
        assert!(
            w.report.peak_reserved_bytes <= a.candidates[0].report.peak_reserved_bytes,
            "{name}: {}",
            w.conf
        );
    }
}

/// The report says why a peak was not held down: free pages that no move could take. A block
/// of 2 MiB taken from a freed block of 64 MiB (one physical handle) leaves the other 62 MiB
/// of that handle stranded, and the next allocation grows the pool past them.
#[test]
fn the_report_counts_free_pages_no_move_can_take_at_the_peak() {
    const MIB: u64 = 1 << 20;
    let ev = |t: u64, action: &str, addr: u64, size: u64| {
        format!(
            "{{\"action\": \"{action}\", \"addr\": {addr}, \"size\": {size}, \"time_us\": {t}}}\n"
        )
    };
    let text = [
        ev(1, "alloc", 0x1000, 64 * MIB),
        ev(2, "alloc", 0x2000, 64 * MIB),
        ev(3, "free_completed", 0x1000, 64 * MIB),
        ev(4, "alloc", 0x3000, 2 * MIB),
        ev(5, "alloc", 0x4000, 100 * MIB),
        ev(6, "free_completed", 0x4000, 100 * MIB),
    ]
    .concat();
    let events = parse_trace("t", text.as_bytes()).unwrap();
    let r = replay("t", &events, &Config::default(), TIB).unwrap();
    assert_eq!(
        (r.movable_at_peak, r.stranded_at_peak),
        (0, 62 * MIB),
        "{r:?}"
    );
    // (the peak: the 100 MiB allocation, the fifth of six events)
    assert_eq!(r.peak_reserved_at, Some(4.0 / 6.0));
    let classic = Config::parse("expandable_segments:False").unwrap();
    let r = replay("t", &events, &classic, TIB).unwrap();
    assert_eq!((r.movable_at_peak, r.stranded_at_peak), (0, 0));
}

/// Two pieces of a plan's work leave the allocating thread. Its placement at its start,
/// around what is in the way there: made ahead, on a thread of the pool's (inline on the
/// simulated device), once the job is past the period's last allocation whose block lives
/// into the next period, and taken at the start where the same blocks are in the way (here,
/// every start of these four jobs). And its give-back of the region's unused pages by
/// splitting handles (see above): each is unmapped whole and the pages its slots use are
/// mapped again, ahead, by the resource's thread (`VirtualMemory::map_ahead`: the CUDA
/// engine's worker makes them); no block is handed out on such pages before the pool has
/// waited for them (`check_invariants`, every 8th event). So the allocating thread's last
/// driver call comes in the plan's first cycle (its region filled where the dynamic layout
/// had not mapped), before the give-back's, which are all the resource thread's.
#[test]
fn a_plans_start_and_give_back_leave_the_allocating_thread() {
    use gpumem::resource::sim::SimulatedDevice;
    use gpumem::{CachingAllocator, Stream};
    use std::sync::Arc;
    for name in [
        "torch_vit_train.jsonl.gz",
        "torch_gptfix_train.jsonl.gz",
        "gpt_train.jsonl.gz",
        "torch_gptenc_train.jsonl.gz",
    ] {
        let events = read_trace(&data(name)).unwrap();
        let sim = Arc::new(SimulatedDevice::new(TIB));
        let config = Config {
            shards: Some(1),
            ..Config::default()
        };
        let alloc = CachingAllocator::new(sim.clone(), config).unwrap();
        let mut live = std::collections::HashMap::new();
        // (the event of the allocating thread's last call, and of the resource thread's)
        let (mut fg, mut bg) = ((0, 0), (0, 0));
        for (i, e) in events.iter().enumerate() {
            match e.action {
                Action::Alloc => {
                    sim.set_time_us(e.time_us);
                    let a = alloc
                        .allocate(Stream(e.stream), e.size.max(1) as usize, 512)
                        .unwrap();
                    live.insert(e.addr, a);
                }
                Action::FreeCompleted => {
                    sim.set_time_us(e.time_us);
                    alloc.deallocate(live.remove(&e.addr).unwrap()).unwrap();
                }
                _ => continue,
            }
            let s = alloc.stats();
            if s.vmm_calls_foreground > fg.1 {
                fg = (i, s.vmm_calls_foreground);
            }
            if s.vmm_calls_background > bg.1 {
                bg = (i, s.vmm_calls_background);
            }
            if i % 8 == 0 {
                alloc.check_invariants().unwrap();
            }
        }
        let c = gpumem::resource::VirtualMemory::calls(&*sim);
        let n = events.len();
        let s = alloc.stats();
        println!(
            "{name}: the last call on the allocating thread at event {} of {n}, on the \
             resource's at {}; {} maps made there; starts placed ahead {}, there {}, mended {}",
            fg.0,
            bg.0,
            c.maps_background,
            s.num_plan_placements_ahead,
            s.num_plan_placements,
            s.num_plan_repairs
        );
        assert!(s.num_plan_placements_ahead > 0, "{name}");
        assert_eq!(s.num_plan_placements, 0, "{name}");
        assert!(c.maps_background > 0, "{name}: nothing mapped ahead");
        assert!(fg.0 < bg.0, "{name}: {} against {}", fg.0, bg.0);
        assert!(fg.0 * 2 < n, "{name}: {} of {n}", fg.0);
    }
}

/// A start that finds a block in its way where the last placement has a slot (an
/// evaluation's block left behind, a block kept across the start somewhere new) mends that
/// placement where that spans no more: only the slots in the way are placed again. In these
/// replays (the GPU 300 calls behind) some starts are mended, and every replay's outcome is
/// as with each of them placed anew (stop 88: every real trace at lags 0, 300 and 3000,
/// the same ratio and driver calls).
#[test]
fn a_start_with_a_block_in_the_way_of_a_slot_mends_its_last_placement() {
    use gpumem::resource::sim::SimulatedDevice;
    use gpumem::{CachingAllocator, Stream};
    use std::sync::Arc;
    let mut mended = 0;
    for name in [
        "torch_phases_train.jsonl.gz",
        "torch_traineval_train.jsonl.gz",
    ] {
        let events = read_trace(&data(name)).unwrap();
        let sim = Arc::new(SimulatedDevice::new(TIB));
        sim.set_lag(300);
        let alloc = CachingAllocator::new(sim.clone(), Config::default()).unwrap();
        let mut live = std::collections::HashMap::new();
        for e in &events {
            sim.set_time_us(e.time_us);
            match e.action {
                Action::Alloc => {
                    let a = alloc
                        .allocate(Stream(e.stream), e.size.max(1) as usize, 512)
                        .unwrap();
                    live.insert(e.addr, a);
                }
                Action::FreeCompleted => {
                    alloc.deallocate(live.remove(&e.addr).unwrap()).unwrap();
                }
                _ => continue,
            }
            sim.advance();
        }
        alloc.check_invariants().unwrap();
        let s = alloc.stats();
        println!(
            "{name}: {} starts placed, {} ahead, {} of them mended",
            s.num_plan_placements, s.num_plan_placements_ahead, s.num_plan_repairs
        );
        assert!(s.num_plan_repairs <= s.num_plan_placements + s.num_plan_placements_ahead);
        mended += s.num_plan_repairs;
    }
    assert!(mended > 0);
}

/// LoRA (`torch_lora_train`) where the driver's calls cost 1.5 times the model's, as they seem
/// to in some processes on the H200: three real runs of nine held 1.123 of their live peak,
/// and the replay at that cost gives the same. Step 3's moves find the window of page work
/// too full and growth takes their place: the time budget holds and memory pays
/// (`docs/first-steps.md`, stop 78). Asserted: the window within 1%, the last steps back at
/// the plan's layout, and the whole run not above PyTorch's expandable segments on the same
/// job (1.125, H200).
#[test]
fn a_slower_driver_costs_lora_memory_in_its_first_steps_not_time() {
    let cost = gpumem::trace::CostModel::default().scaled(1.5);
    let r = default_replay("torch_lora_train.jsonl.gz", None, cost);
    let rep = &r.report;
    let ratio = rep.peak_reserved_bytes as f64 / rep.peak_live_bytes as f64;
    let window = rep.worst_window_share.expect("real traces have times");
    // the last fifth of the events: the plan's region, given back to what it uses
    let tail = &r.timeline[r.timeline.len() * 4 / 5..];
    let live = tail.iter().map(|t| t.1).max().unwrap();
    let reserved = tail.iter().map(|t| t.2).max().unwrap();
    println!(
        "ratio {ratio:.4}, worst window {:.2}%, last fifth {:.4}",
        window * 100.0,
        reserved as f64 / live as f64
    );
    assert!(window <= 0.01, "{:.2}% of a second", window * 100.0);
    assert!(ratio <= 1.125, "{ratio:.4}");
    assert!(reserved as f64 <= live as f64 * 1.02);
}
