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
    /// The device is compiled in but its runtime is missing on this machine.
    #[error("device `{name}` is not usable here: {why}")]
    Unavailable {
        /// Device name.
        name: String,
        /// What is missing.
        why: String,
    },
}

/// Whether one of the shared libraries `names` can be loaded (`dlopen`, the search cudarc
/// makes: `LD_LIBRARY_PATH`, the loader cache).
#[cfg(feature = "cuda")]
fn loadable(names: &[&str]) -> bool {
    names.iter().any(|n| {
        let Ok(c) = std::ffi::CString::new(*n) else { return false };
        // SAFETY: `c` is a valid NUL-terminated string; the handle of a successful open is
        // kept (cudarc opens the same library next).
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_LAZY) };
        !h.is_null()
    })
}

/// Checks that the NVIDIA driver library is present before burn's CUDA runtime loads it
/// (cudarc panics on a missing library; deco reports it instead).
#[cfg(feature = "cuda")]
fn check_cuda(name: &str) -> Result<(), DeviceError> {
    if !loadable(&["libcuda.so.1", "libcuda.so"]) {
        return Err(DeviceError::Unavailable {
            name: name.to_string(),
            why: "the NVIDIA driver library libcuda.so.1 was not found (no driver installed, or set LD_LIBRARY_PATH)".into(),
        });
    }
    Ok(())
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
/// [`DeviceError::Unknown`] for other names, [`DeviceError::NotCompiled`] when the feature is off,
/// [`DeviceError::Unavailable`] for `cuda` on a machine without the NVIDIA driver library.
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
                check_cuda(name)?;
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
