//! `gpumem info`: the devices and their memory capabilities (or the host backend), and the
//! configuration in force.

use crate::output::Result;
use gpumem::units::human;
use gpumem::{Config, DeviceInfo};
use serde::Serialize;

#[derive(Serialize)]
struct InfoOut {
    backend: &'static str,
    /// the operating system under the driver (WSL2 detected from the kernel release)
    platform: gpumem::Platform,
    devices: Vec<DeviceInfo>,
    host_memory: gpumem::resource::MemInfo,
    /// every configuration key with its value in force, in the configuration string's units
    config: serde_json::Map<String, serde_json::Value>,
    /// the same as one configuration string (it parses back to the same configuration)
    config_string: String,
}

pub fn run(json: bool) -> Result<()> {
    let devices = gpumem::device::devices()?;
    let config = Config::from_env()?;
    let out = InfoOut {
        backend: if devices.is_empty() { "host" } else { "cuda" },
        platform: gpumem::Platform::detect(),
        host_memory: gpumem::resource::host::host_mem_info(),
        config: config
            .entries()
            .into_iter()
            .map(|(k, v)| (k.to_string(), serde_json::Value::String(v)))
            .collect(),
        config_string: config.to_string(),
        devices,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("gpumem {}", env!("CARGO_PKG_VERSION"));
    if out.devices.is_empty() {
        println!("No CUDA GPU found (no driver library, or no device): using the host backend.");
        println!(
            "platform: {:?}; memory visibility: {} (the host backend)",
            out.platform,
            gpumem::MemoryVisibility::ExplicitCopies.describe()
        );
        println!(
            "host memory: {} free of {}",
            human(out.host_memory.free),
            human(out.host_memory.total)
        );
    }
    for d in &out.devices {
        let yn = |b: bool| if b { "yes" } else { "no" };
        println!(
            "device {}: {} (compute {}.{}, {} SMs, driver {}.{})",
            d.ordinal,
            d.name,
            d.compute_capability.0,
            d.compute_capability.1,
            d.multiprocessors,
            d.driver_version / 1000,
            (d.driver_version % 1000) / 10
        );
        println!(
            "  memory                      {} free of {}",
            human(d.free_memory),
            human(d.total_memory)
        );
        println!(
            "  managed memory              {}",
            yn(d.caps.managed_memory)
        );
        println!(
            "  concurrent managed access   {}",
            yn(d.caps.concurrent_managed_access)
        );
        println!(
            "  pageable memory access      {}",
            yn(d.caps.pageable_memory_access)
        );
        println!(
            "  virtual memory management   {}",
            yn(d.virtual_memory_management)
        );
        println!("  memory pools                {}", yn(d.memory_pools));
        println!("  unified addressing          {}", yn(d.unified_addressing));
        println!(
            "  host-native atomics         {}",
            yn(d.caps.host_native_atomics)
        );
        println!(
            "  mapped pinned memory        {}",
            yn(d.caps.can_map_host_memory)
        );
        println!("  platform                    {:?}", d.platform);
        println!("  memory visibility           {}", d.visibility.describe());
        let peers: Vec<String> = d.peer_access.iter().map(|p| p.to_string()).collect();
        println!(
            "  peer access to              {}",
            if peers.is_empty() {
                "none".to_string()
            } else {
                peers.join(", ")
            }
        );
    }
    let set = std::env::var(gpumem::config::ENV_VAR).is_ok();
    println!(
        "configuration ({}; `*` marks values that differ from the default):",
        if set {
            "from GPUMEM_CONF"
        } else {
            "GPUMEM_CONF unset: the defaults"
        }
    );
    for k in gpumem::config::keys::KEYS {
        let v = k.show(&config);
        let mark = if v == k.default_value() { ' ' } else { '*' };
        println!("  {mark} {}:{v}", k.name);
    }
    Ok(())
}
