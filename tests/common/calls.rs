//! Helpers of the tests that read the simulation's call log: a simulated context, and call-log
//! formatting and queries. (A context behind the pausing driver: `pausing.rs`.)
#![allow(dead_code)]

use cuda_stream_pool::driver::sim::Call;
use cuda_stream_pool::driver::{SimDriver, Stream};
use cuda_stream_pool::Context;
use std::sync::Arc;

pub fn setup() -> (Arc<SimDriver>, Context) {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).expect("primary context");
    (sim, ctx)
}

pub fn fmt_calls(calls: &[Call]) -> String {
    calls
        .iter()
        .map(|c| {
            format!(
                "{}{}{}{}{}",
                c.name,
                c.stream
                    .map(|s| format!(" s={:#x}", s.0))
                    .unwrap_or_default(),
                c.event
                    .map(|e| format!(" e={:#x}", e.0))
                    .unwrap_or_default(),
                c.ptr.map(|p| format!(" p={:#x}", p.0)).unwrap_or_default(),
                if c.ok { "" } else { " FAILED" }
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The stream of the last successful `cuEventRecord` of `event` before index `before`.
pub fn recorded_on(
    calls: &[Call],
    event: cuda_stream_pool::driver::Event,
    before: usize,
) -> Option<Stream> {
    calls[..before]
        .iter()
        .rev()
        .find(|c| c.name == "cuEventRecord" && c.ok && c.event == Some(event))
        .and_then(|c| c.stream)
}
