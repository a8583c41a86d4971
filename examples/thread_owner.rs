//! Every thread has an implicit owner per context: `ctx.stream()` is the thread's own stream,
//! taken from the pool on first use and given back when the thread exits.
//!
//!   cargo run --example thread_owner [-- sim]

use cuda_stream_pool::driver::{self, Choice};
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{Context, DeviceBuffer};
use std::sync::Arc;

pub fn main() -> Result<(), Box<dyn std::error::Error>> {
    let sim = std::env::args().any(|a| a == "sim");
    let (d, _) = driver::load(if sim { Choice::Sim } else { Choice::Auto })?;
    let ctx = Context::primary(d, 0)?;
    let k = Arc::new(Kernels::load(&ctx)?);
    for round in 0..3 {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let (ctx, k) = (ctx.clone(), k.clone());
                std::thread::spawn(move || -> cuda_stream_pool::Result<f32> {
                    let s = ctx.stream()?; // this thread's stream
                    let x = DeviceBuffer::<f32>::zeroed(&s, 4096)?;
                    let sum = DeviceBuffer::<f32>::zeroed(&s, 1)?;
                    k.add_one(&s, &x)?;
                    k.sum(&s, &x, &sum)?;
                    Ok(sum.to_vec(&s)?[0])
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().expect("thread panicked")?, 4096.0);
        }
        let st = ctx.stats();
        println!(
            "round {round}: 8 threads done; streams created so far {}, live {}, idle {}",
            st.created, st.live, st.idle
        );
    }
    // 24 short-lived threads, at most 8 at a time: at most 8 streams.
    assert!(ctx.stats().created <= 8);
    println!("ok ({} driver)", ctx.driver().kind());
    Ok(())
}
