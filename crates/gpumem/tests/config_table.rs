//! The configuration keys are one table: the README's table is that table, and every
//! configuration prints as a string that parses back to itself.

use gpumem::config::keys::KEYS;
use gpumem::Config;
use proptest::prelude::*;

/// The README's configuration table, row for row, generated from the key table. Run with
/// `GPUMEM_PRINT_TABLE=1 cargo test --test config_table -- --nocapture` to print it.
#[test]
fn the_readme_lists_every_key_as_the_table_does() {
    let rows: Vec<String> = KEYS.iter().map(|k| k.markdown_row()).collect();
    if std::env::var("GPUMEM_PRINT_TABLE").is_ok() {
        println!("| key | values | default | meaning |\n|---|---|---|---|");
        for r in &rows {
            println!("{r}");
        }
    }
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"))
        .expect("README.md");
    for r in &rows {
        assert!(readme.contains(r.as_str()), "README lacks the row\n{r}");
    }
}

#[test]
fn unknown_keys_are_errors_that_list_every_key() {
    let e = Config::parse("bogus:1").unwrap_err().to_string();
    for k in KEYS {
        assert!(e.contains(k.name), "{e}");
    }
}

/// Values each key takes (valid ones), to build random configurations from.
fn samples(name: &str) -> &'static [&'static str] {
    match name {
        "max_split_size_mb" => &["none", "21", "128", "4096"],
        "roundup_power2_divisions" => &["0", "1", "4", "[256:1,512:2,>:8]", "[64:2,>:4]"],
        "garbage_collection_threshold" => &["none", "0.5", "0.99"],
        "backend" => &["native", "cudaMallocAsync"],
        "memory_fraction" => &["none", "0.25", "1"],
        "memory_limit_mb" => &["none", "1", "81920"],
        "release_threshold_mb" => &["unlimited", "0", "512"],
        "expandable_page_mb" => &["0", "2", "8", "16", "1024"],
        "shards" | "staging_threads" => &["auto", "1", "64"],
        "quick_cache" => &["0", "16", "256"],
        "cross_stream_reuse" | "expandable_segments" | "time_calls" | "planned_layout" => {
            &["True", "False", "0", "1"]
        }
        "staging_chunk_kb" => &["4", "2048", "1048576"],
        "staging_min_kb" => &["0", "1024"],
        "pressure_release" => &["0", "0.05", "0.5"],
        "pressure_interval_ms" => &["0", "100", "60000"],
        other => panic!("no samples for {other}: add them"),
    }
}

proptest! {
    #[test]
    fn every_configuration_prints_as_a_string_that_parses_back(
        picks in proptest::collection::vec((0usize..KEYS.len(), 0usize..8), 0..20)
    ) {
        let s: Vec<String> = picks
            .iter()
            .map(|&(k, v)| {
                let vals = samples(KEYS[k].name);
                format!("{}:{}", KEYS[k].name, vals[v % vals.len()])
            })
            .collect();
        let c = Config::parse(&s.join(",")).unwrap();
        let printed = c.to_string();
        prop_assert_eq!(Config::parse(&printed).unwrap(), c, "{}", printed);
    }
}
