//! The demo's workloads (filled in by the demo issue).
use cuda_stream_pool::driver::Choice;
use cuda_stream_pool::{Context, Result};

pub struct Options {
    pub driver: Choice,
    pub help: bool,
}

impl Options {
    pub fn parse(args: &[String]) -> std::result::Result<Options, String> {
        let mut o = Options {
            driver: Choice::Auto,
            help: false,
        };
        let mut it = args.iter();
        while let Some(a) = it.next() {
            match a.as_str() {
                "--driver" => {
                    o.driver = match it.next().map(|s| s.as_str()) {
                        Some("auto") => Choice::Auto,
                        Some("cuda") => Choice::Cuda,
                        Some("sim") => Choice::Sim,
                        other => {
                            return Err(format!("--driver takes auto, cuda or sim, not {other:?}"))
                        }
                    }
                }
                "-h" | "--help" => o.help = true,
                other => return Err(format!("unknown argument {other}")),
            }
        }
        Ok(o)
    }
}

pub fn run(_ctx: &Context, _opts: &Options) -> Result<()> {
    Ok(())
}
