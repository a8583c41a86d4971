//! Stress program: many short owners on 16 threads; buffers used by several threads at once,
//! carried across owners and priorities, used in captured graphs launched on other owners'
//! streams; owners handed from one thread to another; every result checked. Run under
//! compute-sanitizer on the GPU:
//!
//!   compute-sanitizer --tool memcheck target/release/examples/stress 300
//!
//! The argument is the number of owners per thread (default 300). `sim` runs it on the
//! simulation, whose race and use-after-free detector then checks the same things.

use cuda_stream_pool::driver::{self, Choice, SimDriver};
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{Context, DeviceBuffer, Owner, Priority};
use std::sync::mpsc;
use std::sync::Arc;

const THREADS: u32 = 16;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let per_thread: u32 = args.iter().find_map(|a| a.parse().ok()).unwrap_or(300);
    let sim = args
        .iter()
        .any(|a| a == "sim")
        .then(|| Arc::new(SimDriver::new()));
    let d: Arc<dyn driver::Driver> = match &sim {
        Some(s) => s.clone(),
        None => driver::load(Choice::Auto)?.0,
    };
    println!(
        "stress on the {} driver: {THREADS} threads x {per_thread} owners",
        d.kind()
    );
    let ctx = Context::primary(d.clone(), 0)?;
    let kernels = Arc::new(Kernels::load(&ctx)?);
    // One buffer that every thread adds to, at the same time, each on its own streams.
    let shared = {
        let o = ctx.owner();
        Arc::new(DeviceBuffer::<f32>::zeroed(&o.stream()?, 1024)?)
    };
    // Owners made on one thread and used and dropped on the next one.
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..THREADS).map(|_| mpsc::channel::<Owner>()).unzip();
    let mut rxs: Vec<Option<mpsc::Receiver<Owner>>> = rxs.into_iter().map(Some).collect();
    let t0 = std::time::Instant::now();
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (ctx, k, shared) = (ctx.clone(), kernels.clone(), shared.clone());
            let to_next = txs[((t + 1) % THREADS) as usize].clone();
            let from_prev = rxs[t as usize].take().expect("one receiver per thread");
            std::thread::spawn(move || -> cuda_stream_pool::Result<(u64, u64)> {
                let mut carried: Option<DeviceBuffer<f32>> = None;
                let (mut checked, mut shared_adds) = (0, 0);
                for i in 0..per_thread {
                    let owner = ctx.owner();
                    if (i + t) % 3 == 0 {
                        owner.set_priority(Priority::High)?;
                    }
                    let s = owner.stream()?;
                    let x = DeviceBuffer::<f32>::zeroed(&s, 1024)?;
                    k.add_one(&s, &x)?;
                    if i % 4 == t % 4 {
                        k.add_one(&s, &shared)?;
                        shared_adds += 1;
                    }
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
                    if i % 8 == 7 {
                        // A graph captured on a capture owner's stream, launched twice on another
                        // owner's stream, then the buffer is dropped before the graph. (Not on
                        // `s`: a buffer whose last use is on a stream that has begun a capture
                        // cannot be used elsewhere until the capture ends, and `s` has just used
                        // the shared buffer.)
                        let cap = ctx.owner();
                        let sc = cap.stream()?;
                        let y = DeviceBuffer::<f32>::zeroed(&sc, 256)?;
                        let g = sc.begin_capture()?;
                        k.add_one(&sc, &y)?;
                        let exec = g.end()?.instantiate()?;
                        let other = ctx.owner();
                        let so = other.stream()?;
                        exec.launch(&so)?;
                        exec.launch(&so)?;
                        let v = y.to_vec(&s)?;
                        assert!(v.iter().all(|&e| e == 2.0), "thread {t} graph {i}");
                        drop(y);
                        exec.launch(&so)?; // the graph keeps the buffer alive
                    }
                    if i % 2 == 0 {
                        carried = Some(x);
                    }
                    if i % 16 == 5 {
                        let handed = ctx.owner();
                        handed.stream()?;
                        let _ = to_next.send(handed);
                    }
                    while let Ok(o) = from_prev.try_recv() {
                        let so = o.stream()?;
                        k.add_one(&so, &shared)?;
                        shared_adds += 1;
                    }
                }
                Ok((checked, shared_adds))
            })
        })
        .collect();
    drop(txs);
    let (mut checked, mut adds) = (0, 0);
    for h in threads {
        let (c, a) = h.join().expect("thread panicked")?;
        checked += c;
        adds += a;
    }
    let o = ctx.owner();
    let v = shared.to_vec(&o.stream()?)?;
    assert!(
        v.iter().all(|&e| e == adds as f32),
        "the shared buffer saw {} of {adds} concurrent adds",
        v[0]
    );
    drop(o);
    ctx.synchronize()?;
    let st = ctx.stats();
    println!(
        "ok: {checked} cross-owner sums and {adds} concurrent adds to one buffer checked in {:.2} s; \
         streams created {}, live {}, hits {}, misses {}, trimmed {}",
        t0.elapsed().as_secs_f64(),
        st.created,
        st.live,
        st.hits,
        st.misses,
        st.trimmed
    );
    if let Some(sim) = sim {
        let m = sim.misuse();
        if !m.is_empty() {
            return Err(format!("the simulation found misuse: {m:?}").into());
        }
        println!("simulation: no race, no use after free, no misuse");
    }
    Ok(())
}
