//! `cuStreamCreate` blocking behind a GPU-side wait, as observed on the H200: with one stream held
//! by `cuStreamWaitValue32` on host-mapped memory, creating the ~31st live stream blocked until
//! the wait was released, while streams created before and then destroyed were reused at once.
//! The simulation models it behind `SimConfig::create_stall_at`; the same scenario runs on both.
//!
//! The GPU test must be the first in its process to create that many streams (the driver reuses
//! the resources of destroyed streams), hence a test binary of its own with one scenario.

mod common;

use common::stall::{with_watchdog, HostWord, Trigger};
use common::Env;
use cuda_stream_pool::driver::{Driver, Stream};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Creates `n` streams on another thread while `w` is held by a wait; returns them, each with
/// whether its create returned only after the watchdog released the wait.
fn create_while_held(
    e: &Env,
    word: &HostWord,
    value: u32,
    trigger: &Trigger,
    n: usize,
) -> Vec<(Stream, bool)> {
    let (d, ctx) = (e.d.clone(), e.ctx);
    with_watchdog(word, value, trigger, move |released| {
        // SAFETY: the scenario's context, retained by `Env` until the scenario ends.
        unsafe { d.ctx_set_current(ctx) }.unwrap();
        (0..n)
            .map(|_| {
                let s = d
                    .stream_create(cuda_stream_pool::driver::stream_flags::NON_BLOCKING, 0)
                    .unwrap();
                (s, released.load(Ordering::Acquire))
            })
            .collect()
    })
}

/// Returns how many creates blocked behind the wait: with fresh streams, then with as many again
/// after destroying them.
fn blocked_creates(d: &Arc<dyn Driver>, trigger: &Trigger) -> (usize, usize) {
    const N: usize = 63;
    let e = Env::new(d);
    let word = HostWord::new(d);
    let w = e.stream();
    // SAFETY: `w` is live and not capturing; the word is set (by the watchdog) before `w` is
    // synchronized and destroyed, and before the word is dropped.
    unsafe { word.hold(w, 1) };
    let made = create_while_held(&e, &word, 1, trigger, N);
    let late: Vec<usize> = (0..N).filter(|&i| made[i].1).collect();
    eprintln!(
        "blocked creates: {} of {N}; the first at live stream #{}",
        late.len(),
        late.first().map_or(0, |i| i + 2)
    );
    // Every create after the first blocked one returned after the release too (they ran after
    // it on the same thread); none before it did.
    assert!(late.windows(2).all(|p| p[1] == p[0] + 1));
    // SAFETY: every stream is live; the wait was released.
    unsafe {
        d.stream_synchronize(w).unwrap();
        for (s, _) in &made {
            d.stream_destroy(*s).unwrap();
        }
        // The same number again, with `w` held again: the driver reuses what it had, none blocks.
        word.hold(w, 2);
    }
    let again = create_while_held(&e, &word, 2, trigger, N);
    // SAFETY: as above.
    unsafe {
        d.stream_synchronize(w).unwrap();
        for (s, _) in &again {
            d.stream_destroy(*s).unwrap();
        }
        d.stream_destroy(w).unwrap();
    }
    (late.len(), again.iter().filter(|(_, late)| *late).count())
}

/// Fresh streams block behind the wait; streams the driver had before do not.
fn create_blocks_behind_wait_value(d: &Arc<dyn Driver>, trigger: &Trigger) {
    let (fresh, reused) = blocked_creates(d, trigger);
    assert!(fresh > 0, "no create waited for the GPU-side wait");
    assert_eq!(
        reused, 0,
        "a create blocked although the driver had the resources"
    );
}

mod sim {
    use super::common::stall::Trigger;
    use cuda_stream_pool::driver::{Driver, SimConfig, SimDriver, H200_CREATE_STALL_AT};
    use std::sync::Arc;

    #[test]
    fn create_blocks_behind_wait_value() {
        let sim = Arc::new(SimDriver::with_config(SimConfig {
            create_stall_at: Some(H200_CREATE_STALL_AT),
            ..SimConfig::default()
        }));
        let d: Arc<dyn Driver> = sim.clone();
        super::create_blocks_behind_wait_value(&d, &Trigger::Sim(sim.clone()));
        assert_eq!(sim.counters().stalled_creates, 1);
        assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
    }

    /// Without the switch the simulation never blocks a create.
    #[test]
    fn no_stall_without_the_switch() {
        let sim = Arc::new(SimDriver::new());
        let d: Arc<dyn Driver> = sim.clone();
        assert_eq!(
            super::blocked_creates(&d, &Trigger::Sim(sim.clone())),
            (0, 0)
        );
        assert_eq!(sim.counters().stalled_creates, 0);
    }
}

mod gpu {
    use super::common::stall::Trigger;
    use std::time::Duration;

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn create_blocks_behind_wait_value() {
        let _serial = super::common::gpu_lock();
        super::create_blocks_behind_wait_value(
            &super::common::cuda(),
            &Trigger::After(Duration::from_secs(2)),
        );
    }
}
