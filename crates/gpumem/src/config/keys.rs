//! The one table of configuration keys: name, value, meaning, and how each is read and shown.
//! The parser, its error text, `gpumem info`'s printout and the README's table all come from
//! [`KEYS`]; the default of each key is what it shows on `Config::default()`.

use super::{BackendKind, Config, Power2Divisions, MIB};

/// One configuration key.
pub struct Key {
    /// the name users type (PyTorch's where the meaning is the same)
    pub name: &'static str,
    /// the values it takes
    pub value: &'static str,
    /// what it does
    pub meaning: &'static str,
    /// set it from a value; the error says what is wrong (the caller names the key)
    pub(super) set: fn(&mut Config, &str) -> Result<(), String>,
    /// the value in force, written so that `set` reads it back
    pub(super) get: fn(&Config) -> String,
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Key").field("name", &self.name).finish()
    }
}

impl Key {
    /// The value of this key in `config`, as the configuration string writes it.
    pub fn show(&self, config: &Config) -> String {
        (self.get)(config)
    }

    /// The default value, as the configuration string writes it.
    pub fn default_value(&self) -> String {
        self.show(&Config::default())
    }

    /// This key's row of the README's table: `| key | values | default | meaning |`.
    pub fn markdown_row(&self) -> String {
        format!(
            "| `{}` | {} | `{}` | {} |",
            self.name,
            self.value,
            self.default_value(),
            self.meaning
        )
    }
}

fn int(v: &str) -> Result<u64, String> {
    v.parse::<u64>()
        .map_err(|_| "expected a non-negative integer".to_string())
}

fn num(v: &str) -> Result<f64, String> {
    v.parse::<f64>()
        .ok()
        .filter(|x| x.is_finite())
        .ok_or_else(|| "expected a number".to_string())
}

fn boolean(v: &str) -> Result<bool, String> {
    match v {
        "1" | "true" | "True" | "TRUE" => Ok(true),
        "0" | "false" | "False" | "FALSE" => Ok(false),
        _ => Err("expected True or False".into()),
    }
}

/// MiB in `lo..=hi` as bytes.
fn mib(v: &str, lo: u64, hi: u64, range: &str) -> Result<u64, String> {
    let n = int(v)?;
    if !(lo..=hi).contains(&n) {
        return Err(format!("expected {range}"));
    }
    Ok(n * MIB)
}

/// A number in an interval, checked by `ok`.
fn fraction(v: &str, ok: impl Fn(f64) -> bool, range: &str) -> Result<f64, String> {
    let f = num(v)?;
    if !ok(f) {
        return Err(format!("must be in {range}"));
    }
    Ok(f)
}

/// `auto` or a count in `1..=max`.
fn auto_count(v: &str, max: u64) -> Result<Option<usize>, String> {
    if v == "auto" {
        return Ok(None);
    }
    let n = int(v)?;
    if n == 0 || n > max {
        return Err(format!("expected auto or 1..={max}"));
    }
    Ok(Some(n as usize))
}

fn opt<T>(v: &str, f: impl Fn(&str) -> Result<T, String>) -> Result<Option<T>, String> {
    if v == "none" {
        Ok(None)
    } else {
        f(v).map(Some)
    }
}

fn show_opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "none".into(), |x| x.to_string())
}

fn show_auto(v: Option<usize>) -> String {
    v.map_or_else(|| "auto".into(), |x| x.to_string())
}

fn show_bool(b: bool) -> String {
    if b { "True" } else { "False" }.into()
}

/// Largest MiB value a size key takes (1 PiB).
const MAX_MB: u64 = 1 << 30;

/// Every key, in the order `gpumem info` and the README list them.
pub const KEYS: &[Key] = &[
    Key {
        name: "max_split_size_mb",
        value: "`none` or an integer > 20 (MiB)",
        meaning: "blocks this large or larger are not split (PyTorch)",
        set: |c, v| {
            c.pool.max_split_size = opt(v, |v| {
                mib(v, 21, MAX_MB, "21..=1073741824 (MiB)")
                    .map_err(|_| "must be larger than 20 (MB) and at most 2^30".to_string())
            })?;
            Ok(())
        },
        get: |c| show_opt(c.pool.max_split_size.map(|b| b / MIB)),
    },
    Key {
        name: "roundup_power2_divisions",
        value: "`N` or `[256:1,512:2,>:4]` (N: 0 or a power of two ≤ 64)",
        meaning: "round sizes up to N steps per power of two, per size interval as PyTorch's code reads them (`256:1` from 256 MB, and below it as the first; `512:2` from 512 MB; `>` beyond); also at run time through `torch.cuda.memory._set_allocator_settings`, with `max_split_size_mb` and `garbage_collection_threshold` (PyTorch)",
        set: |c, v| {
            c.pool.roundup_power2_divisions = Power2Divisions::parse(v)?;
            Ok(())
        },
        get: |c| c.pool.roundup_power2_divisions.to_string(),
    },
    Key {
        name: "garbage_collection_threshold",
        value: "`none` or 0 < t < 1",
        meaning: "release least recently used cached segments before growing past t × the budget (PyTorch)",
        set: |c, v| {
            c.pool.garbage_collection_threshold =
                opt(v, |v| fraction(v, |t| t > 0.0 && t < 1.0, "(0, 1)"))?;
            Ok(())
        },
        get: |c| show_opt(c.pool.garbage_collection_threshold),
    },
    Key {
        name: "backend",
        value: "`native` or `cudaMallocAsync`",
        meaning: "where segments come from on CUDA: cuMemAlloc and virtual-memory pages, or a stream-ordered pool (PyTorch)",
        set: |c, v| {
            c.backend.kind = match v {
                "native" => BackendKind::Native,
                "cudaMallocAsync" => BackendKind::CudaMallocAsync,
                _ => return Err("expected native or cudaMallocAsync".into()),
            };
            Ok(())
        },
        get: |c| {
            match c.backend.kind {
                BackendKind::Native => "native",
                BackendKind::CudaMallocAsync => "cudaMallocAsync",
            }
            .into()
        },
    },
    Key {
        name: "memory_fraction",
        value: "`none` or 0 < f ≤ 1",
        meaning: "VRAM budget as a fraction of device memory, enforced before the driver is asked (`set_per_process_memory_fraction`)",
        set: |c, v| {
            c.budget.memory_fraction = opt(v, |v| fraction(v, |f| f > 0.0 && f <= 1.0, "(0, 1]"))?;
            Ok(())
        },
        get: |c| show_opt(c.budget.memory_fraction),
    },
    Key {
        name: "memory_limit_mb",
        value: "`none` or an integer ≥ 1 (MiB)",
        meaning: "VRAM budget in MiB, enforced before the driver is asked",
        set: |c, v| {
            c.budget.memory_limit = opt(v, |v| mib(v, 1, MAX_MB, "1..=1073741824 (MiB)"))?;
            Ok(())
        },
        get: |c| show_opt(c.budget.memory_limit.map(|b| b / MIB)),
    },
    Key {
        name: "release_threshold_mb",
        value: "`unlimited` or an integer (MiB)",
        meaning: "what the cudaMallocAsync pool keeps cached (`cudaMemPoolAttrReleaseThreshold`)",
        set: |c, v| {
            c.backend.release_threshold = match v {
                "unlimited" => u64::MAX,
                v => mib(v, 0, MAX_MB, "unlimited or 0..=1073741824 (MiB)")?,
            };
            Ok(())
        },
        get: |c| match c.backend.release_threshold {
            u64::MAX => "unlimited".into(),
            b => (b / MIB).to_string(),
        },
    },
    Key {
        name: "shards",
        value: "`auto` or 1–64",
        meaning: "independent pool shards; each thread uses one, so threads do not share a lock (`auto`: one per core, at most 16)",
        set: |c, v| {
            c.shards = auto_count(v, 64)?;
            Ok(())
        },
        get: |c| show_auto(c.shards),
    },
    Key {
        name: "quick_cache",
        value: "0–256",
        meaning: "recently freed blocks kept per shard for exact-size reuse before they coalesce (0 = off; more than the default's one leaves more blocks unmerged, which packs jobs of varying sizes worse)",
        set: |c, v| {
            let n = int(v)?;
            if n > 256 {
                return Err("expected 0..=256".into());
            }
            c.pool.quick_cache = n as usize;
            Ok(())
        },
        get: |c| c.pool.quick_cache.to_string(),
    },
    Key {
        name: "cross_stream_reuse",
        value: "`True` or `False`",
        meaning: "let a stream take another stream's wholly free cached segment, ordered by an event wait (classic segments)",
        set: |c, v| {
            c.pool.cross_stream_reuse = boolean(v)?;
            Ok(())
        },
        get: |c| show_bool(c.pool.cross_stream_reuse),
    },
    Key {
        name: "expandable_segments",
        value: "`True` or `False`",
        meaning: "virtual-memory segments where the device has them (PyTorch's name; on by default in gpumem)",
        set: |c, v| {
            c.pool.expandable_segments = boolean(v)?;
            Ok(())
        },
        get: |c| show_bool(c.pool.expandable_segments),
    },
    Key {
        name: "expandable_page_mb",
        value: "0 or a power of two of MiB up to 1024 (rounded up to the device's granularity, 2 MiB on current GPUs)",
        meaning: "bytes of one page of expandable segments, the unit they map in (a run of pages is one physical handle of up to 32 pages; each driver call costs about the same whatever the handle's size; 0 = the granularity)",
        set: |c, v| {
            let bytes = mib(v, 0, 1024, "0..=1024 (MiB)")?;
            // (address ranges are reserved aligned to a page, which the driver takes only as
            // a power of two)
            if bytes != 0 && !bytes.is_power_of_two() {
                return Err("expected a power of two (1, 2, 4, ... 1024 MiB)".into());
            }
            c.backend.page_bytes = bytes;
            Ok(())
        },
        get: |c| (c.backend.page_bytes / MIB).to_string(),
    },
    Key {
        name: "planned_layout",
        value: "`True` or `False`",
        meaning: "a job whose allocations repeat (a training step, fixed shapes) gets its step's blocks over 1 MiB placed once by their lifetimes, around its long-lived tensors, and served there with no search and no driver call, where that takes no more than 1% over the memory the dynamic layout reached (expandable segments only)",
        set: |c, v| {
            c.pool.planned_layout = boolean(v)?;
            Ok(())
        },
        get: |c| show_bool(c.pool.planned_layout),
    },
    Key {
        name: "time_calls",
        value: "`True` or `False`",
        meaning: "time every allocation and free on its calling thread into the stats `host_alloc_ns` and `host_free_ns` (two clock reads a call; off by default)",
        set: |c, v| {
            c.pool.time_calls = boolean(v)?;
            Ok(())
        },
        get: |c| show_bool(c.pool.time_calls),
    },
    Key {
        name: "pressure_release",
        value: "0 ≤ f < 1",
        meaning: "release the cache (free segments, idle pages) when the device's free memory, other processes counted, falls below this fraction of its total and another process's use has grown (0 = never)",
        set: |c, v| {
            c.pool.pressure_release = fraction(v, |f| (0.0..1.0).contains(&f), "[0, 1)")?;
            Ok(())
        },
        get: |c| c.pool.pressure_release.to_string(),
    },
    Key {
        name: "pressure_interval_ms",
        value: "milliseconds",
        meaning: "how often at most the device's free memory is read for `pressure_release` (a driver call)",
        set: |c, v| {
            c.pool.pressure_interval_ms = int(v)?;
            Ok(())
        },
        get: |c| c.pool.pressure_interval_ms.to_string(),
    },
    Key {
        name: "staging_threads",
        value: "`auto` or 1–64",
        meaning: "lanes of staged host copies (`auto`: one per core, at most 16)",
        set: |c, v| {
            c.staging.threads = auto_count(v, 64)?;
            Ok(())
        },
        get: |c| show_auto(c.staging.threads),
    },
    Key {
        name: "staging_chunk_kb",
        value: "4–1048576 (KiB)",
        meaning: "largest pinned chunk of a staged copy (smaller copies use smaller chunks)",
        set: |c, v| {
            let kb = int(v)?;
            if !(4..=1 << 20).contains(&kb) {
                return Err("expected 4..=1048576 (KiB)".into());
            }
            c.staging.chunk_bytes = kb * 1024;
            Ok(())
        },
        get: |c| (c.staging.chunk_bytes / 1024).to_string(),
    },
    Key {
        name: "staging_min_kb",
        value: "0–1073741824 (KiB)",
        meaning: "smallest copy `Transfer::Auto` stages",
        set: |c, v| {
            let kb = int(v)?;
            if kb > 1 << 30 {
                return Err("expected 0..=1073741824 (KiB)".into());
            }
            c.staging.min_bytes = kb * 1024;
            Ok(())
        },
        get: |c| (c.staging.min_bytes / 1024).to_string(),
    },
];

/// The key named `name`.
pub fn key(name: &str) -> Option<&'static Key> {
    KEYS.iter().find(|k| k.name == name)
}
