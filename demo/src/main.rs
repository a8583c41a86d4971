//! `cuda-stream-pool`: shows which driver the crate runs on and runs the seed's workloads.
//!
//! The workspace member `cuda-stream-pool-demo` (not published); from the repository root:
//!
//! ```text
//! cargo run --release                     # real driver when present, else the simulation
//! cargo run --release -- --driver sim     # force the simulation (--driver cuda forces the GPU)
//! cargo run --release --features cudarc   # with the `cudarc` strategy
//! cargo run --release -- --devices 2      # threads over two GPUs, a row per device (issue 24)
//! ```

use cuda_stream_pool::driver::{self, Choice, DeviceAttr};
use demo::{note, out, DemoResult, Failure};
use std::process::ExitCode;

mod demo;
mod devices;

/// One line: the demo's errors never span lines (a driver's message may).
fn one_line(s: &str) -> String {
    s.split('\n')
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

fn main() -> ExitCode {
    let opts = match <demo::Options as clap::Parser>::try_parse() {
        Ok(o) => o,
        Err(e) => {
            use clap::error::ErrorKind;
            return match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
                    // A closed pipe (`--help | head -1`) loses the rest quietly.
                    let _ = e.print();
                    ExitCode::SUCCESS
                }
                _ => {
                    // clap's first line is "error: ..."; its usage and tips are left out.
                    let text = e.render().to_string();
                    let first = text.lines().next().unwrap_or("error: invalid arguments");
                    note(&format!("{first} (see --help)"));
                    ExitCode::from(2)
                }
            };
        }
    };
    let (drv, fallback) = match driver::load(opts.choice()) {
        Ok(x) => x,
        Err(e) => {
            note(&one_line(&format!(
                "error: cannot use the CUDA driver: {e}"
            )));
            return ExitCode::from(1);
        }
    };
    // The demo's simulation runs on a real-time clock with the H200's measured latencies; it has
    // --sim-devices devices (default: --devices).
    let drv: std::sync::Arc<dyn driver::Driver> = if drv.kind() == "sim" {
        match opts.sim_devices.unwrap_or(opts.devices) {
            1 => std::sync::Arc::new(driver::SimDriver::realtime()),
            n => std::sync::Arc::new(devices::sim_driver(n)),
        }
    } else if opts.sim_devices.is_some() {
        note("error: --sim-devices is for the simulated driver (--driver sim) (see --help)");
        return ExitCode::from(2);
    } else {
        drv
    };
    match run(drv, fallback, opts) {
        Ok(()) | Err(Failure::StdoutClosed) => ExitCode::SUCCESS,
        Err(e) => {
            note(&one_line(&format!("error: {e}")));
            ExitCode::from(1)
        }
    }
}

fn run(
    drv: std::sync::Arc<dyn driver::Driver>,
    fallback: Option<cuda_stream_pool::Error>,
    opts: demo::Options,
) -> DemoResult<()> {
    // With --json, stdout carries only the rows; the header goes to stderr.
    let say = |line: String| -> DemoResult<()> {
        if opts.json {
            note(&line);
            Ok(())
        } else {
            out(&line)
        }
    };
    let simulated = drv.kind() == "sim";
    if simulated {
        say("driver: simulated (no GPU used; latencies modelled on an H200)".into())?;
        if let Some(why) = &fallback {
            if opts.choice() == Choice::Auto {
                say(one_line(&format!(
                    "        (real driver unavailable: {why})"
                )))?;
            }
        }
    } else {
        say("driver: CUDA".into())?;
    }
    drv.init()?;
    if opts.devices > 1 {
        return devices::run(drv, &opts, &say);
    }
    let dev = drv.device_get(0)?;
    let version = drv.driver_version()?;
    let ctx = opts.mem_pool.context(drv.clone())?;
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
    ))?;
    demo::run(&ctx, &opts)
}
