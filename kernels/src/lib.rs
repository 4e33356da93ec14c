//! Tensor operations and kernels of deco.
//!
//! Model code calls the functions of [`ops`] on burn tensors; each is written once as a
//! composition of burn operations, which runs on every burn device (flex on CPU, wgpu, CUDA).
//! Fused CubeCL and CPU-SIMD implementations will replace individual functions behind the same
//! signatures, checked against these compositions as the reference.
//!
//! [`device`] turns a user-facing name (`flex`, `wgpu`, `cuda`) into a burn [`burn::tensor::Device`].

pub mod device;
pub mod ops;

pub use device::{DeviceError, select_device};
