//! Stress program: many short owners on 16 threads, buffers crossing owners and priorities, small
//! kernels; checks every result. Run under compute-sanitizer on the GPU:
//!
//!   compute-sanitizer --tool memcheck target/release/examples/stress 300
//!
//! The argument is the number of owners per thread (default 300). `--driver sim` runs it on the
//! simulation, whose misuse detector then checks the same things.

use cuda_stream_pool::driver::{self, Choice};
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{Context, DeviceBuffer, Priority};
use std::sync::Arc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let choice = if args.iter().any(|a| a == "sim") {
        Choice::Sim
    } else {
        Choice::Auto
    };
    let per_thread: u32 = args.iter().find_map(|a| a.parse().ok()).unwrap_or(300);
    let (d, _) = driver::load(choice)?;
    println!(
        "stress on the {} driver: 16 threads x {per_thread} owners",
        d.kind()
    );
    let ctx = Context::primary(d.clone(), 0)?;
    let kernels = Arc::new(Kernels::load(&ctx)?);
    let t0 = std::time::Instant::now();
    let threads: Vec<_> = (0..16u32)
        .map(|t| {
            let (ctx, k) = (ctx.clone(), kernels.clone());
            std::thread::spawn(move || -> cuda_stream_pool::Result<u64> {
                let mut carried: Option<DeviceBuffer<f32>> = None;
                let mut checked = 0;
                for i in 0..per_thread {
                    let owner = ctx.owner();
                    if (i + t) % 3 == 0 {
                        owner.set_priority(Priority::High)?;
                    }
                    let s = owner.stream()?;
                    let x = DeviceBuffer::<f32>::zeroed(&s, 1024)?;
                    k.add_one(&s, &x)?;
                    if let Some(prev) = carried.take() {
                        // Used on another owner's stream, maybe at another priority.
                        owner.with_priority(
                            Priority::Value(-2),
                            || -> cuda_stream_pool::Result<()> {
                                let s2 = owner.stream()?;
                                k.add_one(&s2, &prev)?;
                                let sum = DeviceBuffer::<f32>::zeroed(&s2, 1)?;
                                k.sum(&s2, &prev, &sum)?;
                                let v = sum.to_vec(&s2)?[0];
                                assert_eq!(v, 2048.0, "thread {t} owner {i}");
                                Ok(())
                            },
                        )??;
                        checked += 1;
                    }
                    if i % 2 == 0 {
                        carried = Some(x);
                    }
                }
                Ok(checked)
            })
        })
        .collect();
    let mut checked = 0;
    for h in threads {
        checked += h.join().expect("thread panicked")?;
    }
    ctx.synchronize()?;
    let st = ctx.stats();
    println!(
        "ok: {checked} cross-owner sums checked in {:.2} s; streams created {}, live {}, hits {}, misses {}, trimmed {}",
        t0.elapsed().as_secs_f64(),
        st.created,
        st.live,
        st.hits,
        st.misses,
        st.trimmed
    );
    Ok(())
}
