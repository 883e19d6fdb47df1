//! The `gpumem` binary end to end (on whatever backend this machine has).

use std::process::Command;

fn gpumem(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args(args)
        .env_remove("GPUMEM_CONF")
        .output()
        .expect("run gpumem");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn info_describes_the_backend() {
    let (ok, text, _) = gpumem(&["info"]);
    assert!(ok);
    assert!(
        text.contains("host backend") || text.contains("device 0:"),
        "{text}"
    );
    assert!(text.contains("memory visibility"), "{text}");
    let (ok, json, _) = gpumem(&["info", "--json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(v["backend"] == "host" || v["backend"] == "cuda");
    assert!(v["devices"].is_array());
    assert!(["Linux", "Wsl2", "Windows", "Other"].contains(&v["platform"].as_str().unwrap()));
    for d in v["devices"].as_array().unwrap() {
        assert!(d["visibility"].is_string(), "{d}");
    }
}

#[test]
fn bench_ring_compares_polled_and_copies() {
    let (ok, json, err) = gpumem(&[
        "bench",
        "ring",
        "--json",
        "--host",
        "--round-trips",
        "200",
        "--messages",
        "5000",
        "--capacity",
        "64",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert!(rows[0]["mode"].as_str().unwrap().starts_with("polled"));
    assert_eq!(rows[0]["copies"], 0, "polled mode copies nothing");
    assert_eq!(rows[1]["mode"], "copies");
    assert!(rows[1]["copies"].as_u64().unwrap() >= 2 * 5000 / 64);
    for r in rows {
        assert!(r["latency_median_us"].as_f64().unwrap() > 0.0);
        assert!(r["messages_per_s"].as_f64().unwrap() > 0.0);
    }
    let (ok, _, err) = gpumem(&["bench", "ring", "--host", "--poll-us=-1"]);
    assert!(!ok && err.contains("poll"), "{err}");
}

#[test]
fn bench_alloc_json_has_the_scenarios() {
    // a short `bench alloc --json --host` with `extra` arguments: its output, parsed
    let bench = |extra: &[&str]| {
        let mut args = vec![
            "bench", "alloc", "--json", "--host", "--pairs", "2000", "--ops", "2000",
        ];
        args.extend_from_slice(extra);
        let (ok, json, err) = gpumem(&args);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        (v, json)
    };
    let (v, json) = bench(&["--threads", "8", "--rounds", "2"]);
    assert!(v["device"].is_string());
    let rows = v["rows"].as_array().unwrap();
    // gpumem's two policies ran two rounds each (one row each, the rounds' figures in it)
    for (alloc, scenario, threads, rounds) in [
        ("gpumem", "same_size", 1, 2),
        ("gpumem", "random_256_live", 1, 2),
        ("gpumem", "random_256_live_8_threads", 8, 2),
        ("gpumem (classic)", "random_256_live", 1, 2),
        ("system", "same_size", 1, 1),
    ] {
        let matching: Vec<_> = rows
            .iter()
            .filter(|r| r["allocator"] == alloc && r["scenario"] == scenario)
            .collect();
        assert_eq!(matching.len(), 1, "{alloc}/{scenario} in {json}");
        let row = matching[0];
        assert_eq!(row["threads"], threads);
        let per: Vec<f64> = row["rounds"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(per.len(), rounds, "{json}");
        let median = row["ns_per_op"].as_f64().unwrap();
        assert!(median > 0.0);
        let (lo, hi) = per
            .iter()
            .fold((f64::MAX, 0.0f64), |(l, h), &x| (l.min(x), h.max(x)));
        assert!(lo <= median && median <= hi, "{json}");
        let share = row["planned_share"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&share), "{json}");
        assert!(row["plans"].as_u64().is_some(), "{json}");
    }
    // the two policies' single-thread scenarios batch by batch: 2 batches of 1000 a round
    let paired = v["paired"].as_array().unwrap();
    assert_eq!(paired.len(), 2, "{json}");
    for (p, scenario) in paired.iter().zip(["same_size", "random_256_live"]) {
        assert_eq!(p["scenario"], scenario);
        assert_eq!(p["allocator"], "gpumem");
        assert_eq!(p["against"], "gpumem (classic)");
        assert_eq!(p["batches"], 4, "{json}");
        let (lo, mid, hi) = (
            p["low"].as_f64().unwrap(),
            p["median_ratio"].as_f64().unwrap(),
            p["high"].as_f64().unwrap(),
        );
        assert!(0.0 < lo && lo <= mid && mid <= hi, "{json}");
    }
    // a configuration with classic segments already is measured once, under its own name
    let (v, _) = bench(&["--threads", "2", "--conf", "expandable_segments:False"]);
    assert_eq!(v["paired"].as_array().unwrap().len(), 0);
    let names: Vec<&str> = v["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["allocator"].as_str().unwrap())
        .collect();
    assert_eq!(
        names.iter().filter(|n| **n == "gpumem").count(),
        3,
        "{names:?}"
    );
    assert!(!names.contains(&"gpumem (classic)"), "{names:?}");
}

#[test]
fn bad_configuration_is_a_clear_error() {
    let (ok, _, err) = gpumem(&[
        "bench",
        "alloc",
        "--host",
        "--conf",
        "max_split_size_mb:lots",
    ]);
    assert!(!ok);
    assert!(err.contains("max_split_size_mb"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .arg("info")
        .env("GPUMEM_CONF", "nonsense:1")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("GPUMEM_CONF: unknown key `nonsense`"));
}

#[test]
fn replay_prints_one_json_object_per_trace() {
    let data = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../gpumem/tests/data/resnet50_train.jsonl.gz"
    );
    let (ok, out, err) = gpumem(&["replay", data, "--conf", "quick_cache:0", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["events"], 15_356);
    let names: Vec<&str> = v["policies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["recorded", "gpumem", "gpumem (no VMM)", "quick_cache:0"]
    );
    for p in v["policies"].as_array().unwrap() {
        assert!(p["ratio"].as_f64().unwrap() >= 1.0);
        for key in [
            "peak_live_bytes",
            "segments_at_peak",
            "largest_free_block_at_peak",
            "movable_at_peak",
            "stranded_at_peak",
            "ns_per_event",
            "backend",
        ] {
            assert!(!p[key].is_null(), "{key} missing in {p}");
        }
        assert!(
            p["peak_reserved_bytes"].as_u64().unwrap() >= p["peak_live_bytes"].as_u64().unwrap()
        );
    }
    let (ok, _, err) = gpumem(&["replay", "/nonexistent.jsonl"]);
    assert!(!ok && err.contains("/nonexistent.jsonl"), "{err}");
}

#[test]
fn advise_names_the_best_configuration_and_the_warmup() {
    let data = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../gpumem/tests/data/resnet50_train.jsonl.gz"
    );
    let (ok, out, err) = gpumem(&["advise", data, "--conf", "quick_cache:4", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let a = &v["advice"];
    let candidates = a["candidates"].as_array().unwrap();
    assert_eq!(candidates[0]["conf"], "");
    assert_eq!(candidates.last().unwrap()["conf"], "quick_cache:4");
    let best = a["best"].as_u64().unwrap() as usize;
    let least = candidates
        .iter()
        .map(|c| c["report"]["peak_reserved_bytes"].as_u64().unwrap())
        .min()
        .unwrap();
    assert_eq!(
        candidates[best]["report"]["peak_reserved_bytes"].as_u64(),
        Some(least)
    );
    assert!(a["warmup_misses"].as_u64().unwrap() > 0);
    let (ok, out, err) = gpumem(&["advise", data]);
    assert!(ok, "{err}");
    assert!(
        out.contains("least memory") && out.contains("warm-up:"),
        "{out}"
    );
    let (ok, _, err) = gpumem(&["advise", data, "--conf", "bogus:1"]);
    assert!(!ok && err.contains("bogus"), "{err}");
    let (ok, _, err) = gpumem(&["advise", "/nonexistent.jsonl"]);
    assert!(!ok && err.contains("/nonexistent.jsonl"), "{err}");
}

/// A fresh directory for a test's files, removed when the test ends (dropped).
fn tmp() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("gpumem-cli-test-")
        .tempdir()
        .unwrap()
}

const RESNET: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../gpumem/tests/data/resnet50_train.jsonl.gz"
);

#[test]
fn viz_writes_one_self_contained_html_file() {
    let dir = tmp();
    let out = dir.path().join("resnet.html");
    let (ok, _, err) = gpumem(&["viz", RESNET, "-o", out.to_str().unwrap()]);
    assert!(ok, "{err}");
    let html = std::fs::read_to_string(&out).unwrap();
    assert!(html.starts_with("<!DOCTYPE html>"));
    for needle in [
        "Timeline",
        "Segment map at the reserved peak",
        "<polygon",
        "recorded allocator: reserved",
        "1.190", // the recorded ratio of this trace
    ] {
        assert!(html.contains(needle), "no {needle}");
    }
    // nothing is fetched: no scripts, stylesheets or images from elsewhere
    for bad in ["http://", "https://", "<script", "<link", "<img"] {
        assert!(!html.contains(bad), "found {bad}");
    }
    let (ok, _, err) = gpumem(&["viz", "/nonexistent.jsonl", "-o", out.to_str().unwrap()]);
    assert!(!ok && err.contains("/nonexistent.jsonl"), "{err}");
}

/// Renders the page in a real headless Chromium and checks the screenshot shows the chart's
/// colours (also `scripts/viz-screenshot`).
#[test]
#[ignore = "needs chromium (apt install chromium)"]
fn viz_renders_in_headless_chromium() {
    let dir = tmp();
    let html = dir.path().join("render.html");
    let png = dir.path().join("render.png");
    let (ok, _, err) = gpumem(&["viz", RESNET, "-o", html.to_str().unwrap()]);
    assert!(ok, "{err}");
    let status = Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1280,1000",
        ])
        .arg(format!("--screenshot={}", png.display()))
        .arg(format!("file://{}", html.display()))
        .output()
        .expect("chromium is installed");
    assert!(status.status.success(), "{status:?}");
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&png).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!((info.width, info.height), (1280, 1000));
    let px = info.color_type.samples();
    let count = |rgb: (u8, u8, u8)| {
        buf.chunks(px)
            .filter(|p| {
                (p[0] as i32 - rgb.0 as i32).abs() < 24
                    && (p[1] as i32 - rgb.1 as i32).abs() < 24
                    && (p[2] as i32 - rgb.2 as i32).abs() < 24
            })
            .count()
    };
    // gray live area, blue reserved line, segment map's requested-bytes blue
    assert!(count((0xc8, 0xc8, 0xc8)) > 20_000, "no timeline area");
    assert!(count((0x1f, 0x3f, 0xbf)) > 500, "no reserved line");
    assert!(count((0x2b, 0x6c, 0xb0)) > 2_000, "no segment map");
}

#[test]
fn bench_transfer_reports_every_path_and_size() {
    let (ok, json, err) = gpumem(&["bench", "transfer", "--json", "--host", "--max-mib", "1"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let rows = v["rows"].as_array().unwrap();
    // on the host backend the raw row is a host memcpy and says so
    let raw = if v["device"].as_str().unwrap_or("").starts_with("host") {
        "host memcpy (raw)"
    } else {
        "cuMemcpyAsync (raw)"
    };
    for path in [
        "pageable raw",
        "pageable staged",
        raw,
        "pinned",
        "pageable registered",
        "device",
    ] {
        assert!(rows.iter().any(|r| r["path"] == path), "no {path} row");
    }
    let sizes: std::collections::BTreeSet<u64> =
        rows.iter().map(|r| r["bytes"].as_u64().unwrap()).collect();
    assert_eq!(
        sizes.into_iter().collect::<Vec<_>>(),
        vec![64 << 10, 1 << 20]
    );
    assert!(rows.iter().all(|r| r["gb_per_s"].as_f64().unwrap() > 0.0));
    let cached = &v["pinned_alloc"].as_array().unwrap()[1];
    assert!(cached["allocator"].as_str().unwrap().contains("cached"));
    let (ok, _, err) = gpumem(&["bench", "transfer", "--host", "--conf", "staging_threads:0"]);
    assert!(!ok && err.contains("staging_threads"), "{err}");
}

#[test]
fn gpu_only_benches_say_why_without_a_gpu() {
    let (ok, info, _) = gpumem(&["info", "--json"]);
    assert!(ok);
    if info.contains("\"backend\":\"cuda\"") {
        return; // this machine has a GPU: these benches run (gpu-bundle/run-unified)
    }
    let (ok, _, err) = gpumem(&["bench", "unified"]);
    assert!(!ok && err.contains("needs a CUDA GPU"), "{err}");
    let (ok, _, err) = gpumem(&["bench", "transfer", "--peer"]);
    assert!(!ok && err.contains("two CUDA GPUs"), "{err}");
}

/// Every command on a battery of bad inputs: a non-zero exit, a message naming the problem,
/// no panic, and done within seconds.
#[test]
fn bad_inputs_are_refused_clearly_and_quickly() {
    let tmp = tmp();
    let dir = tmp.path();
    let file = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let empty = file("empty.jsonl", "");
    let segments = file(
        "segments.jsonl",
        "{\"action\":\"segment_alloc\",\"addr\":1,\"size\":100}\n",
    );
    let frees = file(
        "frees.jsonl",
        "{\"action\":\"free_requested\",\"addr\":1,\"size\":100}\n",
    );
    let huge = file(
        "huge.jsonl",
        "{\"action\":\"alloc\",\"addr\":1,\"size\":1099511627776000}\n\
         {\"action\":\"free_completed\",\"addr\":1,\"size\":1099511627776000}\n",
    );
    let garbage = file("garbage.jsonl", "not json\n");
    let out = dir.join("out.html").display().to_string();
    let cases: Vec<(Vec<&str>, &str, Option<&str>)> = vec![
        (vec!["viz", &empty, "-o", &out], "no allocations", None),
        (vec!["viz", &segments, "-o", &out], "no allocations", None),
        (vec!["viz", &frees, "-o", &out], "no allocations", None),
        (
            vec!["viz", &huge, "-o", &out],
            "larger than the simulated device",
            None,
        ),
        (vec!["replay", &huge], "line 1", None),
        (vec!["replay", &garbage], "garbage.jsonl:1", None),
        (
            vec!["replay", "/nonexistent/trace.jsonl"],
            "nonexistent",
            None,
        ),
        (
            vec!["replay", "--conf", "", &segments],
            "empty configuration",
            None,
        ),
        (vec!["replay", &segments], "bogus", Some("bogus:1")),
        (
            vec!["replay", "--driver-cost", "0", &segments],
            "--driver-cost",
            None,
        ),
        (
            vec!["replay", "--driver-cost", "NaN", &segments],
            "--driver-cost",
            None,
        ),
        (
            vec!["viz", &segments, "--conf", "", "-o", &out],
            "no allocations",
            None,
        ),
        (
            vec!["bench", "alloc", "--host", "--ops", "0"],
            "--ops",
            None,
        ),
        (
            vec!["bench", "alloc", "--host", "--pairs", "0"],
            "--pairs",
            None,
        ),
        (
            vec!["bench", "alloc", "--host", "--threads", "100000"],
            "--threads",
            None,
        ),
        (
            vec!["bench", "alloc", "--host", "--threads=-1"],
            "--threads",
            None,
        ),
        (
            vec!["bench", "alloc", "--host", "--rounds", "0"],
            "--rounds",
            None,
        ),
        (
            vec!["bench", "alloc", "--host", "--conf", "shards:0"],
            "shards",
            None,
        ),
        (
            vec!["bench", "transfer", "--host", "--max-mib", "0"],
            "--max-mib",
            None,
        ),
        (
            vec!["bench", "transfer", "--host", "--max-mib", "99999999999"],
            "--max-mib",
            None,
        ),
        (vec!["bench", "unified", "--reps", "0"], "--reps", None),
        (
            vec!["synth", "variable_seq_len", "-o", &out, "--scale", "0"],
            "--scale",
            None,
        ),
        (
            vec![
                "synth",
                "variable_seq_len",
                "-o",
                &out,
                "--scale",
                "100000000",
            ],
            "--scale",
            None,
        ),
        (
            vec!["synth", "no_such_kind", "-o", &out],
            "unknown workload",
            None,
        ),
        (vec!["info"], "bogus", Some("bogus:1")),
    ];
    for (args, needle, conf) in cases {
        let start = std::time::Instant::now();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpumem"));
        cmd.args(&args).env_remove("GPUMEM_CONF");
        if let Some(c) = conf {
            cmd.env("GPUMEM_CONF", c);
        }
        let o = cmd.output().expect("run gpumem");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} succeeded: {err}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
        assert!(err.contains(needle), "{args:?}: `{needle}` not in: {err}");
        assert!(
            start.elapsed() < std::time::Duration::from_secs(10),
            "{args:?} took {:?}",
            start.elapsed()
        );
    }
    // an empty trace is handled: said to be empty, not an all-zero table
    let (ok, text, _) = gpumem(&["replay", &empty]);
    assert!(ok);
    assert!(text.contains("empty"), "{text}");
}
