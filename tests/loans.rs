//! Loans keep what they lend: a stream lent to another crate (`StreamRef::lend`, the mechanism
//! behind `cudarc_stream`) keeps its context (primary or adopted, with what keeps an adopted one
//! alive) for as long as the loan lasts, even when the `Context` is dropped first; and a lent
//! stream counts against its key's cap, and shows in the statistics, until it comes back.

#[path = "common/futures.rs"]
mod futures;

use cuda_stream_pool::driver::{Driver, SimDriver, Stream};
use cuda_stream_pool::{Context, ContextOptions};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};

/// Another crate's handle of a stream (what cudarc's `CudaStream` is).
#[derive(Debug)]
struct Foreign(Stream);

fn lend(s: &cuda_stream_pool::StreamRef<'_>) -> Arc<Foreign> {
    s.lend(|raw| Ok(Arc::new(Foreign(raw)))).unwrap()
}

/// What keeps an adopted context alive (cudarc's `Arc<CudaContext>` and keeper stream, in
/// `from_cudarc`): records when it is dropped.
struct KeepAlive(Arc<AtomicBool>);

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// The tests of this file run one at a time: a state left lingering by one would be torn down by
/// another's operations (as it should), racing the first test's own checks.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Any later operation of the crate (here a new context's creation) ends what lingered for loans
/// that have ended since.
fn later_crate_operation(sim: &Arc<SimDriver>) {
    drop(Context::primary(sim.clone(), 0).unwrap());
}

// Regression: issue 19 defect 10 (an adopted context was released while a loan is out)
#[test]
fn a_loan_keeps_an_adopted_contexts_keep_alive_until_it_ends() {
    let _serial = serial();
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    d.init().unwrap();
    let dev = d.device_get(0).unwrap();
    let raw = d.primary_ctx_retain(dev).unwrap();
    let dropped = Arc::new(AtomicBool::new(false));
    let keep: Box<dyn std::any::Any + Send + Sync> = Box::new(KeepAlive(dropped.clone()));
    // SAFETY: `raw` is retained above and released at the end, after everything made from it.
    let ctx = unsafe { Context::adopt(d.clone(), raw, Some(keep)) }.unwrap();
    let o = ctx.owner();
    let h = lend(&o.stream().unwrap());
    drop(o);
    drop(ctx);
    assert!(
        !dropped.load(Ordering::SeqCst),
        "the adopted context's keep-alive was dropped while a loan of its stream is out"
    );
    // The borrower's handle is still a live stream of a live context.
    // SAFETY: the loan keeps the stream alive (the simulation reports any misuse).
    assert!(unsafe { d.stream_query(h.0) }.unwrap());
    later_crate_operation(&sim);
    assert!(
        !dropped.load(Ordering::SeqCst),
        "dropped while the loan is out"
    );
    drop(h);
    later_crate_operation(&sim);
    assert!(
        dropped.load(Ordering::SeqCst),
        "the keep-alive outlived the loan"
    );
    assert_eq!(sim.counters().live_streams, 0, "{:?}", sim.counters());
    // SAFETY: retained once above; nothing of the state uses it any more.
    unsafe { d.primary_ctx_release(dev) }.unwrap();
    assert_eq!(sim.counters().live_contexts, 0);
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

// Regression: issue 19 defect 3 (what a loan relies on died with the Context, or lived forever)
#[test]
fn a_loan_keeps_its_primary_context_until_it_ends_then_everything_is_released() {
    let _serial = serial();
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let (a, b) = (ctx.owner(), ctx.owner());
    let (ha, hb) = (lend(&a.stream().unwrap()), lend(&b.stream().unwrap()));
    drop((a, b));
    drop(ctx);
    assert_eq!(sim.counters().live_contexts, 1, "{:?}", sim.counters());
    // The borrower uses both streams after the `Context` is gone.
    sim.enqueue_work(ha.0, 1_000).unwrap();
    // SAFETY: the loans keep both streams alive.
    unsafe { sim.stream_synchronize(ha.0) }.unwrap();
    assert!(unsafe { sim.stream_query(hb.0) }.unwrap());
    drop(ha);
    later_crate_operation(&sim);
    assert_eq!(
        sim.counters().live_contexts,
        1,
        "released while a loan is still out"
    );
    // SAFETY: `hb`'s loan keeps its stream alive.
    assert!(unsafe { sim.stream_query(hb.0) }.unwrap());
    drop(hb);
    later_crate_operation(&sim);
    let c = sim.counters();
    assert_eq!(
        (c.live_contexts, c.live_streams, c.live_allocs),
        (0, 0, 0),
        "the state outlived its last loan: {c:?}"
    );
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

// Regression: issue 19 defect 13 (a lent stream let its key exceed the cap, and the excess stayed)
#[test]
fn a_lent_stream_counts_against_the_cap_until_it_comes_back() {
    let _serial = serial();
    let sim = Arc::new(SimDriver::new());
    let opts = ContextOptions::default().max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(sim.clone(), 0, opts).unwrap();
    let a = ctx.owner();
    let h = lend(&a.stream().unwrap());
    drop(a); // the owner is gone, the loan is out
    let st = ctx.stats();
    assert_eq!((st.live, st.lent, st.in_use), (1, 1, 1), "{st:?}");
    assert_eq!(st.live, st.in_use + st.idle + st.retired_busy + st.handed);
    // A second owner must wait for the lent stream (the key is at its cap), not create one.
    let (tx, rx) = mpsc::channel();
    let c = ctx.clone();
    let waiter = std::thread::spawn(move || {
        let o = c.owner();
        let raw = o.stream().map(|s| s.raw());
        tx.send(raw.map_err(|e| e.to_string())).unwrap();
        drop(o);
    });
    let early = loop {
        if let Ok(r) = rx.try_recv() {
            break Some(r);
        }
        if ctx.stats().waits == 1 {
            break None;
        }
        std::thread::yield_now();
    };
    assert!(
        early.is_none(),
        "a second owner got a stream while the only one allowed is lent: {early:?} {:?}",
        ctx.stats()
    );
    assert_eq!(ctx.stats().live, 1, "created beyond the cap");
    let lent_raw = h.0;
    drop(h); // the loan ends: the waiter gets the stream
    let got = rx.recv().unwrap().unwrap();
    waiter.join().unwrap();
    assert_eq!(got, lent_raw, "the lent stream came back");
    ctx.trim().unwrap();
    let st = ctx.stats();
    assert!(
        st.peak_live <= 1 && st.live <= 1 && st.created == 1,
        "{st:?}"
    );
    assert_eq!(st.lent, 0);
}

// Regression: issue 19 defect 13 (a lent stream let its key exceed the cap: the async path)
#[test]
fn an_async_waiter_at_the_cap_waits_for_a_lent_stream_then_gets_it() {
    let _serial = serial();
    let sim = Arc::new(SimDriver::new());
    let opts = ContextOptions::default().max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(sim.clone(), 0, opts).unwrap();
    let a = ctx.owner();
    let h = lend(&a.stream().unwrap());
    drop(a);
    let (count, w) = futures::waker();
    let mut fut = Box::pin(ctx.owner().ready());
    assert!(
        futures::poll(fut.as_mut(), &w).is_pending(),
        "an async acquisition got a stream while the only one allowed is lent: {:?}",
        ctx.stats()
    );
    assert_eq!((ctx.stats().live, ctx.stats().waits), (1, 1));
    let lent_raw = h.0;
    drop(h); // nothing of the crate runs: the waiter looks for the loan's end itself
    let owner = loop {
        let seen = count.0.load(Ordering::SeqCst);
        match futures::poll(fut.as_mut(), &w) {
            std::task::Poll::Ready(r) => break r.unwrap(),
            std::task::Poll::Pending => {
                while count.0.load(Ordering::SeqCst) == seen {
                    std::thread::yield_now();
                }
            }
        }
    };
    assert_eq!(owner.stream().unwrap().raw(), lent_raw);
    let st = ctx.stats();
    assert!(st.live <= 1 && st.created == 1 && st.lent == 0, "{st:?}");
}
