//! Configuration: one string, `key:value,key:value`, from code or the `GPUMEM_CONF` variable.
//!
//! Key names follow `PYTORCH_CUDA_ALLOC_CONF` where the meaning is the same. The keys, their
//! values and meanings are one table, [`keys::KEYS`]: the parser, its errors, `gpumem info` and
//! the README's table come from it. [`Config`] groups the settings by their consumer: the pool
//! policy, the budget, the CUDA backend, the transfer engine's staging; `Display` writes the
//! configuration string back (it parses to the same configuration).

pub mod keys;

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
    /// Parse PyTorch's `roundup_power2_divisions` value: `N`, or `[256:1,512:2,>:4]` (interval
    /// upper bounds in MB, each a power of two; `>` for the rest).
    pub fn parse(value: &str) -> std::result::Result<Self, String> {
        let check = |v: &str| -> std::result::Result<u32, String> {
            let d = v
                .trim()
                .parse::<u64>()
                .map_err(|_| "expected a non-negative integer".to_string())?;
            if d != 0 && (!d.is_power_of_two() || d > 64) {
                return Err("divisions must be 0 or a power of two up to 64".into());
            }
            Ok(d as u32)
        };
        let v = value.trim();
        let Some(inner) = v.strip_prefix('[').and_then(|s| s.strip_suffix(']')) else {
            let d = check(v)?;
            return Ok(Power2Divisions {
                intervals: if d == 0 { vec![] } else { vec![(0, d)] },
            });
        };
        let mut intervals: Vec<(u64, u32)> = Vec::new();
        for part in inner.split([',', ';']).filter(|p| !p.trim().is_empty()) {
            let (k, d) = part
                .split_once(':')
                .ok_or("expected [size_mb:divisions,...,>:divisions]")?;
            let start = if k.trim() == ">" {
                intervals.last().map(|&(s, _)| s * 2).unwrap_or(0)
            } else {
                let mb = k
                    .trim()
                    .parse::<u64>()
                    .ok()
                    .filter(|&mb| mb.is_power_of_two() && mb <= 1 << 30)
                    .ok_or("interval sizes must be powers of two (MB) up to 2^30")?;
                // PyTorch's interval "64" covers the sizes whose highest bit is 64 MB's: from
                // 64 MB up to 128 MB (its own test_allocator_settings gives 84 MB the "64"
                // key's divisions; its documentation says "under 64 MB")
                mb * MIB
            };
            if intervals.last().is_some_and(|&(s, _)| s >= start) {
                return Err("intervals must be increasing".into());
            }
            intervals.push((start, check(d)?));
        }
        if let Some(first) = intervals.first_mut() {
            first.0 = 0;
        }
        Ok(Power2Divisions { intervals })
    }

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

/// The pool policy's settings (read by every shard).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolConfig {
    /// Blocks at least this large are not split; `None` = unlimited.
    pub max_split_size: Option<u64>,
    /// Power-of-two rounding.
    pub roundup_power2_divisions: Power2Divisions,
    /// Garbage collection threshold in (0, 1).
    pub garbage_collection_threshold: Option<f64>,
    /// Entries of the per-shard quick cache.
    pub quick_cache: usize,
    /// Cross-stream reuse of wholly free segments.
    pub cross_stream_reuse: bool,
    /// Virtual-memory (expandable) segments where the backend supports them.
    pub expandable_segments: bool,
    /// Page moves within the time budget (expandable segments; `pool/budget.rs`). No
    /// configuration key: the budget and the high-water mark decide moves; Rust callers and
    /// tests may turn them off to map and keep, as PyTorch's expandable segments do (moves
    /// that fit the memory budget still happen).
    pub page_moves: bool,
    /// Release the cache when the device's free memory (every process counted) falls below
    /// this fraction of its total and another process's use has grown; 0 = never.
    pub pressure_release: f64,
    /// How often (at most) the device's free memory is read for `pressure_release`, ms.
    pub pressure_interval_ms: u64,
    /// Time each allocation and free on its calling thread (lock included) into the stats
    /// `host_alloc_ns` and `host_free_ns`: two clock reads a call, off by default.
    pub time_calls: bool,
    /// A job that repeats gets a planned layout (expandable segments only; see
    /// `pool/plan/`), where it takes at most 1% more memory than the dynamic layout held.
    pub planned_layout: bool,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            max_split_size: None,
            roundup_power2_divisions: Power2Divisions::default(),
            garbage_collection_threshold: None,
            quick_cache: 1,
            cross_stream_reuse: true,
            expandable_segments: true,
            page_moves: true,
            pressure_release: 0.05,
            pressure_interval_ms: 100,
            time_calls: false,
            planned_layout: true,
        }
    }
}

/// The VRAM budget (both may be set: the smaller wins).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct BudgetConfig {
    /// Budget as a fraction of device memory.
    pub memory_fraction: Option<f64>,
    /// Budget in bytes.
    pub memory_limit: Option<u64>,
}

/// Where segments come from on a CUDA device.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BackendConfig {
    /// CUDA segment source.
    pub kind: BackendKind,
    /// Release threshold of the cudaMallocAsync pool in bytes (`u64::MAX`: unlimited).
    pub release_threshold: u64,
    /// Bytes of one page of expandable segments (one physical handle), rounded up to the
    /// device's granularity (0: the granularity itself).
    pub page_bytes: u64,
}

impl Default for BackendConfig {
    fn default() -> Self {
        Self {
            kind: BackendKind::Native,
            release_threshold: u64::MAX,
            page_bytes: 0,
        }
    }
}

/// The transfer engine's staging settings.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StagingSettings {
    /// Lanes of staged copies; `None` = one per core, at most 16.
    pub threads: Option<usize>,
    /// Largest pinned staging chunk in bytes.
    pub chunk_bytes: u64,
    /// Smallest host copy that is staged (smaller ones are one driver copy).
    pub min_bytes: u64,
}

impl Default for StagingSettings {
    fn default() -> Self {
        Self {
            threads: None,
            chunk_bytes: 2 * MIB,
            min_bytes: MIB,
        }
    }
}

/// Allocator configuration, grouped by consumer. `Config::default()` is gpumem's default
/// policy.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Config {
    /// The pool policy.
    pub pool: PoolConfig,
    /// Number of shards; `None` = one per available core, at most 16.
    pub shards: Option<usize>,
    /// The VRAM budget.
    pub budget: BudgetConfig,
    /// The CUDA backend.
    pub backend: BackendConfig,
    /// The transfer engine's staging.
    pub staging: StagingSettings,
}

const MIB: u64 = 1 << 20;
impl std::fmt::Display for Power2Divisions {
    /// The value [`Power2Divisions::parse`] reads back.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.intervals.as_slice() {
            [] => write!(f, "0"),
            [(0, d)] => write!(f, "{d}"),
            all => {
                // an interval starting at s is PyTorch's "s MB"; the first starts at 0 and
                // is written as half of the next one's bound
                let bound = |i: usize| match all.get(i) {
                    Some(&(s, _)) if i > 0 => s / MIB,
                    _ => all.get(1).map_or(1, |&(s, _)| (s / MIB / 2).max(1)),
                };
                let parts: Vec<String> = (0..all.len())
                    .map(|i| format!("{}:{}", bound(i), all[i].1))
                    .collect();
                write!(f, "[{}]", parts.join(","))
            }
        }
    }
}

impl std::fmt::Display for Config {
    /// The configuration string: every key, `key:value,...`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self
            .entries()
            .into_iter()
            .map(|(k, v)| format!("{k}:{v}"))
            .collect();
        write!(f, "{}", parts.join(","))
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
            let (name, value) = item
                .split_once(':')
                .ok_or_else(|| Error::Config(format!("{item}: expected key:value")))?;
            let (name, value) = (name.trim(), value.trim());
            let key = keys::key(name).ok_or_else(|| {
                let known: Vec<&str> = keys::KEYS.iter().map(|k| k.name).collect();
                Error::Config(format!(
                    "unknown key `{name}` (known: {})",
                    known.join(", ")
                ))
            })?;
            (key.set)(self, value)
                .map_err(|why| Error::Config(format!("{name}:{value}: {why}")))?;
        }
        Ok(())
    }

    /// Every key with its value in force, as the configuration string writes them.
    pub fn entries(&self) -> Vec<(&'static str, String)> {
        keys::KEYS.iter().map(|k| (k.name, k.show(self))).collect()
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
        assert_eq!(c.pool.max_split_size, Some(128 * MIB));
        assert_eq!(c.pool.roundup_power2_divisions.for_size(1 << 30), 4);
        assert_eq!(c.pool.garbage_collection_threshold, Some(0.6));
    }

    #[test]
    fn parses_division_intervals() {
        let c = Config::parse("roundup_power2_divisions:[256:1,512:2,>:8],shards:2").unwrap();
        let d = &c.pool.roundup_power2_divisions;
        // as PyTorch's code reads them: "256" from 256 MB (and the first one below it too),
        // "512" from 512 MB, ">" from 1 GB
        assert_eq!(d.for_size(1 << 20), 1);
        assert_eq!(d.for_size(300 * MIB), 1);
        assert_eq!(d.for_size(600 * MIB), 2);
        assert_eq!(d.for_size(4 << 30), 8);
        // PyTorch's test_allocator_settings: 84 MB takes the "64" key's divisions
        let p = Power2Divisions::parse("[64:8,128:2,256:2,512:2,1024:1,>:1]").unwrap();
        assert_eq!(p.for_size(84 * MIB), 8);
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
            // (20 MiB, PyTorch's large handle, failed in cuMemAddressReserve at the first
            // allocation on the H100: the alignment must be a power of two)
            ("expandable_page_mb:20", "power of two"),
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
