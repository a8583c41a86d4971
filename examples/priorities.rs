//! A latency-sensitive owner beside a batch owner: priorities per owner, and a scoped priority
//! that restores the previous stream (ordered after the scope's work on the GPU).
//!
//!   cargo run --example priorities [-- sim]

use cuda_stream_pool::driver::{self, Choice};
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{Context, DeviceBuffer, Error, Priority};

pub fn main() -> Result<(), Box<dyn std::error::Error>> {
    let sim = std::env::args().any(|a| a == "sim");
    let (d, _) = driver::load(if sim { Choice::Sim } else { Choice::Auto })?;
    let ctx = Context::primary(d, 0)?;
    let k = Kernels::load(&ctx)?;
    let range = ctx.priority_range();
    println!(
        "priorities: {} (least) ..= {} (greatest)",
        range.least, range.greatest
    );

    let batch = ctx.owner();
    batch.set_priority(Priority::Low)?;
    let latency = ctx.owner();
    latency.set_priority(Priority::High)?;
    let (bs, ls) = (batch.stream()?, latency.stream()?);
    println!(
        "batch stream priority {}, latency stream priority {}",
        bs.priority(),
        ls.priority()
    );

    let big = DeviceBuffer::<f32>::zeroed(&bs, 1 << 22)?;
    for _ in 0..20 {
        k.add_one(&bs, &big)?; // lots of batch work
    }
    let small = DeviceBuffer::<f32>::zeroed(&ls, 1024)?;
    k.add_one(&ls, &small)?; // scheduled ahead of pending batch work where the GPU can
    assert_eq!(small.to_vec(&ls)?[0], 1.0);

    // A scoped switch: the batch owner runs one urgent step at high priority, then continues on
    // its low-priority stream, ordered after the urgent step.
    let r = batch.with_priority(Priority::High, || -> cuda_stream_pool::Result<()> {
        k.add_one(&batch.stream()?, &big)
    })?;
    r?;
    k.add_one(&bs, &big)?;
    let v = big.to_vec(&bs)?;
    assert!(
        v.iter().all(|&x| x == 22.0),
        "20 + 1 urgent + 1 steps, in order"
    );

    // Out of range: an error naming the range (the driver itself would clamp silently).
    match batch.set_priority(Priority::Value(range.greatest - 1)) {
        Err(Error::InvalidArgument(m)) => println!("rejected as expected: {m}"),
        other => panic!("{other:?}"),
    }
    println!("ok ({} driver)", ctx.driver().kind());
    Ok(())
}
