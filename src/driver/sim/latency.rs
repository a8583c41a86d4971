//! CPU costs of driver calls and GPU durations of operations (the demo's real-time model),
//! calibrated to the H200 measurements recorded in `docs/data/` and listed, with where each
//! number comes from, in `docs/data/h200-latency.json` (`tests/sim_latency.rs` fails when the
//! model drifts more than 25% from that file). Costs are spent by spinning, so that strategies
//! that make more or costlier driver calls are slower, as on the GPU.

use super::*;

/// CPU costs of driver calls and GPU durations of operations, in nanoseconds, for the demo's
/// real-time simulation ([`SimDriver::realtime`]).
///
/// The defaults are the H200's (driver 580.159.04, CUDA 13.0), from the repository's recorded
/// benchmarks (`docs/data/h200-latency.json` says which run each comes from):
///
/// | figure | H200 (median of runs) | model |
/// | --- | --- | --- |
/// | `cuStreamCreate` + `cuStreamDestroy` of an idle stream | 5.66 µs (5.03–6.07) | `stream_create + stream_destroy` |
/// | `cuStreamQuery` of an idle stream, one thread | 0.21 µs (0.17–0.26) | `query` |
/// | `cuMemAllocAsync` + `cuMemFreeAsync`, 4 KiB | 0.85 µs (0.67–1.29) | `2 * alloc` |
/// | `cuThreadExchangeStreamCaptureMode` | ~0.09 µs | `capture_mode_exchange` |
/// | a new stream per task instead of one per thread (demo `short`, 1 thread, `fresh` − `floor`) | 19.5 µs (16.6–50.4) | `stream_create + stream_destroy + stream_first_pool_use` |
///
/// Launch, event, GPU and wake-up figures were not measured one by one; they are set so that the
/// demo's one-thread rows come out near the H200's (the data file lists those rows too). Calls
/// from several threads run concurrently here, while the real driver serialises them, so the
/// simulation's multi-thread timings are not the H200's (the demo prints only one-thread rows on
/// the simulation).
#[derive(Clone, Debug)]
pub struct Latency {
    /// `cuStreamCreate`.
    pub stream_create: u64,
    /// `cuStreamDestroy`.
    pub stream_destroy: u64,
    /// The first `cuMemAllocAsync` on a stream (a new stream's first use of the memory pool):
    /// what a new stream per task costs beyond its create and destroy.
    pub stream_first_pool_use: u64,
    /// `cuStreamQuery` / `cuEventQuery`.
    pub query: u64,
    /// `cuEventRecord`, `cuStreamWaitEvent`, `cuEventCreate`.
    pub event: u64,
    /// Enqueueing a kernel, copy, memset or host function.
    pub launch: u64,
    /// `cuMemAllocAsync` / `cuMemFreeAsync`, plus `alloc_per_stream` for every live stream that
    /// has used the memory pool (the allocator slows down with every such stream).
    pub alloc: u64,
    /// See `alloc`.
    pub alloc_per_stream: u64,
    /// `cuThreadExchangeStreamCaptureMode` (the crate's switches to relaxed mode).
    pub capture_mode_exchange: u64,
    /// GPU time of a small kernel.
    pub kernel_gpu: u64,
    /// GPU time of a small copy or memset.
    pub copy_gpu: u64,
    /// Wake-up latency of a synchronizing call.
    pub sync: u64,
}

impl Default for Latency {
    fn default() -> Self {
        Latency {
            stream_create: 3_500,
            stream_destroy: 2_150,
            stream_first_pool_use: 13_900,
            query: 205,
            event: 1_000,
            launch: 2_500,
            alloc: 425,
            alloc_per_stream: 25,
            capture_mode_exchange: 90,
            kernel_gpu: 3_000,
            copy_gpu: 2_000,
            sync: 5_000,
        }
    }
}

pub(super) fn spin(ns: u64) {
    if ns == 0 {
        return;
    }
    let until = Instant::now() + Duration::from_nanos(ns);
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

impl SimDriver {
    pub(super) fn lat(&self) -> Option<&Latency> {
        self.cfg.latency.as_ref()
    }

    /// Gives every later host-to-device and device-to-host copy `ns` of GPU time under the
    /// manual clock (without a latency model: [`SimConfig::latency`] `None`); 0, the default,
    /// completes a copy as soon as it starts. With the real-time clock, [`Latency::copy_gpu`]
    /// decides. (A test that must tell a copy's end from the work enqueued just before it sets
    /// this: with 0 ns both complete in the same step of the simulation.)
    ///
    /// ```
    /// # use cuda_stream_pool::driver::{self, Driver, SimDriver};
    /// # use cuda_stream_pool::{Context, DeviceBuffer};
    /// # use std::sync::Arc;
    /// let sim = Arc::new(SimDriver::new());
    /// sim.set_copy_time(1_000);
    /// let drv: Arc<dyn Driver> = sim.clone();
    /// let ctx = Context::primary(drv, 0).unwrap();
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// let b = DeviceBuffer::<u32>::zeroed(&s, 4).unwrap();
    /// let t = sim.now();
    /// assert_eq!(b.to_vec(&s).unwrap(), vec![0; 4]);
    /// assert!(sim.now() >= t + 1_000);
    /// ```
    pub fn set_copy_time(&self, ns: u64) {
        self.copy_ns.store(ns, Ordering::Relaxed);
    }

    /// The GPU time of a copy: the latency model's, else [`SimDriver::set_copy_time`]'s.
    pub(super) fn copy_time(&self) -> u64 {
        self.lat()
            .map_or_else(|| self.copy_ns.load(Ordering::Relaxed), |l| l.copy_gpu)
    }

    /// Gives every later `cuMemFreeAsync` `ns` of GPU time under the manual clock; 0, the
    /// default, completes a free as soon as it starts. Opt-in, for tests that need a free still
    /// pending on an otherwise idle stream (as on a real GPU, where a free is stream work).
    ///
    /// ```
    /// # use cuda_stream_pool::driver::{Driver, SimDriver};
    /// # use cuda_stream_pool::{Context, DeviceBuffer};
    /// # use std::sync::Arc;
    /// let sim = Arc::new(SimDriver::new());
    /// sim.set_free_time(1_000);
    /// let drv: Arc<dyn Driver> = sim.clone();
    /// let ctx = Context::primary(drv, 0).unwrap();
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// let b = DeviceBuffer::<u32>::zeroed(&s, 4).unwrap();
    /// s.synchronize().unwrap();
    /// drop(b);
    /// assert!(sim.is_busy(s.raw()) && !sim.is_busy_but_frees(s.raw()));
    /// sim.advance(1_000);
    /// assert!(!sim.is_busy(s.raw()));
    /// ```
    pub fn set_free_time(&self, ns: u64) {
        self.free_ns.store(ns, Ordering::Relaxed);
    }

    pub(super) fn cost(&self, pick: impl FnOnce(&Latency) -> u64) {
        if let Some(l) = self.lat() {
            spin(pick(l));
        }
    }
}
