//! Errors are values: every bad input comes back as an [`Error`] and leaves the allocator usable.

use std::fmt;

/// Result alias used across gpumem.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Figures reported with an out-of-memory error, in bytes.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct OomReport {
    /// Bytes the caller asked for.
    pub requested: u64,
    /// Bytes the allocator tried to obtain from the device (segment size).
    pub segment_request: u64,
    /// Free memory the device reported after the retries.
    pub device_free: u64,
    /// Total memory of the device.
    pub device_total: u64,
    /// Bytes reserved by this allocator (segments).
    pub reserved: u64,
    /// Bytes handed out to callers.
    pub allocated: u64,
    /// Largest cached free block in the allocator.
    pub largest_free_block: u64,
    /// VRAM budget in force, if any.
    pub limit: Option<u64>,
}

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let h = crate::units::human;
        write!(
            f,
            "tried to allocate {} (segment of {}); device has {} free of {}; \
             gpumem has reserved {} of which {} is allocated and {} is reserved but unallocated \
             (largest free block {})",
            h(self.requested),
            h(self.segment_request),
            h(self.device_free),
            h(self.device_total),
            h(self.reserved),
            h(self.allocated),
            h(self.reserved.saturating_sub(self.allocated)),
            h(self.largest_free_block),
        )?;
        if let Some(limit) = self.limit {
            write!(f, "; budget {}", h(limit))?;
        }
        Ok(())
    }
}

/// Everything that can go wrong in gpumem.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A request for zero bytes (or zero elements).
    #[error("invalid size: a request must be for at least one byte")]
    ZeroSize,
    /// A request larger than any device could serve.
    #[error("invalid size: {requested} bytes is larger than the {max} bytes gpumem accepts")]
    SizeTooLarge {
        /// bytes requested
        requested: u64,
        /// largest accepted request
        max: u64,
    },
    /// Alignment not a power of two, or larger than supported.
    #[error("invalid alignment {align}: must be a power of two no larger than {max}")]
    InvalidAlignment {
        /// alignment requested
        align: usize,
        /// largest supported alignment
        max: usize,
    },
    /// A pointer this allocator never handed out.
    #[error("unknown pointer {ptr:#x}: it was not allocated by this allocator")]
    UnknownPointer {
        /// the pointer
        ptr: u64,
    },
    /// A pointer freed twice.
    #[error("double free of pointer {ptr:#x}")]
    DoubleFree {
        /// the pointer
        ptr: u64,
    },
    /// Out of device memory after flushing the cache and retrying.
    #[error("out of memory: {0}")]
    OutOfMemory(Box<OomReport>),
    /// A raw resource could not provide the bytes (before the pool's retries).
    #[error("the {resource} resource could not allocate {bytes} bytes")]
    ResourceExhausted {
        /// resource name
        resource: String,
        /// bytes requested from it
        bytes: u64,
    },
    /// Device ordinal that does not exist.
    #[error("invalid device {ordinal}: {count} device(s) present")]
    InvalidDevice {
        /// requested ordinal
        ordinal: usize,
        /// devices present
        count: usize,
    },
    /// No usable CUDA driver or GPU.
    #[error("no CUDA GPU available: {0}")]
    NoGpu(String),
    /// A bad configuration string.
    #[error("bad configuration: {0}")]
    Config(String),
    /// An index or range outside a buffer.
    #[error("out of bounds: {what} (length {len})")]
    OutOfBounds {
        /// what was asked for
        what: String,
        /// length of the buffer
        len: usize,
    },
    /// Lengths of source and destination disagree.
    #[error("length mismatch: buffer holds {expected} elements, slice has {got}")]
    LengthMismatch {
        /// buffer length
        expected: usize,
        /// slice length
        got: usize,
    },
    /// The operation is not available on this backend.
    #[error("unsupported on the {backend} backend: {what}")]
    Unsupported {
        /// backend name
        backend: String,
        /// operation
        what: String,
    },
    /// Managed memory refused by the VRAM guard (oversubscription is opt-in).
    #[error(
        "managed-memory guard: {requested} more bytes would hold {would_hold} bytes of managed \
         memory, past {fraction} of the device's {free} free bytes (oversubscription is opt-in: \
         it can stall the whole GPU)"
    )]
    ManagedGuard {
        /// bytes asked for
        requested: u64,
        /// managed bytes held after the request
        would_hold: u64,
        /// device bytes free when asked
        free: u64,
        /// the guard's fraction of free memory
        fraction: f64,
    },
    /// A malformed or inconsistent allocation trace.
    #[error("trace: {0}")]
    Trace(String),
    /// A CUDA driver (or CUPTI) call failed.
    #[error("CUDA error in {call}: {name} (code {code})")]
    Cuda {
        /// the entry point that failed
        call: &'static str,
        /// the result code it returned (`CUresult`, or `CUptiResult` for CUPTI calls)
        code: i32,
        /// the code's name, e.g. `CUDA_ERROR_INVALID_VALUE`
        name: String,
    },
    /// An argument the callee cannot take (a size other than the allocation's, a range that
    /// is not page-aligned, a fraction out of range).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A call that is not valid in the current state (a page mapped twice, a second counter).
    #[error("invalid state: {0}")]
    InvalidState(String),
    /// A wait that gave up: the other side (a kernel polling a ring) did not answer in time.
    #[error("timed out after {waited:?} waiting for {what}")]
    Timeout {
        /// what was awaited
        what: String,
        /// how long
        waited: std::time::Duration,
    },
}

impl Error {
    /// True for [`Error::OutOfMemory`] and [`Error::ResourceExhausted`].
    pub fn is_out_of_memory(&self) -> bool {
        matches!(
            self,
            Error::OutOfMemory(_) | Error::ResourceExhausted { .. }
        )
    }
}
