//! The layering holds: no module of `src/` imports a module of a higher layer (resource →
//! pool → adaptor → allocator → device → buffer → trace), outside its unit tests.

use std::path::Path;

/// Layer of a top-level module; `None` for the modules every layer may use.
fn layer(module: &str) -> Option<u32> {
    Some(match module {
        "config" | "error" | "units" | "workload" => return None,
        "resource" | "profile" => 1,
        "pool" => 2,
        "adaptor" => 3,
        "allocator" => 4,
        "device" | "transfer" => 5,
        "buffer" => 6,
        "trace" => 7,
        other => panic!("module {other} has no layer: add it to this test"),
    })
}

fn visit(dir: &Path, files: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.is_dir() {
            visit(&p, files);
        } else if p.extension().is_some_and(|e| e == "rs") {
            files.push(p);
        }
    }
}

#[test]
fn no_module_imports_a_higher_layer() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    visit(&src, &mut files);
    let mut bad = Vec::new();
    for f in files {
        let rel = f
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        let top = rel.split('/').next().unwrap().trim_end_matches(".rs");
        if top == "lib" || top.ends_with("tests") {
            continue;
        }
        let own = layer(top);
        let text = std::fs::read_to_string(&f).unwrap();
        // unit tests may use anything
        let code = text.split("#[cfg(test)]").next().unwrap();
        for (i, _) in code.match_indices("crate::") {
            let name: String = code[i + 7..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            if name.is_empty() {
                continue; // `crate::{Type, ...}`: the root's re-exports
            }
            if let (Some(theirs), Some(mine)) = (layer(&name), own) {
                if theirs > mine {
                    bad.push(format!("{rel} imports crate::{name}"));
                }
            }
        }
    }
    bad.sort();
    bad.dedup();
    assert!(bad.is_empty(), "upward imports:\n{}", bad.join("\n"));
}
