//! Where the tests' data files are: `GPUMEM_TEST_DATA` when the test binary runs away from
//! its sources (the GPU bundle sets it), else `tests/data` of this crate. Included with
//! `#[path]` by the tests that read data.

use std::path::{Path, PathBuf};

/// The path of data file `name`.
pub fn data(name: &str) -> PathBuf {
    match std::env::var("GPUMEM_TEST_DATA") {
        Ok(dir) => Path::new(&dir).join(name),
        Err(_) => Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data")
            .join(name),
    }
}
