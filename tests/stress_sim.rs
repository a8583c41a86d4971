//! Multi-threaded stress on the simulated driver: 16 threads, hundreds of thousands of driver
//! operations through owners, priorities and buffers, with the invariants checked at quiescent
//! points (every thread parked at a barrier) and at teardown.

use cuda_stream_pool::driver::{Driver, SimDriver};
use cuda_stream_pool::{Context, DeviceBuffer, Priority};
use std::collections::HashSet;
use std::sync::{Arc, Barrier, Mutex};

const THREADS: usize = 16;
const ROUNDS: usize = 10;
const PER_ROUND: u32 = 150;

#[test]
fn sixteen_threads_keep_the_invariants() {
    let sim = Arc::new(SimDriver::new());
    sim.set_logging(false);
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = Context::primary(d, 0).unwrap();
    let barrier = Arc::new(Barrier::new(THREADS + 1));
    // Streams each thread's live owner holds at the quiescent point.
    let held: Arc<Mutex<Vec<u64>>> = Arc::new(Mutex::new(Vec::new()));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (ctx, sim, barrier, held) =
                (ctx.clone(), sim.clone(), barrier.clone(), held.clone());
            std::thread::spawn(move || {
                let mut carried: Vec<DeviceBuffer<u32>> = Vec::new();
                let mut keeper = ctx.owner();
                for round in 0..ROUNDS {
                    for i in 0..PER_ROUND {
                        let o = ctx.owner();
                        let p = match (i as usize + t) % 4 {
                            0 => Priority::High,
                            1 => Priority::Value(-2),
                            _ => Priority::Normal,
                        };
                        o.set_priority(p).unwrap();
                        let s = o.stream().unwrap();
                        sim.enqueue_work(s.raw(), u64::from(i % 7) * 500).unwrap();
                        let mut b = DeviceBuffer::<u32>::zeroed(&s, 16).unwrap();
                        b.fill(&s, i).unwrap();
                        o.with_priority(Priority::High, || {
                            let hi = o.stream().unwrap();
                            drop(b.use_on(&hi).unwrap());
                        })
                        .unwrap();
                        if let Some(mut c) = carried.pop() {
                            c.fill(&s, i).unwrap();
                            if i % 25 == 0 {
                                assert_eq!(c.to_vec(&s).unwrap(), vec![i; 16]);
                            }
                        }
                        carried.push(b);
                        if carried.len() > 4 {
                            carried.remove(0);
                        }
                        if i % 10 == 0 {
                            sim.advance(1_000);
                        }
                    }
                    // Quiescent point: every thread holds exactly one owner with one stream.
                    keeper = ctx.owner();
                    let s = keeper.stream().unwrap();
                    held.lock().unwrap().push(s.raw().0);
                    barrier.wait(); // the checker runs
                    barrier.wait();
                    let _ = round;
                }
                drop(keeper);
            })
        })
        .collect();
    for _ in 0..ROUNDS {
        barrier.wait();
        {
            let mut h = held.lock().unwrap();
            let distinct: HashSet<_> = h.iter().collect();
            assert_eq!(distinct.len(), THREADS, "live owners share a stream");
            h.clear();
        }
        let st = ctx.stats();
        assert_eq!(
            st.live,
            st.in_use + st.idle + st.retired_busy + st.handed,
            "{st:?}"
        );
        assert_eq!(st.in_use, THREADS as u64, "{st:?}");
        assert_eq!(sim.counters().live_streams, st.live + 1, "{st:?}");
        assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
        barrier.wait();
    }
    for t in threads {
        t.join().unwrap();
    }
    let calls = sim.call_count();
    assert!(calls > 300_000, "only {calls} driver calls");
    drop(ctx);
    let c = sim.counters();
    assert_eq!(
        (c.live_streams, c.live_allocs, c.live_events),
        (0, 0, 0),
        "{c:?}"
    );
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}
