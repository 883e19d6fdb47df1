//! One module per command.

pub mod advise;
pub mod bench_alloc;
pub mod bench_ring;
pub mod bench_transfer;
#[cfg(feature = "cuda")]
pub mod bench_unified;
pub mod info;
pub mod replay;
pub mod synth;
pub mod viz;

/// `gpumem bench unified` needs CUDA; built without it, it says so.
#[cfg(not(feature = "cuda"))]
pub mod bench_unified {
    /// Always an error: this build has no CUDA.
    pub fn run(_: bool, _: usize, _: usize) -> crate::output::Result<()> {
        Err("built without the cuda feature".into())
    }
}
