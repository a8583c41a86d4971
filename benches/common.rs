//! Shared by the benchmarks: the driver (CSP_BENCH_DRIVER=cuda|sim|auto, default auto; the
//! simulation runs with the H200's latency model) and criterion's settings.
#![allow(dead_code)]

use cuda_stream_pool::driver::{self, Choice, Driver, SimDriver};
use std::sync::Arc;
use std::time::Duration;

pub fn driver() -> Arc<dyn Driver> {
    let choice = match std::env::var("CSP_BENCH_DRIVER").as_deref() {
        Ok("cuda") => Choice::Cuda,
        Ok("sim") => Choice::Sim,
        _ => Choice::Auto,
    };
    let (d, _) = driver::load(choice).expect("driver");
    let d: Arc<dyn Driver> = if d.kind() == "sim" {
        Arc::new(SimDriver::realtime())
    } else {
        d
    };
    eprintln!("benchmarks on the {} driver", d.kind());
    d
}

pub fn config() -> criterion::Criterion {
    criterion::Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
}
