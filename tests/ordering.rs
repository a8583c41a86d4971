//! Cross-stream ordering of buffer uses and frees: every use of a buffer (a kernel, a copy, a
//! graph launch) is ordered after its earlier uses on other streams, and its free after all of
//! them, also when ordering fails, when threads interleave at a precise point (the pausing
//! driver of `tests/common/pausing.rs`), and when several uses lock several buffers at once.
//! On the simulated driver, whose call log and race detector say what was ordered.

#[path = "common/calls.rs"]
mod calls;
#[path = "common/pausing.rs"]
mod pausing;

use calls::{fmt_calls, setup};
use pausing::pausing;

use cuda_stream_pool::driver::sim::Call;
use cuda_stream_pool::driver::Stream;
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{DeviceBuffer, ErrorCode};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(5);
const HANG: Duration = Duration::from_secs(3);

/// Whether, before index `free_at`, some successful `cuStreamWaitEvent` on `waiter` waited for an
/// event whose record was enqueued on `on` at or after index `since`.
fn waited_after(calls: &[Call], waiter: Stream, on: Stream, since: usize, free_at: usize) -> bool {
    (since..free_at).any(|i| {
        let c = &calls[i];
        c.name == "cuStreamWaitEvent"
            && c.ok
            && c.stream == Some(waiter)
            && c.event.is_some_and(|e| {
                calls[since..i].iter().any(|r| {
                    r.name == "cuEventRecord" && r.ok && r.event == Some(e) && r.stream == Some(on)
                })
            })
    })
}

// Pins soundness review (issue 12) defect 3: when ordering a free after the buffer's last use failed, it was freed unordered
#[test]
fn a_failed_ordering_never_issues_the_free_unordered() {
    let (sim, ctx) = setup();
    let owner = ctx.owner();
    let s = owner.stream().unwrap();
    let mut buf = DeviceBuffer::<u32>::zeroed(&s, 256).unwrap();
    s.synchronize().unwrap();
    sim.enqueue_work(s.raw(), 1_000).unwrap(); // s busy ...
    buf.fill(&s, 7).unwrap(); // ... and the buffer's last use pending behind that work
    let ptr = buf.as_raw();
    sim.clear_calls();
    // The free on s fails (first try and the retry after bind), and so does the ordering of the
    // disposal stream after s.
    sim.fail_calls("cuMemFreeAsync", ErrorCode::ERROR_UNKNOWN, 2);
    sim.fail_calls("cuEventRecord", ErrorCode::ERROR_UNKNOWN, 1);
    sim.fail_calls("cuStreamWaitEvent", ErrorCode::ERROR_UNKNOWN, 1);
    drop(buf);
    sim.clear_faults();
    let calls = sim.calls();
    let log = fmt_calls(&calls);
    sim.advance(2_000); // the memset on s runs now
    let disposal = ctx.disposal_stream();
    let unordered_free = calls.iter().enumerate().any(|(i, c)| {
        c.name == "cuMemFreeAsync"
            && c.ok
            && c.ptr == Some(ptr)
            && c.stream == Some(disposal)
            && !waited_after(&calls, disposal, s.raw(), 0, i)
    });
    assert!(
        !unordered_free && sim.misuse().is_empty(),
        "the free was issued on the disposal stream although ordering it after the buffer's \
         pending use failed; misuse: {:?}; calls: {log}",
        sim.misuse()
    );
}

// Pins soundness review (issue 12) defect 4: a concurrent `use_on` missed a kernel whose use had begun, not yet enqueued
#[test]
fn a_concurrent_use_orders_after_a_kernel_still_being_enqueued() {
    let (pd, sim, ctx) = pausing();
    let k = Kernels::load(&ctx).unwrap();
    let o = ctx.owner();
    let s0 = o.stream().unwrap();
    let buf = DeviceBuffer::<f32>::zeroed(&s0, 256).unwrap();
    s0.synchronize().unwrap();
    sim.clear_calls();
    let (buf2, k, ctx2, pd2, sim2) = (&buf, &k, &ctx, &pd, &sim);
    let sa_raw = std::thread::scope(|sc| {
        let a = sc.spawn(move || {
            // Thread A: its use of the buffer begins inside add_one; it pauses right before
            // cuLaunchKernel, with the use begun but the kernel not yet enqueued.
            let oa = ctx2.owner();
            let sa = oa.stream().unwrap();
            pd2.hook.arm_here("cuLaunchKernel", 1);
            k.add_one(&sa, buf2).unwrap();
            sim2.enqueue_work(sa.raw(), 1_000).unwrap(); // keeps A's stream busy afterwards
            sa.raw()
        });
        assert!(
            pd.hook.wait_paused(TIMEOUT),
            "thread A did not reach cuLaunchKernel"
        );
        // Thread B: uses the buffer on its own stream in A's window.
        let b = sc.spawn(move || {
            let ob = ctx2.owner();
            let sb = ob.stream().unwrap();
            drop(buf2.use_on(&sb).unwrap());
        });
        std::thread::sleep(Duration::from_millis(50)); // let B reach the buffer (not needed for the assertion)
        pd.hook.release();
        let raw = a.join().unwrap();
        b.join().unwrap();
        raw
    });
    assert!(!pd.hook.timed_out());
    let calls = sim.calls();
    let launch = calls
        .iter()
        .position(|c| c.name == "cuLaunchKernel" && c.ok && c.stream == Some(sa_raw))
        .expect("A's kernel launch");
    // Every later use (B's) waits for an event recorded on A's stream after A's kernel.
    let after_kernel = calls[launch + 1..]
        .iter()
        .any(|c| c.name == "cuEventRecord" && c.ok && c.stream == Some(sa_raw));
    drop(buf);
    sim.advance(2_000);
    assert!(
        after_kernel && sim.misuse().is_empty(),
        "a concurrent use of the buffer did not order after thread A's kernel; misuse: {:?}; \
         calls: {}",
        sim.misuse(),
        fmt_calls(&sim.calls())
    );
}

// Pins soundness review (issue 12) defect 6: graph launches were not uses, a buffer's free was not ordered after them
#[test]
fn a_free_is_ordered_after_a_graph_launch_that_uses_the_buffer() {
    let (sim, ctx) = setup();
    let k = Kernels::load(&ctx).unwrap();
    let (oa, ob) = (ctx.owner(), ctx.owner());
    let (s, t) = (oa.stream().unwrap(), ob.stream().unwrap());
    let buf = DeviceBuffer::<f32>::zeroed(&s, 256).unwrap();
    s.synchronize().unwrap();
    let g = s.begin_capture().unwrap();
    k.add_one(&s, &buf).unwrap();
    let exec = g.end().unwrap().instantiate().unwrap();
    sim.enqueue_work(t.raw(), 1_000).unwrap(); // the graph's work stays pending on t
    exec.launch(&t).unwrap();
    let ptr = buf.as_raw();
    sim.clear_calls();
    drop(buf);
    let calls = sim.calls();
    let log = fmt_calls(&calls);
    sim.advance(2_000);
    let free = calls
        .iter()
        .position(|c| c.name == "cuMemFreeAsync" && c.ok && c.ptr == Some(ptr));
    let ordered = free.is_none_or(|i| {
        calls[i].stream == Some(t.raw())
            || waited_after(&calls, calls[i].stream.unwrap(), t.raw(), 0, i)
    });
    assert!(
        ordered && sim.misuse().is_empty(),
        "the free is not ordered after the graph launch on t that uses the buffer; misuse: {:?}; \
         calls of the drop: {log}",
        sim.misuse()
    );
    drop(exec);
}

// Pins soundness review (issue 12) defect 6: graph launches are uses; two sharing buffers lock them in one order
/// Two graphs that share a buffer, launched on two threads at once, each a use of the buffer:
/// no deadlock (use locks are taken in address order), and the buffer's free is ordered after
/// both launches.
#[test]
fn concurrent_graph_launches_sharing_buffers_neither_deadlock_nor_race() {
    let (sim, ctx) = setup();
    let k = Kernels::load(&ctx).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let x = DeviceBuffer::<f32>::zeroed(&s, 64).unwrap();
    let y = DeviceBuffer::<f32>::zeroed(&s, 1).unwrap();
    s.synchronize().unwrap();
    let capture = |a: &DeviceBuffer<f32>, b: &DeviceBuffer<f32>| {
        let g = s.begin_capture().unwrap();
        k.sum(&s, a, b).unwrap();
        g.end().unwrap().instantiate().unwrap()
    };
    let (e1, e2) = (capture(&x, &y), capture(&x, &y));
    drop(s);
    drop(o);
    std::thread::scope(|sc| {
        for e in [&e1, &e2] {
            let ctx = &ctx;
            sc.spawn(move || {
                for _ in 0..50 {
                    let o = ctx.owner();
                    e.launch(&o.stream().unwrap()).unwrap();
                }
            });
        }
    });
    drop((x, y, e1, e2));
    ctx.synchronize().unwrap();
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

// Pins the second review's finding: `Kernels::sum` took its buffers' use locks in argument order, and deadlocked
/// `Kernels::sum` takes the use locks of `x` and `out` in argument order, not in a global order
/// (graph launches sort by address, `sum` does not): two threads summing into each other's input
/// (`sum(x, y)` and `sum(y, x)`) deadlock. The pausing driver stops thread A while it holds `x`'s
/// use lock (at the cuEventRecord of its ordering after the buffers' last stream); B takes `y`'s
/// lock and waits for `x`'s; A, released, waits for `y`'s.
#[test]
fn sum_of_swapped_buffers_on_two_threads_does_not_deadlock() {
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
