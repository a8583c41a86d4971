//! `SimDriver::end_host_thread` (which the model calls on simulations it leaves behind): a host
//! function may call it without waiting for itself, and host functions still run one at a time,
//! in order, across an ended thread and the one started after it. (Review 20 found both broken
//! in its first version: a host function of the ended thread that called it joined the new
//! thread, which waited for that host function, a deadlock; and the new thread ran host
//! functions beside the ended one's last.)

use cuda_stream_pool::driver::SimDriver;
use cuda_stream_pool::Context;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};

/// A host function ends its own thread: the call returns (it does not wait for the thread it
/// runs on) and reports a thread ended, and later host functions run on a new thread.
#[test]
fn a_host_function_ends_its_own_thread_without_waiting_for_itself() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let owner = ctx.owner();
    let s = owner.stream().unwrap();
    let ended = Arc::new(AtomicBool::new(false));
    let (sim2, ended2) = (sim.clone(), ended.clone());
    s.launch_host_func(move || ended2.store(sim2.end_host_thread(), Ordering::SeqCst))
        .unwrap();
    s.synchronize().unwrap();
    assert!(
        ended.load(Ordering::SeqCst),
        "the host function's call ended its thread"
    );
    s.launch_host_func(|| {}).unwrap();
    s.synchronize().unwrap();
    assert_eq!(sim.host_fn_progress(), (2, 2));
}

/// A host function of another stream that becomes due while the ended thread still runs its
/// last host function runs after it returns, on the new thread. (Whether a new thread that did
/// not wait would run it first is a race: with that wait removed, 4 runs of 20 failed here.)
#[test]
fn host_functions_run_one_at_a_time_across_an_ended_thread() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let (a, b) = (ctx.owner(), ctx.owner());
    let (s1, s2) = (a.stream().unwrap(), b.stream().unwrap());
    let h1_done = Arc::new(AtomicBool::new(false));
    let (ended_tx, ended_rx) = mpsc::channel::<bool>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    {
        let (sim, h1_done) = (sim.clone(), h1_done.clone());
        s1.launch_host_func(move || {
            ended_tx.send(sim.end_host_thread()).unwrap();
            go_rx.recv().unwrap();
            h1_done.store(true, Ordering::SeqCst);
        })
        .unwrap();
    }
    sim.advance(0);
    assert!(
        ended_rx.recv().unwrap(),
        "the first thread ended while it runs H1"
    );
    let saw = Arc::new(AtomicBool::new(false));
    {
        let (h1_done, saw) = (h1_done.clone(), saw.clone());
        s2.launch_host_func(move || saw.store(h1_done.load(Ordering::SeqCst), Ordering::SeqCst))
            .unwrap();
    }
    sim.advance(0); // H2 is due: a new thread starts for it
    go_tx.send(()).unwrap();
    s1.synchronize().unwrap();
    s2.synchronize().unwrap();
    assert!(saw.load(Ordering::SeqCst), "H2 ran before H1 had returned");
    assert_eq!(sim.host_fn_progress(), (2, 2));
}

/// Two threads end the host thread at once while a host function runs: one ends it, the other
/// finds none; a later host function runs on a new thread.
#[test]
fn two_threads_ending_the_host_thread_at_once_end_it_once() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let owner = ctx.owner();
    let s = owner.stream().unwrap();
    let (started_tx, started_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    s.launch_host_func(move || {
        started_tx.send(()).unwrap();
        go_rx.recv().unwrap();
    })
    .unwrap();
    sim.advance(0);
    started_rx.recv().unwrap();
    let enders: Vec<_> = (0..2)
        .map(|_| {
            let sim = sim.clone();
            std::thread::spawn(move || sim.end_host_thread())
        })
        .collect();
    go_tx.send(()).unwrap();
    let ended: Vec<bool> = enders.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(ended.iter().filter(|e| **e).count(), 1, "{ended:?}");
    s.synchronize().unwrap();
    s.launch_host_func(|| {}).unwrap();
    s.synchronize().unwrap();
    assert_eq!(sim.host_fn_progress(), (2, 2));
}

/// Signals on its channel when dropped: at the exit of the thread whose thread-local holds it.
struct OnExit(mpsc::Sender<()>);

impl Drop for OnExit {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

thread_local! {
    static EXIT: std::cell::RefCell<Option<OnExit>> = const { std::cell::RefCell::new(None) };
}

// Regression: 2026-12-07, fuzz campaign 26 (1,254 parked `sim-host-fn` threads after 25 minutes,
// one more per ~1,500 inputs; corpus input `regression-host-thread-left-behind`): a thread
// started after `end_host_thread` (for a host function that the ended thread's last host
// functions made due) waited for more work for the rest of the process.
/// Once the thread is ended, a host function that becomes due later runs on a thread that
/// returns when it has run: nothing waits for host functions of a simulation kept alive.
#[test]
fn a_thread_started_after_the_end_returns_once_it_has_run() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let owner = ctx.owner();
    let s = owner.stream().unwrap();
    s.launch_host_func(|| {}).unwrap();
    s.synchronize().unwrap();
    assert!(sim.end_host_thread());
    let (tx, rx) = mpsc::channel();
    s.launch_host_func(move || EXIT.with(|e| *e.borrow_mut() = Some(OnExit(tx))))
        .unwrap();
    s.synchronize().unwrap();
    assert_eq!(sim.host_fn_progress(), (2, 2));
    // The simulation (and its stream) stays alive: only the thread's return drops the
    // thread-local (a hang guard of 60 s; it returns at once).
    assert_eq!(
        rx.recv_timeout(std::time::Duration::from_secs(60)),
        Ok(()),
        "the thread started after the end has returned"
    );
    assert!(!sim.end_host_thread(), "no thread is left to end");
}

// Regression: review 25 (2026-12-07), finding 1: the simulation's drop skipped its wait for its
// ended threads on any thread running a host function, another simulation's included.
/// Simulation B's host function runs on B's ended thread while a host function of simulation A
/// drops the last reference to B: B's drop waits for B's thread (no thread of B outlives B).
#[test]
fn a_drop_on_another_simulations_host_function_waits_for_the_ended_thread() {
    use cuda_stream_pool::driver::Driver;
    use std::sync::Mutex;
    use std::time::Duration;
    let b = Arc::new(SimDriver::new());
    let dev = b.device_get(0).unwrap();
    let c = b.primary_ctx_retain(dev).unwrap();
    // SAFETY: `c` is B's retained primary context.
    unsafe { b.ctx_set_current(c) }.unwrap();
    let bs = b.stream_create(0, 0).unwrap();
    // SAFETY: `bs` is a live stream of B; the host function calls no driver.
    unsafe { b.launch_host_func(bs, Box::new(|| {})) }.unwrap();
    // SAFETY: as above.
    unsafe { b.stream_synchronize(bs) }.unwrap();
    assert!(b.end_host_thread());
    let b_running = Arc::new(AtomicBool::new(false));
    let (release_tx, release_rx) = mpsc::channel::<()>();
    {
        let b_running = b_running.clone();
        // SAFETY: as above.
        unsafe {
            b.launch_host_func(
                bs,
                Box::new(move || {
                    b_running.store(true, Ordering::SeqCst);
                    let _ = release_rx.recv_timeout(Duration::from_secs(30));
                    b_running.store(false, Ordering::SeqCst);
                }),
            )
        }
        .unwrap();
    }
    b.advance(0);
    while !b_running.load(Ordering::SeqCst) {
        std::thread::yield_now();
    }
    let a = Arc::new(SimDriver::new());
    let actx = Context::primary(a.clone(), 0).unwrap();
    let owner = actx.owner();
    let s = owner.stream().unwrap();
    let (dropped_tx, dropped_rx) = mpsc::channel::<bool>();
    let slot = Arc::new(Mutex::new(Some(b)));
    {
        let (slot, b_running) = (slot.clone(), b_running.clone());
        s.launch_host_func(move || {
            let b = slot.lock().unwrap().take().unwrap();
            assert_eq!(Arc::strong_count(&b), 1);
            drop(b); // B's drop, on A's host-function thread
            dropped_tx.send(b_running.load(Ordering::SeqCst)).unwrap();
        })
        .unwrap();
    }
    a.advance(0);
    // A drop that waits for B's thread returns only after the release below: nothing comes in
    // this time (it bounds the wait, it does not decide the verdict: a drop that does not wait
    // sends `true` at once, one that waits sends `false` after the release).
    let early = dropped_rx.recv_timeout(Duration::from_secs(2));
    release_tx.send(()).unwrap();
    s.synchronize().unwrap();
    let late = dropped_rx.recv().ok();
    assert_eq!(
        (early.ok(), late),
        (None, Some(false)),
        "B's drop returned while B's host function still ran on B's ended thread"
    );
}

// Regression: review 25 (2026-12-07), finding 2: when no thread could be started for a host
// function after `end_host_thread`, it ran at once on the calling thread, beside the ended
// thread's last host function, and the next thread no longer waited for the ended one.
/// With no thread to be had, a host function that becomes due while the ended thread still runs
/// its last one waits for it to return, then runs (on the thread that completes it).
#[test]
fn without_a_thread_a_host_function_waits_for_the_ended_threads_last() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let (a, b) = (ctx.owner(), ctx.owner());
    let (s1, s2) = (a.stream().unwrap(), b.stream().unwrap());
    let h1_runs = Arc::new(AtomicBool::new(false));
    let (started_tx, started_rx) = mpsc::channel::<bool>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    {
        let (sim, h1_runs) = (sim.clone(), h1_runs.clone());
        s1.launch_host_func(move || {
            h1_runs.store(true, Ordering::SeqCst);
            started_tx.send(sim.end_host_thread()).unwrap();
            go_rx.recv().unwrap();
            h1_runs.store(false, Ordering::SeqCst);
        })
        .unwrap();
    }
    sim.advance(0);
    assert!(started_rx.recv().unwrap(), "H1 ended its own thread");
    sim.fail_host_thread_spawns(1_000);
    let h2_saw_h1 = Arc::new(AtomicBool::new(true));
    {
        let (h1_runs, saw) = (h1_runs.clone(), h2_saw_h1.clone());
        s2.launch_host_func(move || saw.store(h1_runs.load(Ordering::SeqCst), Ordering::SeqCst))
            .unwrap();
    }
    sim.advance(0);
    assert_eq!(sim.host_fn_progress(), (1, 0), "H2 started beside H1");
    go_tx.send(()).unwrap();
    s2.synchronize().unwrap();
    sim.fail_host_thread_spawns(0);
    assert_eq!(sim.host_fn_progress(), (2, 2));
    assert!(
        !h2_saw_h1.load(Ordering::SeqCst),
        "H2 ran while H1 still ran on the ended thread"
    );
}
