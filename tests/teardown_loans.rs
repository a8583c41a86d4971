//! Loans that end at chosen points of a context's teardown (and of a lingering state's later
//! teardown), placed deterministically with a scripted `driver::Hook`: whenever a loan ends, the
//! teardown (or a later one of the lingering state) destroys its stream and finishes what waited
//! for it, and nothing is left behind. Every test takes `serial()`: a lingering state of one test
//! would otherwise be reaped on another test's thread, and fire its script there. (Written by
//! review 22, which found the first two scenarios' leaks.)

use cuda_stream_pool::driver::{CaptureMode, Driver, Hook, Hooked, SimDriver, Stream};
use cuda_stream_pool::{Context, DeviceBuffer, Error, ErrorCode, OwnedStream, Priority};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// Another crate's handle of a stream.
#[derive(Debug)]
struct Foreign(Stream);

fn lend(s: &cuda_stream_pool::StreamRef<'_>) -> Arc<Foreign> {
    s.lend(|raw| Ok(Arc::new(Foreign(raw)))).unwrap()
}

/// A hang guard only: every scenario finishes at once.
const HANG: Duration = Duration::from_secs(60);

static SERIAL: Mutex<()> = Mutex::new(());
fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

enum When {
    Before,
    After,
}

enum Act {
    /// Only advances the script (a phase marker).
    Mark,
    /// Runs test code (never crate code): drops a handle, or calls the simulation directly.
    Run(Box<dyn FnOnce() + Send>),
    /// The call fails once (ERROR_UNKNOWN) without reaching the driver.
    Fail,
}

struct Step {
    call: &'static str,
    when: When,
    act: Act,
}

/// A hook that, once armed, waits for its steps' calls in order and acts at each.
#[derive(Default)]
struct Script {
    armed: AtomicBool,
    steps: Mutex<VecDeque<Step>>,
    log: Mutex<Vec<String>>,
}

impl Script {
    fn step(&self, call: &'static str, when: When, act: Act) {
        self.steps
            .lock()
            .unwrap()
            .push_back(Step { call, when, act });
    }
    fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }
    fn left(&self) -> usize {
        self.steps.lock().unwrap().len()
    }
    fn take(&self, call: &'static str, before: bool) -> Option<Act> {
        if !self.armed.load(Ordering::SeqCst) {
            return None;
        }
        let mut s = self.steps.lock().unwrap();
        let hit = s.front().is_some_and(|st| {
            st.call == call
                && matches!(
                    (&st.when, before),
                    (When::Before, true) | (When::After, false)
                )
        });
        if hit {
            let st = s.pop_front().unwrap();
            self.log.lock().unwrap().push(format!(
                "step fired at {call} ({})",
                if before { "before" } else { "after" }
            ));
            Some(st.act)
        } else {
            None
        }
    }
}

// SAFETY: `call` returns an error without calling `f` (Fail) or the result of its one call of
// `f`; the actions are test code (drops of the test's own handles, raw simulation calls on a
// stream whose capture the test itself began), never the crate's.
unsafe impl Hook for Script {
    fn before(&self, _call: &'static str) -> cuda_stream_pool::Result<()> {
        Ok(())
    }
    fn call<R>(
        &self,
        call: &'static str,
        mut f: impl FnMut() -> cuda_stream_pool::Result<R>,
    ) -> cuda_stream_pool::Result<R> {
        if self.armed.load(Ordering::SeqCst) {
            self.log.lock().unwrap().push(call.to_string());
        }
        match self.take(call, true) {
            Some(Act::Fail) => return Err(Error::driver(ErrorCode::ERROR_UNKNOWN, call)),
            Some(Act::Run(a)) => a(),
            Some(Act::Mark) | None => {}
        }
        let r = f();
        if let Some(Act::Run(a)) = self.take(call, false) {
            a();
        }
        r
    }
}

fn setup() -> (Arc<SimDriver>, Arc<Hooked<Script>>) {
    let sim = Arc::new(SimDriver::new());
    let hooked = Arc::new(Hooked {
        inner: sim.clone(),
        hook: Script::default(),
    });
    (sim, hooked)
}

/// A later operation of the crate: reaps lingering states whose loans ended.
fn later_crate_operation(sim: &Arc<SimDriver>) {
    drop(Context::primary(sim.clone(), 0).unwrap());
}

/// An idle stream in the pool of `prio`: the first drain destroys it (a phase marker).
fn idle_pooled_stream(ctx: &Context) {
    let o = ctx.owner();
    o.stream().unwrap();
    drop(o);
}

/// A loan of an owner's stream, parked: the owner is gone, the loan is out.
fn parked_loan(ctx: &Context) -> Arc<Foreign> {
    let lender = ctx.owner();
    let h = lend(&lender.stream().unwrap());
    drop(lender);
    h
}

/// A parked loan whose borrower captures the stream, with a buffer of the lender's dropped
/// meanwhile: its free is deferred (the stream is captured by someone else).
fn captured_loan_with_a_deferred_free(sim: &SimDriver, ctx: &Context) -> Arc<Foreign> {
    let lender = ctx.owner();
    let s = lender.stream().unwrap();
    let buf = DeviceBuffer::<u32>::zeroed(&s, 64).unwrap();
    let h = lend(&s);
    // The borrower captures the stream (relaxed: its own calls only).
    // SAFETY: the loan keeps the stream alive.
    unsafe { sim.stream_begin_capture(h.0, CaptureMode::Relaxed) }.unwrap();
    drop(buf); // deferred: its stream is captured by the borrower
    drop(s);
    drop(lender); // parked: the loan is out
    h
}

/// The borrower ends its capture of `h`'s stream and drops its handle: the loan ends.
fn end_capture_and_return(sim: &Arc<SimDriver>, h: Arc<Foreign>) -> Act {
    let sim = sim.clone();
    Act::Run(Box::new(move || {
        // SAFETY: the borrower's own capture of the lent (live) stream.
        unsafe {
            let g = sim.stream_end_capture(h.0).unwrap();
            sim.graph_destroy(g).unwrap();
        }
        drop(h);
    }))
}

/// The loan of `h` ends at the next stream destroy once the script is armed (the teardown's
/// first drain, when an idle pooled stream is there).
fn end_at_destroy(hooked: &Hooked<Script>, h: Arc<Foreign>) {
    hooked.hook.step(
        "cuStreamDestroy_v2",
        When::Before,
        Act::Run(Box::new(move || drop(h))),
    );
}

/// Arms the script, drops the last `Context` (the teardown runs), lets a later operation of
/// the crate reap what lingered, and checks that nothing is left behind.
fn tear_down(sim: &Arc<SimDriver>, hooked: &Hooked<Script>, ctx: Context, what: &str) {
    hooked.hook.arm();
    drop(ctx);
    later_crate_operation(sim);
    clean(sim, hooked, what);
}

fn clean(sim: &Arc<SimDriver>, h: &Hooked<Script>, what: &str) {
    let c = sim.counters();
    let log = h.hook.log.lock().unwrap().join(" ");
    assert_eq!(
        h.hook.left(),
        0,
        "{what}: the script did not run to its end; calls: {log}"
    );
    assert_eq!(
        (
            c.live_contexts,
            c.live_streams,
            c.live_allocs,
            c.live_modules
        ),
        (0, 0, 0, 0),
        "{what}: left behind: {c:?}\ncalls after arming: {log}"
    );
    assert!(sim.misuse().is_empty(), "{what}: {:?}", sim.misuse());
}

// Regression: a stream whose loan ended during the teardown leaked (the proptest finding
// `proptest-stream-left-live-at-teardown-1391`: live_streams 1 and a module left loaded after
// the primary context's release). The teardown's second flush gave the returned stream back to
// its pool after the pools were drained, and nothing destroyed it.
#[test]
fn a_loan_that_ends_during_the_teardown_leaves_no_stream_behind() {
    let _s = serial();
    let (sim, hooked) = setup();
    let ctx = Context::primary(hooked.clone(), 0).unwrap();
    let h = parked_loan(&ctx);
    let raw = h.0;
    // An idle stream in the pool: the drain destroys it, and the loan ends then.
    idle_pooled_stream(&ctx);
    end_at_destroy(&hooked, h);
    tear_down(&sim, &hooked, ctx, "a loan ended in the first drain");
    assert!(!sim.stream_exists(raw), "the returned lent stream leaked");
}

// Regression (review 22, finding 1: a free leaked at the teardown). A free deferred because the
// borrower was capturing the lent stream, retried by the teardown's second flush (still
// capturing), whose loan then ends (the borrower ends its capture and drops its handle) before
// that flush's lent loop: the stream came back, the second drain destroyed it, and the free was
// never retried.
#[test]
fn a_free_deferred_behind_a_borrowers_capture_is_made_when_the_loan_ends_in_the_second_flush() {
    let _s = serial();
    let (sim, hooked) = setup();
    let ctx = Context::primary(hooked.clone(), 0).unwrap();
    let h = captured_loan_with_a_deferred_free(&sim, &ctx);
    idle_pooled_stream(&ctx);
    // The first drain's destroy of the idle stream, then the next capture query: the second
    // flush's retry of the deferred free (it sees the capture); right after it the borrower
    // ends its capture and drops its handle.
    hooked
        .hook
        .step("cuStreamDestroy_v2", When::Before, Act::Mark);
    hooked.hook.step(
        "cuStreamGetCaptureInfo_v3",
        When::After,
        end_capture_and_return(&sim, h),
    );
    tear_down(
        &sim,
        &hooked,
        ctx,
        "a deferred free whose loan ended in the second flush",
    );
}

// The same, the loan ending during the first drain instead.
#[test]
fn a_free_deferred_behind_a_borrowers_capture_is_made_when_the_loan_ends_in_the_first_drain() {
    let _s = serial();
    let (sim, hooked) = setup();
    let ctx = Context::primary(hooked.clone(), 0).unwrap();
    let h = captured_loan_with_a_deferred_free(&sim, &ctx);
    idle_pooled_stream(&ctx);
    hooked.hook.step(
        "cuStreamDestroy_v2",
        When::Before,
        end_capture_and_return(&sim, h),
    );
    tear_down(&sim, &hooked, ctx, "a loan ended in the first drain");
}

// Regression (review 22, finding 2: a stream leaked at the teardown after one transient
// failure). A lent `OwnedStream` whose loan ends between the two flushes was destroyed by the
// second flush (`destroy_or_keep`) once: one failed synchronize left it in `orphans`, which
// nothing retried after the second flush (a pooled stream gets `tries` in the drain). The
// stream leaked, and with it the modules (`drained` was false).
#[test]
fn a_lent_owned_stream_whose_loan_ends_between_the_flushes_survives_one_transient_failure() {
    let _s = serial();
    let (sim, hooked) = setup();
    let ctx = Context::primary(hooked.clone(), 0).unwrap();
    let owned = OwnedStream::new(&ctx, Priority::Normal).unwrap();
    let h = lend(&owned.stream());
    let raw = h.0;
    drop(owned); // parked (pool None): the loan is out
    idle_pooled_stream(&ctx);
    end_at_destroy(&hooked, h);
    hooked
        .hook
        .step("cuStreamSynchronize", When::Before, Act::Fail);
    tear_down(
        &sim,
        &hooked,
        ctx,
        "a lent OwnedStream with one failed synchronize",
    );
    assert!(!sim.stream_exists(raw), "the lent owned stream leaked");
}

// The same with a pooled stream (the drain's `tries` absorb the failure).
#[test]
fn a_lent_pooled_stream_whose_loan_ends_between_the_flushes_survives_one_transient_failure() {
    let _s = serial();
    let (sim, hooked) = setup();
    let ctx = Context::primary(hooked.clone(), 0).unwrap();
    let h = parked_loan(&ctx);
    idle_pooled_stream(&ctx);
    end_at_destroy(&hooked, h);
    hooked
        .hook
        .step("cuStreamSynchronize", When::Before, Act::Fail);
    tear_down(
        &sim,
        &hooked,
        ctx,
        "a lent pooled stream with one failed synchronize",
    );
}

// A lent `OwnedStream` whose loan ends between the flushes, no failure.
#[test]
fn a_lent_owned_stream_whose_loan_ends_between_the_flushes_is_destroyed() {
    let _s = serial();
    let (sim, hooked) = setup();
    let ctx = Context::primary(hooked.clone(), 0).unwrap();
    let owned = OwnedStream::new(&ctx, Priority::High).unwrap();
    let h = lend(&owned.stream());
    drop(owned);
    idle_pooled_stream(&ctx);
    end_at_destroy(&hooked, h);
    tear_down(
        &sim,
        &hooked,
        ctx,
        "a lent OwnedStream, loan ended in the first drain",
    );
}

// Two loans of two priorities; the first ends in the first drain (on another thread, waited
// for), the second at the first's stream's destroy.
#[test]
fn loans_of_two_keys_ending_in_two_drains_leave_nothing_behind() {
    let _s = serial();
    let (sim, hooked) = setup();
    let ctx = Context::primary(hooked.clone(), 0).unwrap();
    let (a, b) = (ctx.owner(), ctx.owner());
    b.set_priority(Priority::High).unwrap();
    let ha = lend(&a.stream().unwrap());
    let hb = lend(&b.stream().unwrap());
    drop((a, b));
    idle_pooled_stream(&ctx);
    let (go, rx) = mpsc::channel::<()>();
    let (done_tx, done) = mpsc::channel::<()>();
    let t = std::thread::spawn(move || {
        rx.recv().unwrap();
        drop(ha);
        done_tx.send(()).unwrap();
    });
    hooked.hook.step(
        "cuStreamDestroy_v2",
        When::Before,
        Act::Run(Box::new(move || {
            go.send(()).unwrap();
            done.recv().unwrap();
        })),
    );
    end_at_destroy(&hooked, hb);
    hooked.hook.arm();
    drop(ctx);
    t.join().unwrap();
    later_crate_operation(&sim);
    clean(&sim, &hooked, "two keys, loans ending in each drain");
}

// Nested handles: A's handle holds B's; A's slot clone, dropped in the first flush's loop over
// the parked loans (after B was parked again), ends B's loan there.
#[test]
fn a_loan_ending_inside_the_first_flushs_loop_over_the_loans_leaves_nothing_behind() {
    #[derive(Debug)]
    struct Holder(#[allow(dead_code)] Stream, #[allow(dead_code)] Arc<Foreign>);
    let _s = serial();
    let (sim, hooked) = setup();
    let ctx = Context::primary(hooked.clone(), 0).unwrap();
    let (a, b) = (ctx.owner(), ctx.owner());
    let sb = b.stream().unwrap();
    let hb = lend(&sb);
    drop(sb);
    drop(b); // B parked first
    let sa = a.stream().unwrap();
    let hb2 = hb.clone();
    let ha = sa.lend(move |raw| Ok(Arc::new(Holder(raw, hb2)))).unwrap();
    drop(hb);
    drop(sa);
    drop(a);
    drop(ha); // A's loan has ended; B's is held by A's handle (the slot's clone)
    tear_down(&sim, &hooked, ctx, "nested handles");
}

// The teardown on a thread of its own (the last clone dropped in a host function), the loan
// ending at its first drain.
#[test]
fn a_teardown_on_a_thread_of_its_own_with_a_loan_ending_in_its_drain_leaves_nothing_behind() {
    let _s = serial();
    let (sim, hooked) = setup();
    let ctx = Context::primary(hooked.clone(), 0).unwrap();
    let h = parked_loan(&ctx);
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let last = ctx.clone();
    let (ran_tx, ran) = mpsc::channel::<std::thread::ThreadId>();
    s.launch_host_func(move || {
        ran_tx.send(std::thread::current().id()).unwrap();
        drop(last);
    })
    .unwrap();
    drop(s);
    drop(o);
    end_at_destroy(&hooked, h);
    hooked.hook.arm();
    drop(ctx);
    sim.advance(0);
    ran.recv_timeout(HANG).unwrap();
    // The teardown's thread releases the context last (a hang guard only).
    let t = Instant::now();
    while sim.counters().live_contexts != 0 {
        assert!(
            t.elapsed() < HANG,
            "the teardown on its own thread never finished"
        );
        std::thread::yield_now();
    }
    later_crate_operation(&sim);
    clean(&sim, &hooked, "a teardown on a thread of its own");
}

// A lingering state (two loans out) reaped by another thread, while a third thread ends the
// second loan during the reaped teardown's first drain.
#[test]
fn a_lingering_state_reaped_by_one_thread_while_a_third_ends_a_loan_leaves_nothing_behind() {
    let _s = serial();
    let (sim, hooked) = setup();
    let ctx = Context::primary(hooked.clone(), 0).unwrap();
    let (ha, hb) = (parked_loan(&ctx), parked_loan(&ctx));
    drop(ctx); // lingers: two loans out
    assert_eq!(sim.counters().live_contexts, 1);
    drop(ha); // the first loan ends
    let (go, rx) = mpsc::channel::<()>();
    let (done_tx, done) = mpsc::channel::<()>();
    let third = std::thread::spawn(move || {
        rx.recv().unwrap();
        drop(hb);
        done_tx.send(()).unwrap();
    });
    hooked.hook.step(
        "cuStreamDestroy_v2",
        When::Before,
        Act::Run(Box::new(move || {
            go.send(()).unwrap();
            done.recv().unwrap();
        })),
    );
    hooked.hook.arm();
    let s2 = sim.clone();
    std::thread::spawn(move || later_crate_operation(&s2))
        .join()
        .unwrap();
    third.join().unwrap();
    later_crate_operation(&sim);
    clean(
        &sim,
        &hooked,
        "a reaped lingering state, a third thread ending a loan",
    );
}
