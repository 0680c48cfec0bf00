//! Smoke test of the GPU layer on a real device: lists devices, selects a pool (probe included,
//! touching memory with the `ember_fill_u32` kernel), places "weights", checks placement, runs a
//! burst of scratch allocations, trims after idle and prints the memory report and how far the
//! device's free memory came back.
//!
//! Usage: `gpu_smoke <kernels-dir>`; set `EMBER_FORCE_VMM_PROBE_FAIL=1` to exercise the fallback.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ember_gpu::cuda::CudaDriver;
use ember_gpu::devices::{self, ListOptions};
use ember_gpu::driver::{DeviceOrdinal, DevicePtr, Driver, DriverError, StreamHandle};
use ember_gpu::hip::{HipDriver, HipLoadOptions};
use ember_gpu::kernels::KernelLibrary;
use ember_gpu::placement::{evaluate, observe, PlacementPolicy};
use ember_gpu::pool::{
    format_bytes, DevicePool, MemoryReport, PoolConfig, PoolSelectOptions, Purpose, TrimOutcome,
};

const MIB: u64 = 1 << 20;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("gpu_smoke: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let kernels_dir = std::env::args()
        .nth(1)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(ember_gpu::kernels::default_kernels_dir);
    let options = PoolSelectOptions::from_env(true, None);
    let listing = devices::list(&ListOptions {
        kernels_dir: Some(kernels_dir.clone()),
        pool: options.clone(),
        probe: true,
        ..ListOptions::default()
    });
    println!("{listing}");

    let driver: Arc<dyn Driver> = match CudaDriver::load() {
        Ok(driver) => Arc::new(driver),
        Err(cuda_error) => match HipDriver::load(&HipLoadOptions::default()) {
            Ok(driver) => Arc::new(driver),
            Err(hip_error) => return Err(format!("no GPU runtime: {cuda_error}; {hip_error}")),
        },
    };
    let device: DeviceOrdinal = 0;
    let info = driver.device_info(device).map_err(|e| e.to_string())?;
    println!(
        "using {} {} ({}, runtime {})",
        driver.backend(),
        info.name,
        info.arch,
        driver.runtime_info()
    );
    let library = KernelLibrary::new(kernels_dir);
    let touch = |d: &dyn Driver,
                 dev: DeviceOrdinal,
                 ptr: DevicePtr,
                 words: u64,
                 value: u32,
                 stream: StreamHandle|
     -> Result<(), DriverError> {
        library
            .fill_u32(d, dev, ptr, words, value, stream)
            .map_err(|e| DriverError::KernelFailed {
                name: "ember_fill_u32".to_string(),
                reason: e.to_string(),
            })
    };
    let config = PoolConfig {
        idle_after: Duration::from_millis(200),
        ..PoolConfig::default()
    };
    let free_start = driver.mem_info(device).map_err(|e| e.to_string())?.free;
    let pool = DevicePool::new(driver.clone(), device, &options, config, Some(&touch))
        .map_err(|e| e.to_string())?;
    println!("pool: {} ({})", pool.kind(), pool.reason());

    // "Weights": 2 GiB in 8 tensors, written by the kernel so the memory is really touched.
    let mut weights = Vec::new();
    for _ in 0..8 {
        let buffer = pool
            .alloc(Purpose::Weights, 256 * MIB)
            .map_err(|e| e.to_string())?;
        library
            .fill_u32(
                &*driver,
                device,
                buffer.ptr(),
                buffer.len() / 4,
                0x3f80_0000,
                StreamHandle::DEFAULT,
            )
            .map_err(|e| e.to_string())?;
        weights.push(buffer);
    }
    driver.synchronize(device).map_err(|e| e.to_string())?;
    pool.mark_loaded();
    let names: Vec<String> = (0..weights.len())
        .map(|i| format!("blk.{i}.ffn_up.weight"))
        .collect();
    let listed: Vec<(&str, DevicePtr, u64)> = weights
        .iter()
        .zip(&names)
        .map(|(b, n)| (n.as_str(), b.ptr(), b.len()))
        .collect();
    let observation = observe(&*driver, device, &listed, free_start).map_err(|e| e.to_string())?;
    match evaluate(&observation, &PlacementPolicy::default()) {
        Ok(verdict) => println!("placement: {verdict}"),
        Err(error) => println!("placement error: {error}"),
    }
    let free_loaded = driver.mem_info(device).map_err(|e| e.to_string())?.free;

    // A burst of varied scratch and KV allocations, touched by the kernel, then freed.
    let started = Instant::now();
    let mut burst = Vec::new();
    for i in 0..24u64 {
        let bytes = (i % 7 + 1) * 96 * MIB + i * 4096;
        let purpose = if i % 3 == 0 {
            Purpose::Kv
        } else {
            Purpose::Scratch
        };
        let buffer = pool.alloc(purpose, bytes).map_err(|e| e.to_string())?;
        library
            .fill_u32(
                &*driver,
                device,
                buffer.ptr(),
                buffer.len() / 4,
                i as u32,
                StreamHandle::DEFAULT,
            )
            .map_err(|e| e.to_string())?;
        burst.push(buffer);
        if i % 5 == 4 {
            burst.drain(..2);
        }
    }
    driver.synchronize(device).map_err(|e| e.to_string())?;
    let free_peak = driver.mem_info(device).map_err(|e| e.to_string())?.free;
    drop(burst);
    println!("burst of 24 allocations took {:?}", started.elapsed());

    // A request over the budget fails alone.
    let budget_pool = DevicePool::with_kind(
        driver.clone(),
        device,
        pool.kind(),
        "budget check".to_string(),
        PoolConfig {
            budget: Some(512 * MIB),
            ..PoolConfig::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let kept = budget_pool
        .alloc(Purpose::Kv, 400 * MIB)
        .map_err(|e| e.to_string())?;
    match budget_pool.alloc(Purpose::Scratch, 200 * MIB) {
        Err(error) => println!("over-budget request failed alone: {error}"),
        Ok(_) => return Err("an over-budget request succeeded".to_string()),
    }
    let small = budget_pool
        .alloc(Purpose::Scratch, 64 * MIB)
        .map_err(|e| e.to_string())?;
    drop((kept, small, budget_pool));

    let idle_start = Instant::now();
    let outcome = loop {
        match pool
            .trim_if_idle(Instant::now())
            .map_err(|e| e.to_string())?
        {
            TrimOutcome::NotIdle { remaining } => std::thread::sleep(remaining),
            other => break other,
        }
    };
    let free_idle = driver.mem_info(device).map_err(|e| e.to_string())?.free;
    println!("trim after {:?} idle: {outcome:?}", idle_start.elapsed());
    println!(
        "device free: start {}, loaded {}, peak {}, after idle {}",
        format_bytes(free_start),
        format_bytes(free_loaded),
        format_bytes(free_peak),
        format_bytes(free_idle)
    );
    let floor_used = free_start.saturating_sub(free_loaded);
    let idle_used = free_start.saturating_sub(free_idle);
    println!(
        "held after idle vs post-load floor: {} vs {} ({:+.2}%)",
        format_bytes(idle_used),
        format_bytes(floor_used),
        (idle_used as f64 - floor_used as f64) * 100.0 / floor_used.max(1) as f64
    );
    print!("{}", MemoryReport::from_pools(std::slice::from_ref(&pool)));
    if idle_used as f64 > floor_used as f64 * 1.05 {
        return Err("device memory did not return to within 5% of the post-load floor".to_string());
    }
    drop(weights);
    Ok(())
}
