//! The crate's memory pool: by default its own (`cuMemPoolCreate`), so the device's default pool
//! (which cudarc and other libraries use) keeps its configuration; destroyed with the state.
//! Scenarios on both drivers.

mod common;

use cuda_stream_pool::driver::{Driver, MemPoolAttr, SimDriver};
use cuda_stream_pool::{Context, ContextOptions, DeviceBuffer, MemPoolChoice};
use std::sync::Arc;

fn default_pool_threshold(d: &Arc<dyn Driver>) -> u64 {
    d.init().unwrap();
    let dev = d.device_get(0).unwrap();
    let pool = d.device_default_mem_pool(dev).unwrap();
    // SAFETY: the device's default pool lives as long as the device.
    unsafe { d.mem_pool_get_attribute(pool, MemPoolAttr::ReleaseThreshold) }.unwrap()
}

fn leaves_the_default_pool_alone(d: &Arc<dyn Driver>) {
    let before = default_pool_threshold(d);
    let ctx = common::ctx(d);
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let b = DeviceBuffer::<u32>::zeroed(&s, 1 << 16).unwrap();
    assert_eq!(b.to_vec(&s).unwrap()[0], 0);
    assert_ne!(
        ctx.mem_pool(),
        d.device_default_mem_pool(ctx.device()).unwrap(),
        "buffers come from the crate's own pool"
    );
    // SAFETY: the crate's pool lives as long as `ctx`.
    let own = unsafe { d.mem_pool_get_attribute(ctx.mem_pool(), MemPoolAttr::ReleaseThreshold) };
    assert_eq!(
        own.unwrap(),
        u64::MAX,
        "the crate's pool keeps freed memory cached"
    );
    assert_eq!(
        default_pool_threshold(d),
        before,
        "the default pool was changed"
    );
    drop(b);
    drop(s);
    drop(o);
    drop(ctx);
    assert_eq!(default_pool_threshold(d), before);
}

#[test]
fn own_pool_leaves_the_default_pool_alone() {
    leaves_the_default_pool_alone(&common::sim());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn own_pool_leaves_the_default_pool_alone_gpu() {
    let _g = common::gpu_lock();
    leaves_the_default_pool_alone(&common::cuda());
}

fn device_default_is_used_as_is(d: &Arc<dyn Driver>) {
    let before = default_pool_threshold(d);
    let opts = ContextOptions::default().mem_pool(MemPoolChoice::DeviceDefault);
    let ctx = Context::primary_with(d.clone(), 0, opts).unwrap();
    assert_eq!(
        ctx.mem_pool(),
        d.device_default_mem_pool(ctx.device()).unwrap()
    );
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let b = DeviceBuffer::<f32>::zeroed(&s, 4096).unwrap();
    assert_eq!(b.to_vec(&s).unwrap(), vec![0.0; 4096]);
    assert_eq!(default_pool_threshold(d), before);
}

#[test]
fn device_default_pool_is_used_as_configured() {
    device_default_is_used_as_is(&common::sim());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn device_default_pool_is_used_as_configured_gpu() {
    let _g = common::gpu_lock();
    device_default_is_used_as_is(&common::cuda());
}

#[test]
fn own_pool_is_destroyed_with_the_state_once() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = common::ctx(&d);
    let pool = ctx.mem_pool();
    {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let _b = DeviceBuffer::<u8>::zeroed(&s, 100).unwrap();
    }
    drop(ctx);
    // SAFETY: querying a destroyed pool handle on the simulation, which reports it as invalid.
    assert!(unsafe { d.mem_pool_get_attribute(pool, MemPoolAttr::ReleaseThreshold) }.is_err());
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

#[test]
fn own_pool_threshold_is_an_option() {
    let d = common::sim();
    let opts = ContextOptions::default().mem_pool(MemPoolChoice::Own {
        release_threshold: 1 << 20,
    });
    let ctx = Context::primary_with(d.clone(), 0, opts).unwrap();
    // SAFETY: the crate's pool lives as long as `ctx`.
    let t = unsafe { d.mem_pool_get_attribute(ctx.mem_pool(), MemPoolAttr::ReleaseThreshold) };
    assert_eq!(t.unwrap(), 1 << 20);
}
