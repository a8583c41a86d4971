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

fn used(d: &Arc<dyn Driver>, pool: cuda_stream_pool::driver::MemPool) -> u64 {
    // SAFETY: the pools read here (the device's default pool, the live context's own pool) are
    // live for the call.
    unsafe { d.mem_pool_get_attribute(pool, MemPoolAttr::UsedMemCurrent) }.unwrap()
}

const FOUR_MIB: u64 = 4 << 20;

fn buffers_come_from_the_own_pool(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let default = d.device_default_mem_pool(ctx.device()).unwrap();
    assert_ne!(ctx.mem_pool(), default);
    let (own_before, default_before) = (used(d, ctx.mem_pool()), used(d, default));
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let b = DeviceBuffer::<u8>::zeroed(&s, FOUR_MIB as usize).unwrap();
    s.synchronize().unwrap();
    let (own, dflt) = (used(d, ctx.mem_pool()), used(d, default));
    assert!(
        own >= own_before + FOUR_MIB,
        "the crate's pool holds {own} bytes in use (before: {own_before}) with 4 MiB of buffers \
         alive"
    );
    assert!(
        dflt < default_before + FOUR_MIB,
        "the device's default pool grew from {default_before} to {dflt} bytes in use: the buffer \
         came from it, not from the crate's pool"
    );
    drop(b);
}

// Regression: issue 19 defect 17 (buffers came from the device's default pool, the crate's own
// pool stayed empty)
#[test]
fn buffers_are_allocated_from_the_crates_own_pool() {
    buffers_come_from_the_own_pool(&common::sim());
}

// Regression: issue 19 defect 17 (on the H200 the crate's pool reported 0 bytes in use with
// 4 MiB of buffers alive)
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn buffers_are_allocated_from_the_crates_own_pool_gpu() {
    let _g = common::gpu_lock();
    buffers_come_from_the_own_pool(&common::cuda());
}

fn device_default_choice_allocates_from_the_default_pool(d: &Arc<dyn Driver>) {
    let opts = ContextOptions::default().mem_pool(MemPoolChoice::DeviceDefault);
    let ctx = Context::primary_with(d.clone(), 0, opts).unwrap();
    let before = used(d, ctx.mem_pool());
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let b = DeviceBuffer::<u8>::zeroed(&s, FOUR_MIB as usize).unwrap();
    s.synchronize().unwrap();
    let now = used(d, ctx.mem_pool());
    assert!(
        now >= before + FOUR_MIB,
        "the default pool holds {now} bytes in use (before: {before}) with 4 MiB of buffers alive"
    );
    drop(b);
}

// Regression: issue 19 defect 17 (the default-pool choice still allocates from the default pool)
#[test]
fn device_default_choice_allocates_from_the_default_pool_sim() {
    device_default_choice_allocates_from_the_default_pool(&common::sim());
}

// Regression: issue 19 defect 17 (the same on the real driver)
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn device_default_choice_allocates_from_the_default_pool_gpu() {
    let _g = common::gpu_lock();
    device_default_choice_allocates_from_the_default_pool(&common::cuda());
}

// Regression: issue 19 defect 17 (the simulator counted every live allocation in every pool)
#[test]
fn sim_pools_count_only_their_own_allocations() {
    let d = common::sim();
    let env = common::Env::new(&d);
    let default = d.device_default_mem_pool(env.dev).unwrap();
    let mine = d.mem_pool_create(env.dev).unwrap();
    let s = env.stream();
    // SAFETY: a raw driver scenario: every handle is made here and used only while live.
    unsafe {
        let a = d.mem_alloc_async(1 << 20, s).unwrap();
        let b = d.mem_alloc_from_pool_async(3 << 20, mine, s).unwrap();
        d.stream_synchronize(s).unwrap();
        assert_eq!(used(&d, default), 1 << 20);
        assert_eq!(used(&d, mine), 3 << 20);
        let r = d.mem_pool_get_attribute(mine, MemPoolAttr::ReservedMemCurrent);
        assert!(r.unwrap() >= 3 << 20);
        d.mem_free_async(b, s).unwrap();
        d.stream_synchronize(s).unwrap();
        assert_eq!(used(&d, mine), 0);
        assert_eq!(used(&d, default), 1 << 20);
        d.mem_free_async(a, s).unwrap();
        d.stream_synchronize(s).unwrap();
        assert_eq!(used(&d, default), 0);
        d.stream_destroy(s).unwrap();
        d.mem_pool_destroy(mine).unwrap();
    }
}
