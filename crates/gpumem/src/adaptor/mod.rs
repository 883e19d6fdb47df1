//! Adaptors: resources that wrap another resource and add one concern (RMM style).
//!
//! - [`Limit`]: a byte budget enforced before the wrapped resource is asked;
//! - [`Tracking`]: remembers every live allocation for leak reports;
//! - [`registration`]: which ranges a user that registers memory (NCCL) holds, from the
//!   pools' segment events.

mod limit;
pub mod registration;
mod tracking;

pub use limit::Limit;
pub use tracking::{Leak, Tracking};
