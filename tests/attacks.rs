//! Findings of a hostile review of commit 690fdc2 (the first soundness rewrite): each
//! `attack_NN_*` test broke a clause of the crate's safety contract from safe code, on the
//! simulated driver, and failed until the fix; it asserts the correct behaviour. Tests that would
//! otherwise hang run the scenario on a spawned thread and fail after a timeout.

#[path = "common/calls.rs"]
mod calls;
#[path = "common/pausing.rs"]
mod pausing;

use calls::{fmt_calls, pausing, recorded_on, setup};

use cuda_stream_pool::driver::sim::Call;
use cuda_stream_pool::driver::Stream;
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{DeviceBuffer, Error, ErrorCode, Priority, PriorityRange};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(5);
const HANG: Duration = Duration::from_secs(3);

/// `cuStreamWaitEvent`s on `capturing` (from index `since`) for events recorded on another
/// stream: on the GPU, CUDA_ERROR_STREAM_CAPTURE_ISOLATION, and the capture is invalidated.
fn waits_into_capture(calls: &[Call], capturing: Stream, since: usize) -> Vec<Call> {
    (since..calls.len())
        .filter(|&i| {
            let c = &calls[i];
            c.name == "cuStreamWaitEvent"
                && c.stream == Some(capturing)
                && c.event
                    .and_then(|e| recorded_on(calls, e, i))
                    .is_some_and(|on| on != capturing)
        })
        .map(|i| calls[i].clone())
        .collect()
}

// ---- 01 ---------------------------------------------------------------------------------------

/// `Owner::select` checks only that the *previously selected* stream is not capturing; its
/// SAFETY claim "`next` could only capture while selected" is false: a `StreamRef` taken while
/// that priority was selected stays valid after a switch, and can begin a capture on a stream that
/// is not the selected one. Switching back then records an event on the selected stream and makes
/// the capturing stream wait for it: a capture waiting on outside work, which the GPU answers with
/// CUDA_ERROR_STREAM_CAPTURE_ISOLATION and an invalidated capture.
#[test]
fn attack_01_set_priority_waits_into_capture_of_unselected_stream() {
    let (sim, ctx) = setup();
    let o = ctx.owner();
    let s_normal = o.stream().unwrap();
    o.set_priority(Priority::High).unwrap(); // s_normal stays valid (it borrows `o`)
    let guard = s_normal.begin_capture().unwrap(); // capture on a stream that is not selected
    let begin = sim.calls().len();
    let r = o.set_priority(Priority::Normal); // prev = high (idle), next = s_normal (capturing)
    let calls = sim.calls();
    let bad = waits_into_capture(&calls, s_normal.raw(), begin);
    let end = guard.end();
    assert!(
        bad.is_empty() && matches!(r, Err(Error::CaptureInProgress(_))),
        "set_priority made the capturing stream wait for an event recorded outside its capture \
         ({}); set_priority: {r:?}; end: {:?}",
        fmt_calls(&bad),
        end.map(|_| ())
    );
}

/// The same through `with_priority`'s restore: the closure begins a capture on the stream of the
/// priority that was selected before, and returns the guard; the restore orders that capturing
/// stream after the closure's stream.
#[test]
fn attack_01b_with_priority_restore_waits_into_capture() {
    let (sim, ctx) = setup();
    let o = ctx.owner();
    let s_normal = o.stream().unwrap();
    let begin = sim.calls().len();
    let r = o.with_priority(Priority::High, || {
        // Not selected now, but its reference is still valid.
        let g = s_normal.begin_capture().unwrap();
        (g, sim.calls().len())
    });
    let calls = sim.calls();
    let (bad, end) = match r {
        Ok((g, since)) => (
            waits_into_capture(&calls, s_normal.raw(), since.max(begin)),
            Some(g.end().map(|_| ())),
        ),
        Err(_) => (Vec::new(), None), // refused: the guard was dropped inside, the capture ended
    };
    assert!(
        bad.is_empty(),
        "with_priority's restore made the capturing stream wait for outside work ({}); end: {end:?}",
        fmt_calls(&bad)
    );
}

// ---- 02 ---------------------------------------------------------------------------------------

/// `Kernels::sum` takes the use locks of `x` and `out` in argument order, not in a global order
/// (graph launches sort by address, `sum` does not): two threads summing into each other's input
/// (`sum(x, y)` and `sum(y, x)`) deadlock. The pausing driver stops thread A while it holds `x`'s
/// use lock (at the cuEventRecord of its ordering after the buffers' last stream); B takes `y`'s
/// lock and waits for `x`'s; A, released, waits for `y`'s.
#[test]
fn attack_02_sum_lock_order_deadlock() {
    let (pd, _sim, ctx) = pausing();
    let k = Arc::new(Kernels::load(&ctx).unwrap());
    let o0 = ctx.owner();
    let s0 = o0.stream().unwrap();
    let x = Arc::new(DeviceBuffer::<f32>::zeroed(&s0, 256).unwrap());
    let y = Arc::new(DeviceBuffer::<f32>::zeroed(&s0, 256).unwrap());
    s0.synchronize().unwrap(); // both last used on s0, whose generation stays live (o0 lives)
    let (done_tx, done_rx) = mpsc::channel::<&'static str>();
    let a = {
        let (ctx, k, x, y, pd, tx) = (
            ctx.clone(),
            k.clone(),
            x.clone(),
            y.clone(),
            pd.clone(),
            done_tx.clone(),
        );
        std::thread::spawn(move || {
            let oa = ctx.owner();
            let sa = oa.stream().unwrap();
            pd.hook.arm_here("cuEventRecord", 1); // inside use_on(x), with x's use lock held
            let r = k.sum(&sa, &x, &y);
            let _ = tx.send("A");
            r.map_err(|e| e.to_string())
        })
    };
    assert!(
        pd.hook.wait_paused(TIMEOUT),
        "thread A did not reach cuEventRecord"
    );
    let b = {
        let (ctx, k, x, y, tx) = (
            ctx.clone(),
            k.clone(),
            x.clone(),
            y.clone(),
            done_tx.clone(),
        );
        std::thread::spawn(move || {
            let ob = ctx.owner();
            let sb = ob.stream().unwrap();
            let r = k.sum(&sb, &y, &x);
            let _ = tx.send("B");
            r.map_err(|e| e.to_string())
        })
    };
    std::thread::sleep(Duration::from_millis(200)); // B takes y's lock, blocks on x's
    pd.hook.release();
    let first = done_rx.recv_timeout(HANG);
    let second = done_rx.recv_timeout(HANG);
    assert!(
        first.is_ok() && second.is_ok(),
        "Kernels::sum on two threads with swapped buffers deadlocked (finished: {first:?}, \
         {second:?})"
    );
    a.join().unwrap().unwrap();
    b.join().unwrap().unwrap();
}

// ---- 03 ---------------------------------------------------------------------------------------

/// A host function may not call the driver, but a closure that merely owns a crate object (all
/// of `Kernels`, `DeviceBuffer`, `Owner`, `Context`, `GraphExec` are `Send + 'static`) drops it
/// on the driver's host-function thread, and the crate's destructors call the driver there.
/// The worst one: the last `Kernels` runs `cuCtxSynchronize` before unloading its module, which
/// waits for the host function that is running it: the stream never completes.
#[test]
fn attack_03_host_fn_dropping_kernels_deadlocks() {
    let (_sim, ctx) = setup();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let k = Kernels::load(&ctx).unwrap();
        let o = ctx.owner();
        let s = o.stream().unwrap();
        s.launch_host_func(move || drop(k)).unwrap();
        let r = s.synchronize();
        let _ = tx.send(r.map_err(|e| e.to_string()));
    });
    let r = rx.recv_timeout(HANG);
    assert!(
        matches!(r, Ok(Ok(()))),
        "dropping the last Kernels inside a host function hung the stream: {r:?}"
    );
}

/// The same with the last `Context` clone: its teardown waits for the retired stream that runs
/// the host function.
#[test]
fn attack_03b_host_fn_dropping_last_context_deadlocks() {
    let (sim, ctx) = setup();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let s_raw;
    {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        s_raw = s.raw();
        let c2 = ctx.clone();
        s.launch_host_func(move || {
            let _ = go_rx.recv();
            drop(c2); // the last clone: CtxInner::drop runs here, on the host-function thread
            let _ = done_tx.send(());
        })
        .unwrap();
    }
    drop(ctx);
    go_tx.send(()).unwrap();
    let r = done_rx.recv_timeout(HANG);
    assert!(
        r.is_ok(),
        "the context's teardown, run by a host function, waited for its own stream (busy: {})",
        sim.is_busy(s_raw)
    );
}

// ---- 04 ---------------------------------------------------------------------------------------

/// After an invalidated capture whose end cannot be confirmed (the status query fails), the
/// stream stays flagged capturing and keeps the capture's buffers in `SlotState::captured`.
/// The next `begin_capture` succeeds in the driver and clears that list *under the slot's lock*:
/// dropping a buffer's last reference there frees it through `free_ordered`, which locks the same
/// slot again: the thread deadlocks on its own mutex (std's `Mutex` may also panic).
#[test]
fn attack_04_begin_capture_drops_stale_captured_buffer_under_slot_lock() {
    let (sim, ctx) = setup();
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let mut buf = DeviceBuffer::<u32>::zeroed(&s, 64).unwrap();
        s.synchronize().unwrap();
        let g = s.begin_capture().unwrap();
        buf.fill(&s, 1).unwrap(); // registers buf with the capture
                                  // A safe driver call that this thread may not make during its own capture: the capture
                                  // is invalidated (as on the GPU). Any invalidation will do.
                                  // (The raw driver: the context's own driver runs it in relaxed mode.)
        ctx.bind().unwrap();
        assert!(cuda_stream_pool::driver::Driver::ctx_synchronize(&*sim).is_err());
        sim.fail_calls("cuStreamGetCaptureInfo_v3", ErrorCode::ERROR_UNKNOWN, 2);
        let end = g.end();
        sim.clear_faults();
        let _ = tx.send(format!("end: {:?}", end.map(|_| ())));
        drop(buf); // the stale capture list holds the last reference now
        let _ = tx.send(format!("driver capturing: {:?}", s.is_capturing()));
        let g2 = s.begin_capture();
        let _ = tx.send(format!("second begin: {:?}", g2.as_ref().map(|_| ())));
        drop(g2);
        let _ = tx.send("done".into());
    });
    let mut seen = Vec::new();
    loop {
        match rx.recv_timeout(HANG) {
            Ok(m) if m == "done" => break,
            Ok(m) => seen.push(m),
            Err(e) => panic!("the thread hung or died ({e:?}) after: {seen:?}"),
        }
    }
}

// ---- 05 ---------------------------------------------------------------------------------------

/// "No public function panics on bad input": `PriorityRange` has public fields, and `resolve`
/// uses `i32::clamp(greatest, least)`, which panics when `greatest > least`. `Context::build`
/// takes the range from the driver unchecked, so a driver (or `SimConfig`) reporting the range
/// the other way round makes `Context::owner()` panic too.
#[test]
fn attack_05_priority_range_resolve_panics() {
    let r = PriorityRange {
        least: -5,
        greatest: 0,
    };
    let out = std::panic::catch_unwind(|| r.resolve(Priority::Normal));
    assert!(
        out.is_ok(),
        "PriorityRange::resolve(Normal) panicked on a reversed range"
    );
}

/// Found by the second review: crate objects moved into a host function (an `Owner` is `Send`)
/// reached the driver from the host-function thread (the real driver may refuse or deadlock).
/// Every driver call of a context now fails there with CUDA_ERROR_NOT_PERMITTED, before the
/// driver is called.
#[test]
fn crate_calls_inside_a_host_function_never_reach_the_driver() {
    use cuda_stream_pool::driver::SimDriver;
    let sim = std::sync::Arc::new(SimDriver::new());
    let ctx = cuda_stream_pool::Context::primary(sim.clone(), 0).unwrap();
    let held = ctx.owner();
    held.stream().unwrap(); // holds a stream already: stream() needs no driver call
    let fresh = ctx.owner();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let c = ctx.clone();
    s.launch_host_func(move || {
        let a = fresh.stream().map(|_| ()); // would create or query a stream
        let b = held.stream().and_then(|s| s.synchronize()); // would wait for the GPU
        let c2 = c.synchronize();
        let _ = tx.send((a.is_err(), b.is_err(), c2.is_err()));
    })
    .unwrap();
    s.synchronize().unwrap();
    assert_eq!(rx.recv().unwrap(), (true, true, true));
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}
