//! Explicit owners in a worker pool (crossbeam-channel): each job is its own owner, so concurrent
//! jobs never share a stream, and a finished job's stream serves the next job once its work has
//! completed.
//!
//!   cargo run --example thread_pool [-- sim]

use cuda_stream_pool::driver::{self, Choice};
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{Context, DeviceBuffer};
use std::sync::Arc;

pub fn main() -> Result<(), Box<dyn std::error::Error>> {
    let sim = std::env::args().any(|a| a == "sim");
    let (d, _) = driver::load(if sim { Choice::Sim } else { Choice::Auto })?;
    let ctx = Context::primary(d, 0)?;
    let k = Arc::new(Kernels::load(&ctx)?);
    let (jobs, rx) = crossbeam_channel::unbounded::<usize>();
    let (done_tx, done) = crossbeam_channel::unbounded();
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let (ctx, k, rx, done_tx) = (ctx.clone(), k.clone(), rx.clone(), done_tx.clone());
            std::thread::spawn(move || {
                for job in rx.iter() {
                    let r = (|| -> cuda_stream_pool::Result<f32> {
                        let owner = ctx.owner(); // one owner per job
                        let s = owner.stream()?;
                        let x = DeviceBuffer::<f32>::zeroed(&s, 256 * (job % 4 + 1))?;
                        let sum = DeviceBuffer::<f32>::zeroed(&s, 1)?;
                        k.add_one(&s, &x)?;
                        k.sum(&s, &x, &sum)?;
                        Ok(sum.to_vec(&s)?[0])
                    })();
                    if done_tx.send((job, r)).is_err() {
                        return;
                    }
                }
            })
        })
        .collect();
    drop(done_tx);
    for j in 0..1000 {
        jobs.send(j)?;
    }
    drop(jobs);
    for (job, r) in done.iter() {
        assert_eq!(r?, (256 * (job % 4 + 1)) as f32);
    }
    for w in workers {
        w.join().unwrap();
    }
    let st = ctx.stats();
    println!(
        "1000 jobs on 4 workers: {} streams created, {} hand-overs ({} driver)",
        st.created,
        st.hits,
        ctx.driver().kind()
    );
    assert!(st.created <= 8);
    Ok(())
}
