//! What every resource that hands out raw addresses needs: the request check before it asks
//! for memory, and a registry of its live allocations, so that a free of an address it did not
//! hand out (or with another size) is an error, never undefined behaviour, and whatever is
//! still live when it drops can be given back.

use super::DevPtr;
use crate::error::{Error, Result};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;

/// The checks every `allocate` makes first: at least one byte, an alignment that is a power
/// of two no larger than `max_align`.
pub(crate) fn check_request(bytes: usize, align: usize, max_align: usize) -> Result<()> {
    if bytes == 0 {
        return Err(Error::ZeroSize);
    }
    if !align.is_power_of_two() || align > max_align {
        return Err(Error::InvalidAlignment {
            align,
            max: max_align,
        });
    }
    Ok(())
}

/// Live allocations of one resource: address → what it needs to free it (`V`) and its size.
#[derive(Debug)]
pub(crate) struct Registry<V> {
    /// the resource's name, for errors
    name: &'static str,
    live: Mutex<FxHashMap<DevPtr, (V, usize)>>,
}

impl<V> Registry<V> {
    pub(crate) fn new(name: &'static str) -> Self {
        Self {
            name,
            live: Mutex::new(FxHashMap::default()),
        }
    }

    /// Record a new allocation of `bytes` at `ptr`.
    pub(crate) fn insert(&self, ptr: DevPtr, value: V, bytes: usize) {
        self.live.lock().insert(ptr, (value, bytes));
    }

    /// Take the allocation at `ptr` out of the registry, checking that the caller gives the
    /// size it was allocated with (`None`: any size). The allocation stays registered when the
    /// check fails.
    pub(crate) fn take(&self, ptr: DevPtr, bytes: Option<usize>) -> Result<V> {
        let mut live = self.live.lock();
        match live.get(&ptr) {
            None => Err(Error::UnknownPointer { ptr }),
            Some(&(_, b)) if bytes.is_some_and(|want| want != b) => {
                Err(Error::InvalidArgument(format!(
                    "{} deallocate of {ptr:#x} with a size ({}) other than it was allocated with ({b})",
                    self.name,
                    bytes.unwrap_or(0)
                )))
            }
            Some(_) => Ok(live.remove(&ptr).map(|(v, _)| v).expect("present")),
        }
    }

    /// Bytes of all live allocations.
    pub(crate) fn total_bytes(&self) -> u64 {
        self.live.lock().values().map(|&(_, b)| b as u64).sum()
    }

    /// Remove and return every live allocation (for the resource's `Drop`).
    pub(crate) fn drain(&mut self) -> Vec<(DevPtr, V)> {
        self.live
            .get_mut()
            .drain()
            .map(|(p, (v, _))| (p, v))
            .collect()
    }
}
