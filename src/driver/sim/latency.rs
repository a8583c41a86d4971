//! CPU costs of driver calls and GPU durations of operations (the demo's real-time model):
//! the figures measured on an H200 (docs/gpu.md), spent by spinning so that strategies that make
//! more or costlier driver calls are slower, as on the GPU.

use super::*;

/// CPU costs of driver calls and GPU durations of operations, in nanoseconds. The defaults are
/// the H200 figures recorded in docs/gpu.md; GPU durations are for the demo's small kernels and copies.
#[derive(Clone, Debug)]
pub struct Latency {
    /// `cuStreamCreate`.
    pub stream_create: u64,
    /// `cuStreamDestroy`.
    pub stream_destroy: u64,
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
            stream_create: 39_000,
            stream_destroy: 5_000,
            query: 600,
            event: 1_000,
            launch: 2_500,
            alloc: 1_000,
            alloc_per_stream: 25,
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

    pub(super) fn cost(&self, pick: impl FnOnce(&Latency) -> u64) {
        if let Some(l) = self.lat() {
            spin(pick(l));
        }
    }
}
