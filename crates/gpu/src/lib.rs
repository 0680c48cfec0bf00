//! ember's GPU layer: one driver interface over HIP and CUDA (and a host implementation for
//! tests), device memory pools that give memory back, placement checks, kernel module loading,
//! and the device listing behind `ember devices`.
//!
//! Nothing here links a GPU runtime at build time: HIP (`libamdhip64`) and CUDA (`libcuda`) are
//! loaded at run time, and their absence is an error value that the engine turns into "running
//! on the CPU", never a crash.

pub mod blas;
pub mod cuda;
pub mod devices;
pub mod driver;
pub mod hip;
#[cfg(unix)]
pub mod host;
pub mod kernels;
pub mod ops;
pub mod peer;
pub mod placement;
pub mod pool;

pub use driver::{
    Backend, DeviceInfo, DeviceOrdinal, DevicePtr, Driver, DriverError, MemInfo, MemoryType,
    PointerInfo, RuntimeInfo, StreamHandle,
};
pub use pool::{DevicePool, MemoryReport, PoolBuffer, PoolConfig, PoolError, PoolKind, Purpose};
