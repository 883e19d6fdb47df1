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
    let (ok, json, _) = gpumem(&["info", "--json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(v["backend"] == "host" || v["backend"] == "cuda");
    assert!(v["devices"].is_array());
}

#[test]
fn bench_alloc_json_has_the_scenarios() {
    let (ok, json, err) = gpumem(&[
        "bench",
        "alloc",
        "--json",
        "--host",
        "--pairs",
        "2000",
        "--ops",
        "2000",
        "--threads",
        "8",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(v["device"].is_string());
    let rows = v["rows"].as_array().unwrap();
    for (alloc, scenario, threads) in [
        ("gpumem", "same_size", 1),
        ("gpumem", "random_256_live", 1),
        ("gpumem", "random_256_live_8_threads", 8),
        ("system", "same_size", 1),
    ] {
        let row = rows
            .iter()
            .find(|r| r["allocator"] == alloc && r["scenario"] == scenario)
            .unwrap_or_else(|| panic!("no row {alloc}/{scenario} in {json}"));
        assert_eq!(row["threads"], threads);
        assert!(row["ns_per_op"].as_f64().unwrap() > 0.0);
    }
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
    assert_eq!(names, ["recorded", "gpumem", "quick_cache:0"]);
    for p in v["policies"].as_array().unwrap() {
        assert!(p["ratio"].as_f64().unwrap() >= 1.0);
        assert!(
            p["peak_reserved_bytes"].as_u64().unwrap() >= p["peak_live_bytes"].as_u64().unwrap()
        );
    }
    let (ok, _, err) = gpumem(&["replay", "/nonexistent.jsonl"]);
    assert!(!ok && err.contains("/nonexistent.jsonl"), "{err}");
}
