//! `Context::reserve` against the H200's stall: with one owner's stream held by a GPU-side wait
//! (`cuStreamWaitValue32` on host-mapped memory), acquisitions that have to create streams block
//! in `cuStreamCreate` once ~30 streams are alive, until the wait is released; with the streams
//! reserved up front, no acquisition creates and none blocks. On both drivers (the simulation's
//! `SimConfig::create_stall_at`); the watchdog releases the wait when a create is blocked (the
//! simulation's state) or after 2 s (the GPU).
//!
//! The GPU test must be the first in its process to create that many streams (the driver reuses
//! the resources of destroyed streams), hence a test binary of its own with one GPU test that
//! runs the scenario without the reserve first.

mod common;

use common::stall::{with_watchdog, HostWord, Trigger};
use cuda_stream_pool::driver::Driver;
use cuda_stream_pool::{Context, Priority};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Owners acquiring while another owner's stream is held by a GPU-side wait.
const OWNERS: usize = 62;

/// Returns how many of the acquisitions returned only after the wait was released, and how many
/// streams they created.
fn acquisitions_blocked(d: &Arc<dyn Driver>, trigger: &Trigger, reserve: bool) -> (usize, u64) {
    let ctx = Context::primary(d.clone(), 0).unwrap();
    if reserve {
        // The waiting owner's stream and every acquisition's, before anything waits.
        assert_eq!(
            ctx.reserve(Priority::Normal, OWNERS + 1).unwrap(),
            OWNERS + 1
        );
    }
    // The raw driver allocates in the current context: the crate leaves none current.
    ctx.bind().unwrap();
    let word = HostWord::new(d);
    let holder = ctx.owner();
    let s = holder.stream().unwrap();
    // SAFETY: the holder's stream is live and not capturing while `s` lives; the watchdog sets
    // the word before the stream is synchronized below, and the word outlives that.
    unsafe { word.hold(s.raw(), 1) };
    let before = ctx.stats().created;
    let c = ctx.clone();
    let late = with_watchdog(&word, 1, trigger, move |released| {
        let owners: Vec<_> = (0..OWNERS).map(|_| c.owner()).collect();
        let late = owners
            .iter()
            .filter(|o| {
                o.stream().unwrap();
                released.load(Ordering::Acquire)
            })
            .count();
        drop(owners);
        late
    });
    s.synchronize().unwrap();
    let created = ctx.stats().created - before;
    drop(s);
    drop(holder);
    drop(word);
    (late, created)
}

fn reserve_avoids_the_create_stall(d: &Arc<dyn Driver>, trigger: &Trigger) {
    let (late, created) = acquisitions_blocked(d, trigger, false);
    eprintln!("without reserve: {late} of {OWNERS} acquisitions returned after the release");
    assert!(
        late > 0,
        "no acquisition blocked behind the wait ({created} created)"
    );
    let (late, created) = acquisitions_blocked(d, trigger, true);
    eprintln!("with reserve: {late} of {OWNERS}, {created} streams created");
    assert_eq!((late, created), (0, 0));
}

mod sim {
    use super::common::stall::Trigger;
    use cuda_stream_pool::driver::{Driver, SimConfig, SimDriver, H200_CREATE_STALL_AT};
    use std::sync::Arc;

    #[test]
    fn reserve_avoids_the_create_stall() {
        let sim = Arc::new(SimDriver::with_config(SimConfig {
            create_stall_at: Some(H200_CREATE_STALL_AT),
            ..SimConfig::default()
        }));
        let d: Arc<dyn Driver> = sim.clone();
        super::reserve_avoids_the_create_stall(&d, &Trigger::Sim(sim.clone()));
        assert_eq!(sim.counters().stalled_creates, 1);
        assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
    }
}

mod gpu {
    use super::common::stall::Trigger;
    use std::time::Duration;

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn reserve_avoids_the_create_stall() {
        let _serial = super::common::gpu_lock();
        super::reserve_avoids_the_create_stall(
            &super::common::cuda(),
            &Trigger::After(Duration::from_secs(2)),
        );
    }
}
