use cuda_stream_pool::{driver, Context};
use std::hint::black_box;
use std::sync::Barrier;
use std::time::Instant;
fn on_threads(n: usize, iters: u64, op: &(dyn Fn() + Sync)) -> f64 {
    let barrier = Barrier::new(n);
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..n).map(|_| sc.spawn(|| { barrier.wait(); let t = Instant::now(); for _ in 0..iters { op(); } t.elapsed() })).collect();
        hs.into_iter().map(|h| h.join().unwrap()).max().unwrap()
    }).as_nanos() as f64 / iters as f64
}
fn main() {
    let (d, _) = driver::load(driver::Choice::Sim).unwrap();
    let ctx = Context::primary(d.clone(), 0).unwrap();
    let op = || { let o = ctx.owner(); black_box(o.stream().unwrap()); };
    let which = std::env::args().nth(1).unwrap_or_default();
    let iters = 200_000;
    for round in 0..5 {
        let mut line = format!("round {round}:");
        for n in [1usize, 2] {
            if which.is_empty() || which == n.to_string() {
                line += &format!(" {n}thr {:.0} ns", on_threads(n, iters, &op));
            }
        }
        println!("{line}");
    }
    println!("{:?}", ctx.stats());
}
