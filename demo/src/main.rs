//! `cuda-stream-pool`: shows which driver the crate runs on and runs the seed's workloads.
//!
//! The workspace member `cuda-stream-pool-demo` (not published); from the repository root:
//!
//! ```text
//! cargo run --release                     # real driver when present, else the simulation
//! cargo run --release -- --driver sim     # force the simulation (--driver cuda forces the GPU)
//! cargo run --release --features cudarc   # with the `cudarc` strategy
//! ```

use cuda_stream_pool::driver::{self, Choice, DeviceAttr};
use cuda_stream_pool::Context;
use std::process::ExitCode;

mod demo;

fn main() -> ExitCode {
    let opts = <demo::Options as clap::Parser>::parse();
    let (drv, fallback) = match driver::load(opts.choice()) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("error: cannot use the CUDA driver: {e}");
            return ExitCode::from(1);
        }
    };
    // The demo's simulation runs on a real-time clock with the H200's measured latencies.
    let drv: std::sync::Arc<dyn driver::Driver> = if drv.kind() == "sim" {
        std::sync::Arc::new(driver::SimDriver::realtime())
    } else {
        drv
    };
    match run(drv, fallback, opts) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

fn run(
    drv: std::sync::Arc<dyn driver::Driver>,
    fallback: Option<cuda_stream_pool::Error>,
    opts: demo::Options,
) -> cuda_stream_pool::Result<()> {
    // With --json, stdout carries only the rows; the header goes to stderr.
    let say = |line: String| {
        if opts.json {
            eprintln!("{line}")
        } else {
            println!("{line}")
        }
    };
    let simulated = drv.kind() == "sim";
    if simulated {
        say("driver: simulated (no GPU used; latencies modelled on an H200)".into());
        if let Some(why) = &fallback {
            if opts.choice() == Choice::Auto {
                say(format!("        (real driver unavailable: {why})"));
            }
        }
    } else {
        say("driver: CUDA".into());
    }
    drv.init()?;
    let dev = drv.device_get(0)?;
    let version = drv.driver_version()?;
    let ctx = Context::primary(drv.clone(), 0)?;
    let range = ctx.priority_range();
    say(format!(
        "device: {} (compute {}.{}, {} SMs), CUDA driver {}.{}, stream priorities {} (least) ..= {} (greatest)",
        drv.device_name(dev)?,
        drv.device_attribute(dev, DeviceAttr::ComputeCapabilityMajor)?,
        drv.device_attribute(dev, DeviceAttr::ComputeCapabilityMinor)?,
        drv.device_attribute(dev, DeviceAttr::MultiprocessorCount)?,
        version / 1000,
        (version % 1000) / 10,
        range.least,
        range.greatest
    ));
    demo::run(&ctx, &opts)
}
