//! Who sees whose writes: the platform (native Linux, WSL2, Windows) and the device's
//! attributes decide whether the host and a running kernel see each other's writes, only at
//! kernel boundaries, or only through explicit copies. [`crate::Placement::Auto`] and the ring
//! bridge's automatic mode choose from it; `gpumem info` prints it.
//!
//! Everything here is a pure function of its inputs, so each platform can be tested on any
//! machine; [`Platform::detect`] is the one place that reads the running system.

use serde::Serialize;

/// The operating system under the CUDA driver, as far as memory sharing goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Platform {
    /// a native Linux kernel
    Linux,
    /// Linux under Windows' WSL2 (the driver is the Windows one, behind a paravirtual GPU):
    /// managed memory has no concurrent access and pinned memory is limited, whatever the
    /// device attributes say
    Wsl2,
    /// native Windows (WDDM): managed memory without concurrent access
    Windows,
    /// anything else
    Other,
}

impl Platform {
    /// The platform this process runs on (WSL2 from the kernel's release string).
    pub fn detect() -> Self {
        if cfg!(windows) {
            return Platform::Windows;
        }
        if !cfg!(target_os = "linux") {
            return Platform::Other;
        }
        match std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .or_else(|_| std::fs::read_to_string("/proc/version"))
        {
            Ok(release) => Self::from_kernel_release(&release),
            Err(_) => Platform::Linux,
        }
    }

    /// Classify a Linux kernel release string (`uname -r`, `/proc/version`): Microsoft's
    /// kernels for WSL carry "microsoft" (WSL2: "5.15.153.1-microsoft-standard-WSL2") or "WSL".
    pub fn from_kernel_release(release: &str) -> Self {
        let r = release.to_ascii_lowercase();
        if r.contains("microsoft") || r.contains("wsl") {
            Platform::Wsl2
        } else {
            Platform::Linux
        }
    }

    /// Native platforms let the host and a running kernel share managed and mapped memory.
    fn concurrent(self) -> bool {
        matches!(self, Platform::Linux)
    }
}

/// The device attributes visibility depends on ([`crate::DeviceInfo::caps`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct VisibilityCaps {
    /// cuMemAllocManaged works
    pub managed_memory: bool,
    /// host and device may touch managed memory at the same time
    pub concurrent_managed_access: bool,
    /// the device reads and writes pageable host memory (HMM or ATS)
    pub pageable_memory_access: bool,
    /// ... through the host's own page tables (ATS: Grace Hopper, no migration needed)
    pub pageable_uses_host_page_tables: bool,
    /// the interconnect carries atomics between host and device natively (NVLink-C2C)
    pub host_native_atomics: bool,
    /// page-locked host memory can be mapped into the device's address space
    pub can_map_host_memory: bool,
}

/// Whether the host and the device see each other's writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum MemoryVisibility {
    /// While kernels run, in managed memory and in mapped pinned memory (and, with
    /// `pageable_memory_access`, in ordinary host memory): a kernel can poll memory the host
    /// writes and the reverse, with system-scope fences. Native Linux with concurrent managed
    /// access (Pascal and later).
    SystemWide,
    /// Managed memory without concurrent access: each side sees the other's writes after a
    /// kernel completes and the host has synchronised, and the host must not touch managed
    /// memory while kernels run. Windows, WSL2, GPUs before Pascal.
    KernelBoundary,
    /// No memory both sides address: data moves only by explicit copies (and gpumem's host
    /// backend, which models a device with its own memory).
    ExplicitCopies,
}

impl MemoryVisibility {
    /// The visibility a device with `caps` has on `platform`.
    pub fn classify(caps: VisibilityCaps, platform: Platform) -> Self {
        let shared = caps.managed_memory || caps.can_map_host_memory;
        if !shared {
            MemoryVisibility::ExplicitCopies
        } else if platform.concurrent()
            && ((caps.managed_memory && caps.concurrent_managed_access)
                || (caps.pageable_memory_access && caps.host_native_atomics))
        {
            // concurrent managed access, or a coherent interconnect (NVLink-C2C: pageable
            // memory and atomics shared with the host)
            MemoryVisibility::SystemWide
        } else {
            MemoryVisibility::KernelBoundary
        }
    }

    /// Managed memory can be used as gpumem's unified buffers use it (host access between
    /// kernels of other buffers too).
    pub fn concurrent_managed(self) -> bool {
        self == MemoryVisibility::SystemWide
    }

    /// A kernel may poll mapped pinned memory that the host writes while it runs.
    pub fn polled_host_memory(self) -> bool {
        self == MemoryVisibility::SystemWide
    }

    /// A short description (what `gpumem info` prints).
    pub fn describe(self) -> &'static str {
        match self {
            MemoryVisibility::SystemWide => {
                "system-wide: host and running kernels see each other's writes"
            }
            MemoryVisibility::KernelBoundary => {
                "at kernel boundaries: managed memory settles when kernels end"
            }
            MemoryVisibility::ExplicitCopies => "explicit copies only",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An x86 server with a discrete Hopper GPU (the H100 machine's attributes).
    fn discrete() -> VisibilityCaps {
        VisibilityCaps {
            managed_memory: true,
            concurrent_managed_access: true,
            pageable_memory_access: false,
            pageable_uses_host_page_tables: false,
            host_native_atomics: false,
            can_map_host_memory: true,
        }
    }

    #[test]
    fn wsl2_is_recognised_from_its_kernel_release() {
        for r in [
            "5.15.153.1-microsoft-standard-WSL2",
            "4.4.0-19041-Microsoft",
            "Linux version 6.6.36.3-microsoft-standard-WSL2 (root@...)",
        ] {
            assert_eq!(Platform::from_kernel_release(r), Platform::Wsl2, "{r}");
        }
        for r in [
            "6.8.0-45-generic",
            "5.14.0-427.el9.x86_64",
            "6.1.0-26-cloud-amd64",
        ] {
            assert_eq!(Platform::from_kernel_release(r), Platform::Linux, "{r}");
        }
    }

    #[test]
    fn native_linux_with_concurrent_managed_access_is_system_wide() {
        let v = MemoryVisibility::classify(discrete(), Platform::Linux);
        assert_eq!(v, MemoryVisibility::SystemWide);
        assert!(v.concurrent_managed() && v.polled_host_memory());
        // Grace Hopper: coherent through NVLink-C2C, also system-wide
        let gh = VisibilityCaps {
            pageable_memory_access: true,
            pageable_uses_host_page_tables: true,
            host_native_atomics: true,
            ..discrete()
        };
        assert_eq!(
            MemoryVisibility::classify(gh, Platform::Linux),
            MemoryVisibility::SystemWide
        );
        // a coherent interconnect is enough by itself
        let coherent = VisibilityCaps {
            concurrent_managed_access: false,
            ..gh
        };
        assert_eq!(
            MemoryVisibility::classify(coherent, Platform::Linux),
            MemoryVisibility::SystemWide
        );
        // pageable access without host-native atomics (HMM on a PCIe GPU) adds nothing
        let hmm_only = VisibilityCaps {
            concurrent_managed_access: false,
            pageable_memory_access: true,
            ..discrete()
        };
        assert_eq!(
            MemoryVisibility::classify(hmm_only, Platform::Linux),
            MemoryVisibility::KernelBoundary
        );
    }

    #[test]
    fn wsl2_and_windows_settle_at_kernel_boundaries_whatever_the_attributes_say() {
        for p in [Platform::Wsl2, Platform::Windows, Platform::Other] {
            let v = MemoryVisibility::classify(discrete(), p);
            assert_eq!(v, MemoryVisibility::KernelBoundary, "{p:?}");
            assert!(!v.concurrent_managed() && !v.polled_host_memory());
        }
        let wsl = VisibilityCaps {
            concurrent_managed_access: false,
            ..discrete()
        };
        assert_eq!(
            MemoryVisibility::classify(wsl, Platform::Wsl2),
            MemoryVisibility::KernelBoundary
        );
    }

    #[test]
    fn older_gpus_and_devices_without_shared_memory() {
        let kepler = VisibilityCaps {
            concurrent_managed_access: false,
            ..discrete()
        };
        assert_eq!(
            MemoryVisibility::classify(kepler, Platform::Linux),
            MemoryVisibility::KernelBoundary
        );
        assert_eq!(
            MemoryVisibility::classify(VisibilityCaps::default(), Platform::Linux),
            MemoryVisibility::ExplicitCopies
        );
        let mapped_only = VisibilityCaps {
            can_map_host_memory: true,
            ..VisibilityCaps::default()
        };
        assert_eq!(
            MemoryVisibility::classify(mapped_only, Platform::Linux),
            MemoryVisibility::KernelBoundary
        );
    }
}
