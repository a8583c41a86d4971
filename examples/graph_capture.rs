//! Graph capture with guards: a nested begin fails without disturbing the outer capture, an
//! early return ends the capture cleanly, and the graph is launched many times.
//!
//!   cargo run --example graph_capture [-- sim]

use cuda_stream_pool::driver::{self, Choice};
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{Context, DeviceBuffer, Result, StreamRef};

fn build(k: &Kernels, s: &StreamRef, x: &DeviceBuffer<u32>) -> Result<cuda_stream_pool::Graph> {
    let guard = s.begin_capture()?;
    // A library deeper down tries to capture too: it gets the driver's error ...
    let nested = s.begin_capture();
    println!(
        "nested begin: {}",
        nested.err().map(|e| e.to_string()).unwrap_or_default()
    );
    // ... and the outer capture goes on.
    k.add_u32(s, x, 1)?;
    k.add_u32(s, x, 2)?;
    guard.end()
}

fn early_return(s: &StreamRef) -> Result<()> {
    let _guard = s.begin_capture()?;
    Err(cuda_stream_pool::Error::InvalidArgument(
        "something went wrong mid-capture".into(),
    ))
}

pub fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let sim = std::env::args().any(|a| a == "sim");
    let (d, _) = driver::load(if sim { Choice::Sim } else { Choice::Auto })?;
    let ctx = Context::primary(d, 0)?;
    let k = Kernels::load(&ctx)?;
    let owner = ctx.owner();
    let s = owner.stream()?;
    let x = DeviceBuffer::<u32>::zeroed(&s, 1 << 16)?;
    let graph = build(&k, &s, &x)?;
    println!("captured {} nodes", graph.node_count()?);
    let exec = graph.instantiate()?;
    for _ in 0..100 {
        exec.launch(&s)?;
    }
    assert_eq!(x.to_vec(&s)?[0], 300);
    assert!(early_return(&s).is_err());
    assert!(!s.is_capturing()?, "the dropped guard ended the capture");
    println!(
        "ok: 100 launches, stream usable after an aborted capture ({} driver)",
        ctx.driver().kind()
    );
    Ok(())
}
