//! Configuration: one string, `key:value,key:value`, from code or the `GPUMEM_CONF` variable.
//!
//! Key names follow `PYTORCH_CUDA_ALLOC_CONF` where the meaning is the same.
//!
//! | key | value | meaning |
//! |---|---|---|
//! | `max_split_size_mb` | integer > 20 | blocks of this size or larger are never split (PyTorch) |
//! | `roundup_power2_divisions` | `N` or `[256:1,512:2,>:4]` | round sizes up to N divisions of each power-of-two interval (PyTorch) |
//! | `garbage_collection_threshold` | 0 < t < 1 | above t × budget reserved, release the oldest cached segments before growing (PyTorch) |
//! | `backend` | `native` or `cudaMallocAsync` | where the pool gets its segments on CUDA (PyTorch) |
//! | `memory_fraction` | 0 < f ≤ 1 | budget as a fraction of device memory (`set_per_process_memory_fraction`) |
//! | `memory_limit_mb` | integer | budget in MiB |
//! | `release_threshold_mb` | integer | bytes the cudaMallocAsync pool keeps cached (`cudaMemPoolAttrReleaseThreshold`) |
//! | `shards` | `auto` or 1..=64 | independent pool shards; each thread uses one, so threads do not serialise |
//! | `quick_cache` | 0..=256 | recently freed blocks kept per shard for exact-size reuse before coalescing |
//! | `cross_stream_reuse` | bool | let a stream take a wholly free segment cached by another stream, ordered by an event wait |
//! | `expandable_segments` | bool | virtual-memory segments where the device has them (PyTorch's name; gpumem's default is on) |
//! | `expandable_move_budget` | 0 ≤ b < 1 | share of wall time the pool may spend moving pages (mapping and unmapping) before it keeps more pages cached instead; 0 = no limit |
//! | `expandable_slack` | 0 ≤ s < 1 | cached pages kept mapped beyond the peak of allocated bytes, as a fraction of it, before free pages are moved instead of new ones mapped |

use crate::error::{Error, Result};
use serde::Serialize;

/// Name of the environment variable read by [`Config::from_env`].
pub const ENV_VAR: &str = "GPUMEM_CONF";

/// Where the pool gets segments on a CUDA device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
pub enum BackendKind {
    /// cuMemAlloc / cuMemFree.
    #[default]
    Native,
    /// cuMemAllocFromPoolAsync on a private stream-ordered pool.
    CudaMallocAsync,
}

/// Power-of-two rounding divisions, per size interval.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Default)]
pub struct Power2Divisions {
    /// `(interval_start_bytes, divisions)` sorted by start; the last entry covers all larger sizes.
    /// Empty means no power-of-two rounding (512 B granularity only).
    pub intervals: Vec<(u64, u32)>,
}

impl Power2Divisions {
    /// Divisions that apply to `size`.
    pub fn for_size(&self, size: u64) -> u32 {
        let mut d = 0;
        for &(start, div) in &self.intervals {
            if size >= start {
                d = div;
            } else {
                break;
            }
        }
        d
    }
}

/// Allocator configuration. `Config::default()` is gpumem's default policy.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Config {
    /// Blocks at least this large are not split; `None` = unlimited.
    pub max_split_size: Option<u64>,
    /// Power-of-two rounding.
    pub roundup_power2_divisions: Power2Divisions,
    /// Garbage collection threshold in (0, 1).
    pub garbage_collection_threshold: Option<f64>,
    /// CUDA segment source.
    pub backend: BackendKind,
    /// Budget as a fraction of device memory.
    pub memory_fraction: Option<f64>,
    /// Budget in bytes.
    pub memory_limit: Option<u64>,
    /// Release threshold of the cudaMallocAsync pool in bytes.
    pub release_threshold: u64,
    /// Number of shards; `None` = one per available core, at most 16.
    pub shards: Option<usize>,
    /// Entries of the per-shard quick cache.
    pub quick_cache: usize,
    /// Cross-stream reuse of wholly free segments.
    pub cross_stream_reuse: bool,
    /// Virtual-memory (expandable) segments where the backend supports them.
    pub expandable_segments: bool,
    /// Mapped bytes allowed beyond the peak of allocated bytes (a fraction of it) before free
    /// pages are unmapped and reused rather than new ones mapped.
    pub expandable_slack: f64,
    /// Share of wall time page moves may take before the slack grows; 0 = no limit.
    pub expandable_move_budget: f64,
    /// Threads that fill and empty pinned slots in staged host copies; `None` = one per
    /// core, at most 16.
    pub staging_threads: Option<usize>,
    /// Largest pinned staging slot in bytes.
    pub staging_chunk: u64,
    /// Smallest host copy that is staged (smaller ones are one driver copy).
    pub staging_min: u64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            max_split_size: None,
            roundup_power2_divisions: Power2Divisions::default(),
            garbage_collection_threshold: None,
            backend: BackendKind::Native,
            memory_fraction: None,
            memory_limit: None,
            release_threshold: u64::MAX,
            shards: None,
            quick_cache: 16,
            cross_stream_reuse: true,
            expandable_segments: true,
            expandable_slack: 0.002,
            expandable_move_budget: 0.01,
            staging_threads: None,
            staging_chunk: 2 * MIB,
            staging_min: MIB,
        }
    }
}

const MIB: u64 = 1 << 20;
const MAX_SHARDS: usize = 64;

fn bad(key: &str, value: &str, why: &str) -> Error {
    Error::Config(format!("{key}:{value}: {why}"))
}

fn parse_u64(key: &str, value: &str) -> Result<u64> {
    value
        .trim()
        .parse::<u64>()
        .map_err(|_| bad(key, value, "expected a non-negative integer"))
}

fn parse_f64(key: &str, value: &str) -> Result<f64> {
    value
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite())
        .ok_or_else(|| bad(key, value, "expected a number"))
}

fn parse_bool(key: &str, value: &str) -> Result<bool> {
    match value.trim() {
        "1" | "true" | "True" | "TRUE" => Ok(true),
        "0" | "false" | "False" | "FALSE" => Ok(false),
        _ => Err(bad(key, value, "expected True or False")),
    }
}

fn parse_divisions(key: &str, value: &str) -> Result<Power2Divisions> {
    let check = |v: &str| -> Result<u32> {
        let d = parse_u64(key, v)?;
        if d != 0 && (!d.is_power_of_two() || d > 64) {
            return Err(bad(
                key,
                value,
                "divisions must be 0 or a power of two up to 64",
            ));
        }
        Ok(d as u32)
    };
    let v = value.trim();
    if let Some(inner) = v.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
        let mut intervals: Vec<(u64, u32)> = Vec::new();
        for part in inner.split([',', ';']).filter(|p| !p.trim().is_empty()) {
            let (k, d) = part
                .split_once(':')
                .ok_or_else(|| bad(key, value, "expected [size_mb:divisions,...,>:divisions]"))?;
            let start = if k.trim() == ">" {
                intervals.last().map(|&(s, _)| s * 2).unwrap_or(0)
            } else {
                let mb = parse_u64(key, k)?;
                if !mb.is_power_of_two() {
                    return Err(bad(key, value, "interval sizes must be powers of two (MB)"));
                }
                // PyTorch's interval "256" covers sizes up to 256 MB: it starts at 128 MB.
                (mb * MIB) / 2
            };
            if intervals.last().is_some_and(|&(s, _)| s >= start) {
                return Err(bad(key, value, "intervals must be increasing"));
            }
            intervals.push((start, check(d)?));
        }
        if let Some(first) = intervals.first_mut() {
            first.0 = 0;
        }
        Ok(Power2Divisions { intervals })
    } else {
        let d = check(v)?;
        Ok(Power2Divisions {
            intervals: if d == 0 { vec![] } else { vec![(0, d)] },
        })
    }
}

/// Split `a:b,c:[d:e,f:g]` at the commas that are not inside brackets.
fn split_top_level(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in s.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

impl Config {
    /// Parse a configuration string over the defaults. Empty string = defaults.
    pub fn parse(s: &str) -> Result<Self> {
        let mut c = Config::default();
        c.apply(s)?;
        Ok(c)
    }

    /// Apply `key:value` pairs from `s` on top of this configuration.
    pub fn apply(&mut self, s: &str) -> Result<()> {
        for item in split_top_level(s) {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            let (key, value) = item
                .split_once(':')
                .ok_or_else(|| Error::Config(format!("{item}: expected key:value")))?;
            let (key, value) = (key.trim(), value.trim());
            match key {
                "max_split_size_mb" => {
                    let mb = parse_u64(key, value)?;
                    if mb <= 20 {
                        return Err(bad(key, value, "must be larger than 20 (MB)"));
                    }
                    self.max_split_size = Some(
                        mb.checked_mul(MIB)
                            .ok_or_else(|| bad(key, value, "too large"))?,
                    );
                }
                "roundup_power2_divisions" => {
                    self.roundup_power2_divisions = parse_divisions(key, value)?
                }
                "garbage_collection_threshold" => {
                    let t = parse_f64(key, value)?;
                    if !(t > 0.0 && t < 1.0) {
                        return Err(bad(key, value, "must be between 0 and 1, exclusive"));
                    }
                    self.garbage_collection_threshold = Some(t);
                }
                "backend" => {
                    self.backend = match value {
                        "native" => BackendKind::Native,
                        "cudaMallocAsync" => BackendKind::CudaMallocAsync,
                        _ => return Err(bad(key, value, "expected native or cudaMallocAsync")),
                    }
                }
                "memory_fraction" => {
                    let f = parse_f64(key, value)?;
                    if !(f > 0.0 && f <= 1.0) {
                        return Err(bad(key, value, "must be in (0, 1]"));
                    }
                    self.memory_fraction = Some(f);
                }
                "memory_limit_mb" => {
                    let mb = parse_u64(key, value)?;
                    if mb == 0 {
                        return Err(bad(key, value, "must be at least 1"));
                    }
                    self.memory_limit = Some(
                        mb.checked_mul(MIB)
                            .ok_or_else(|| bad(key, value, "too large"))?,
                    );
                }
                "release_threshold_mb" => {
                    self.release_threshold = parse_u64(key, value)?.saturating_mul(MIB)
                }
                "shards" => {
                    self.shards = if value == "auto" {
                        None
                    } else {
                        let n = parse_u64(key, value)? as usize;
                        if n == 0 || n > MAX_SHARDS {
                            return Err(bad(key, value, "expected auto or 1..=64"));
                        }
                        Some(n)
                    }
                }
                "quick_cache" => {
                    let n = parse_u64(key, value)? as usize;
                    if n > 256 {
                        return Err(bad(key, value, "expected 0..=256"));
                    }
                    self.quick_cache = n;
                }
                "cross_stream_reuse" => self.cross_stream_reuse = parse_bool(key, value)?,
                "expandable_segments" => self.expandable_segments = parse_bool(key, value)?,
                "expandable_move_budget" => {
                    let f = parse_f64(key, value)?;
                    if !(0.0..1.0).contains(&f) {
                        return Err(bad(key, value, "must be in [0, 1)"));
                    }
                    self.expandable_move_budget = f;
                }
                "expandable_slack" => {
                    let f = parse_f64(key, value)?;
                    if !(0.0..1.0).contains(&f) {
                        return Err(bad(key, value, "must be in [0, 1)"));
                    }
                    self.expandable_slack = f;
                }
                "staging_threads" => {
                    self.staging_threads = if value == "auto" {
                        None
                    } else {
                        let n = parse_u64(key, value)? as usize;
                        if n == 0 || n > 64 {
                            return Err(bad(key, value, "expected auto or 1..=64"));
                        }
                        Some(n)
                    }
                }
                "staging_chunk_kb" => {
                    let kb = parse_u64(key, value)?;
                    if !(4..=1 << 20).contains(&kb) {
                        return Err(bad(key, value, "expected 4..=1048576 (KiB)"));
                    }
                    self.staging_chunk = kb * 1024;
                }
                "staging_min_kb" => {
                    self.staging_min = parse_u64(key, value)?.saturating_mul(1024);
                }
                _ => {
                    return Err(Error::Config(format!(
                        "unknown key `{key}` (known: max_split_size_mb, roundup_power2_divisions, \
                         garbage_collection_threshold, backend, memory_fraction, memory_limit_mb, \
                         release_threshold_mb, shards, quick_cache, cross_stream_reuse, \
                         expandable_segments, expandable_slack, expandable_move_budget, \
                         staging_threads, staging_chunk_kb, staging_min_kb)"
                    )))
                }
            }
        }
        Ok(())
    }

    /// Defaults overlaid with `GPUMEM_CONF`, if set.
    pub fn from_env() -> Result<Self> {
        match std::env::var(ENV_VAR) {
            Ok(s) => Self::parse(&s).map_err(|e| match e {
                Error::Config(m) => Error::Config(format!("{ENV_VAR}: {m}")),
                other => other,
            }),
            Err(_) => Ok(Self::default()),
        }
    }

    /// Number of shards this configuration gives.
    pub fn shard_count(&self) -> usize {
        self.shards.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
                .clamp(1, 16)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pytorch_keys() {
        let c = Config::parse(
            "max_split_size_mb:128, roundup_power2_divisions:4,garbage_collection_threshold:0.6",
        )
        .unwrap();
        assert_eq!(c.max_split_size, Some(128 * MIB));
        assert_eq!(c.roundup_power2_divisions.for_size(1 << 30), 4);
        assert_eq!(c.garbage_collection_threshold, Some(0.6));
    }

    #[test]
    fn parses_division_intervals() {
        let c = Config::parse("roundup_power2_divisions:[256:1,512:2,>:8],shards:2").unwrap();
        let d = &c.roundup_power2_divisions;
        assert_eq!(d.for_size(1 << 20), 1);
        assert_eq!(d.for_size(300 * MIB), 2);
        assert_eq!(d.for_size(4 << 30), 8);
        assert_eq!(c.shards, Some(2));
    }

    #[test]
    fn errors_name_the_key() {
        for (s, needle) in [
            ("bogus:1", "bogus"),
            ("max_split_size_mb:abc", "max_split_size_mb"),
            ("max_split_size_mb:10", "larger than 20"),
            (
                "garbage_collection_threshold:1.5",
                "garbage_collection_threshold",
            ),
            ("roundup_power2_divisions:3", "power of two"),
            ("memory_fraction:0", "memory_fraction"),
            ("backend:magic", "backend"),
            ("shards:0", "shards"),
            ("nocolon", "key:value"),
            ("cross_stream_reuse:maybe", "cross_stream_reuse"),
            ("expandable_segments:yes", "expandable_segments"),
            ("expandable_slack:2", "expandable_slack"),
        ] {
            let e = Config::parse(s).unwrap_err().to_string();
            assert!(e.contains(needle), "{s}: {e}");
        }
    }

    #[test]
    fn empty_is_default() {
        assert_eq!(Config::parse("").unwrap(), Config::default());
        assert_eq!(Config::parse(" , ").unwrap(), Config::default());
    }
}
