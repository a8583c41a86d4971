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
