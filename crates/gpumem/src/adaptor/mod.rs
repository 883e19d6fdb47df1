//! Adaptors: resources that wrap another resource and add one concern (RMM style).
//!
//! - [`Limit`]: a byte budget enforced before the wrapped resource is asked;
//! - [`Tracking`]: remembers every live allocation for leak reports.

mod limit;
mod tracking;

pub use limit::Limit;
pub use tracking::{Leak, Tracking};
