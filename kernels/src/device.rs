//! Runtime device selection.
//!
//! The backend is chosen at run time by name; model code takes a `&Device` and has no backend
//! type parameter (burn 0.22's dispatch design).

use burn::tensor::Device;

/// An unknown or not-compiled-in device name.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The name is not a device deco knows.
    #[error("unknown device `{0}` (expected one of: flex, wgpu, cuda)")]
    Unknown(String),
    /// The device exists but this build lacks its cargo feature.
    #[error("device `{name}` needs deco built with `--features {feature}`")]
    NotCompiled {
        /// Device name.
        name: String,
        /// Cargo feature that enables it.
        feature: &'static str,
    },
}

/// The device names this build supports, default first.
pub fn available_devices() -> Vec<&'static str> {
    let mut v = vec!["flex"];
    if cfg!(feature = "wgpu") {
        v.push("wgpu");
    }
    if cfg!(feature = "cuda") {
        v.push("cuda");
    }
    v
}

/// Returns the burn device for `name`: `flex` (pure-Rust CPU, the default), `wgpu` (CubeCL over
/// Vulkan/Metal/DX12, feature `wgpu`) or `cuda` / `cuda:N` (CubeCL CUDA, feature `cuda`).
///
/// # Errors
/// [`DeviceError::Unknown`] for other names, [`DeviceError::NotCompiled`] when the feature is off.
pub fn select_device(name: &str) -> Result<Device, DeviceError> {
    let (kind, index) = match name.split_once(':') {
        Some((k, i)) => (k, i.parse::<usize>().map_err(|_| DeviceError::Unknown(name.to_string()))?),
        None => (name, 0),
    };
    match kind {
        "flex" | "cpu" => Ok(Device::flex()),
        "wgpu" => {
            #[cfg(feature = "wgpu")]
            {
                let _ = index;
                Ok(Device::wgpu(Default::default()))
            }
            #[cfg(not(feature = "wgpu"))]
            Err(DeviceError::NotCompiled { name: name.to_string(), feature: "wgpu" })
        }
        "cuda" => {
            #[cfg(feature = "cuda")]
            {
                Ok(Device::cuda(index))
            }
            #[cfg(not(feature = "cuda"))]
            {
                let _ = index;
                Err(DeviceError::NotCompiled { name: name.to_string(), feature: "cuda" })
            }
        }
        _ => Err(DeviceError::Unknown(name.to_string())),
    }
}
