//! Several GPUs: one [`Device`] per GPU behind a process-wide set, and peer access.
//!
//! Each device's allocator is its own [`CachingAllocator`] (its own shards and locks), made on
//! first use; looking one up is a lock-free read, so threads working on different devices
//! share no lock on the hot path. A buffer's device is its allocator's device.

use super::Device;
use crate::allocator::CachingAllocator;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::resource::Resource;
use parking_lot::Mutex;
use std::sync::OnceLock;

/// One [`Device`] per GPU.
#[derive(Debug)]
pub struct DeviceSet {
    slots: Box<[OnceLock<Device>]>,
    /// one host device instead of the GPUs (machines without one, front ends' tests)
    host: bool,
    /// configuration of every device's allocator
    config: Config,
    /// (from, to) pairs with peer access enabled
    peers: Mutex<Vec<(usize, usize)>>,
    /// serialises the creation of allocators (not their use)
    create: Mutex<()>,
}

impl DeviceSet {
    /// A set over every CUDA device (empty without a GPU), each allocator configured with
    /// `config`.
    pub fn new(config: Config) -> Self {
        Self {
            slots: (0..crate::device::device_count())
                .map(|_| OnceLock::new())
                .collect(),
            host: false,
            config,
            peers: Mutex::new(Vec::new()),
            create: Mutex::new(()),
        }
    }

    /// A set of one device, 0, over plain host memory: for machines without a GPU and for the
    /// tests of front ends, which then run the same code as on a GPU.
    pub fn host(config: Config) -> Self {
        Self {
            slots: vec![OnceLock::new()].into_boxed_slice(),
            host: true,
            config,
            peers: Mutex::new(Vec::new()),
            create: Mutex::new(()),
        }
    }

    /// The process-wide set, configured from `GPUMEM_CONF` (the defaults where it is unset,
    /// or malformed: then a warning is logged).
    pub fn global() -> &'static DeviceSet {
        static SET: OnceLock<DeviceSet> = OnceLock::new();
        SET.get_or_init(|| {
            let config = Config::from_env().unwrap_or_else(|e| {
                tracing::warn!("gpumem: {e}; the device set uses the default configuration");
                Config::default()
            });
            DeviceSet::new(config)
        })
    }

    /// The devices made so far (those [`DeviceSet::device`] was asked for).
    pub fn made(&self) -> impl Iterator<Item = &Device> {
        self.slots.iter().filter_map(OnceLock::get)
    }

    /// Device `ordinal` if it has been made (never makes it).
    pub fn made_device(&self, ordinal: usize) -> Option<&Device> {
        self.slots.get(ordinal).and_then(OnceLock::get)
    }

    /// Number of devices.
    pub fn count(&self) -> usize {
        self.slots.len()
    }

    /// Device `ordinal`'s allocator (made on first use).
    pub fn allocator(&self, ordinal: usize) -> Result<&CachingAllocator> {
        Ok(self.device(ordinal)?.allocator())
    }

    /// Device `ordinal` (made on first use).
    pub fn device(&self, ordinal: usize) -> Result<&Device> {
        // not `ok_or`: on every allocation of the C ABI an eager error would be built and
        // dropped (measured: ~7 ns of a ~60 ns alloc + free)
        let Some(slot) = self.slots.get(ordinal) else {
            return Err(Error::InvalidDevice {
                ordinal,
                count: self.slots.len(),
            });
        };
        if let Some(a) = slot.get() {
            return Ok(a);
        }
        let _one_at_a_time = self.create.lock();
        if let Some(a) = slot.get() {
            return Ok(a);
        }
        let a = self.make(ordinal)?;
        Ok(slot.get_or_init(|| a))
    }

    #[cfg(feature = "cuda")]
    fn make(&self, ordinal: usize) -> Result<Device> {
        if self.host {
            return Device::host(self.config.clone());
        }
        let a = Device::cuda(ordinal, self.config.clone())?;
        // peers enabled before this allocator existed get access to its pages too
        for &(from, to) in self.peers.lock().iter() {
            if to == ordinal {
                grant(&a, from)?;
            }
        }
        Ok(a)
    }

    #[cfg(not(feature = "cuda"))]
    fn make(&self, ordinal: usize) -> Result<Device> {
        if self.host {
            return Device::host(self.config.clone());
        }
        Err(Error::InvalidDevice { ordinal, count: 0 })
    }

    /// Let device `from` access device `to`'s memory directly: the contexts' peer access, and
    /// access to `to`'s virtual-memory pages (present and future). Both directions are
    /// separate calls.
    pub fn enable_peer_access(&self, from: usize, to: usize) -> Result<()> {
        let count = self.count();
        for d in [from, to] {
            if d >= count {
                return Err(Error::InvalidDevice { ordinal: d, count });
            }
        }
        if from == to || self.peers.lock().contains(&(from, to)) {
            return Ok(());
        }
        #[cfg(feature = "cuda")]
        crate::resource::cuda::enable_peer_access(from, to)?;
        self.peers.lock().push((from, to));
        if let Some(a) = self.slots[to].get() {
            grant(a, from)?;
        }
        Ok(())
    }

    /// True once [`DeviceSet::enable_peer_access`] succeeded for (from, to).
    pub fn peer_enabled(&self, from: usize, to: usize) -> bool {
        from == to || self.peers.lock().contains(&(from, to))
    }
}

/// Give device `peer` access to `device`'s memory where the memory needs it.
fn grant(device: &Device, peer: usize) -> Result<()> {
    device
        .peer_access()
        .map_or(Ok(()), |p| p.grant_peer_access(peer))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_ordinal_is_an_error() {
        let set = DeviceSet::new(Config::default());
        let n = set.count();
        assert!(matches!(
            set.allocator(n),
            Err(Error::InvalidDevice { ordinal, count }) if ordinal == n && count == n
        ));
        assert!(set.enable_peer_access(0, n).is_err());
    }
}
