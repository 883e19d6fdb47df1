//! What every command shares: the error type, the configuration from `--conf` or the
//! environment, JSON or text output, and the statistics of repeated measurements.

use gpumem::Config;
use serde::Serialize;

/// Why a command failed; `main` prints it after `gpumem: ` and exits non-zero.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// gpumem refused or failed.
    #[error(transparent)]
    Gpumem(#[from] gpumem::Error),
    /// A file could not be read or written.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// Output could not be encoded.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// Anything else, said in words (bad arguments, a foreign library's error).
    #[error("{0}")]
    Message(String),
}

impl From<String> for CliError {
    fn from(s: String) -> Self {
        CliError::Message(s)
    }
}

impl From<&str> for CliError {
    fn from(s: &str) -> Self {
        CliError::Message(s.to_string())
    }
}

/// A command's result.
pub type Result<T, E = CliError> = std::result::Result<T, E>;

/// An error of another library (cudarc, NVRTC), in words.
#[cfg(feature = "cuda")]
pub fn msg<E: std::fmt::Display>(err: E) -> CliError {
    CliError::Message(err.to_string())
}

/// Where a benchmark runs and with what configuration: `--device`, `--host`, `--conf`.
#[derive(Debug, Clone, clap::Args)]
pub struct Target {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Force the host backend even where a GPU is present.
    #[arg(long)]
    pub host: bool,
    /// gpumem configuration (as GPUMEM_CONF); defaults to GPUMEM_CONF or the defaults.
    #[arg(long)]
    pub conf: Option<String>,
}

impl Target {
    /// The configuration to run with (see [`config_from`]).
    pub fn config(&self) -> Result<Config> {
        config_from(self.conf.as_deref())
    }

    /// Whether to run on the GPU: one is present and `--host` was not given.
    pub fn gpu(&self) -> bool {
        !self.host && gpumem::device::cuda_available()
    }
}

/// The configuration a command runs with: `--conf` where given, else `GPUMEM_CONF` (else the
/// defaults). A bad string is an error naming the key, whichever it came from.
pub fn config_from(conf: Option<&str>) -> Result<Config> {
    Ok(match conf {
        Some(s) => Config::parse(s)?,
        None => Config::from_env()?,
    })
}

/// Print `out` as one line of JSON, or through `text`.
pub fn emit<T: Serialize>(json: bool, out: &T, text: impl FnOnce(&T)) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(out)?);
    } else {
        text(out);
    }
    Ok(())
}

/// Median of `v` (0 for none).
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Mean of `v` (0 for none).
pub fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.iter().sum::<f64>() / v.len() as f64
}

/// "NAME (device N)" for the benchmarks' headers, or an error naming the missing device.
#[cfg(feature = "cuda")]
pub fn device_name(ordinal: usize) -> Result<String> {
    gpumem::device::devices()?
        .into_iter()
        .find(|d| d.ordinal == ordinal)
        .map(|d| format!("{} (device {})", d.name, d.ordinal))
        .ok_or_else(|| format!("no CUDA device {ordinal}").into())
}
