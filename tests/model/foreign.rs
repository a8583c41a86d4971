//! Foreign captures: another thread (a library that is not the crate) captures a raw stream of
//! the crate's context through the raw driver, in any capture mode, while the model's
//! operations run. The crate makes every call of the invalidation table in relaxed mode, so the
//! capture must stay valid (checked after every step, and by its end) and the simulation must
//! record no such call made outside relaxed mode (`SimDriver::unrelaxed_calls`).
//!
//! The helper thread is not registered with the scheduler: between its begin and its end it
//! waits on a channel, outside the crate, and the model's thread never waits for it while it
//! waits (the end sends first, then joins).

use super::*;
use cuda_stream_pool::driver::{stream_flags, Stream};
use std::sync::mpsc;

/// At most this many foreign captures at once.
const MAX_FOREIGN: usize = 2;

/// A live foreign capture.
pub(super) struct Foreign {
    pub(super) raw: u64,
    pub(super) mode: CaptureMode,
    go: mpsc::Sender<()>,
    thread: std::thread::JoinHandle<Result<(), String>>,
}

/// Retries `f` while it fails with an injected fault (the faults are one-shot): the foreign
/// thread's own calls must not fail for the model's fault injection.
fn retry<T>(mut f: impl FnMut() -> cuda_stream_pool::Result<T>) -> cuda_stream_pool::Result<T> {
    let mut n = 0;
    loop {
        match f() {
            Err(e)
                if n < 8
                    && e.code()
                        .is_some_and(|c| CODES.contains(&c.0) && c.0 != 901 && c.0 != 900) =>
            {
                n += 1
            }
            r => return r,
        }
    }
}

impl Foreign {
    /// Ends the capture and waits for its thread, whatever the end returned (a dead context's
    /// capture cannot end).
    pub(super) fn end_ignoring_the_result(self) -> Result<(), String> {
        let _ = self.go.send(());
        self.thread
            .join()
            .expect("a foreign capture's thread panicked")
    }
}

impl Model {
    /// The raw streams of the live foreign captures.
    pub(super) fn foreign_streams(&self) -> usize {
        self.foreign.len()
    }

    pub(super) fn foreign_capture(&mut self, mode: CaptureMode) {
        if self.foreign.len() >= MAX_FOREIGN {
            return;
        }
        let sim = self.sim.clone();
        let ctx = self.ctx().raw();
        let (began, wait_begin) = mpsc::channel::<Option<u64>>();
        let (go, wait_go) = mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            sim.set_thread_context(ctx);
            let s = match retry(|| sim.stream_create(stream_flags::NON_BLOCKING, 0)) {
                Ok(s) => s,
                Err(_) => {
                    let _ = began.send(None);
                    return Ok(());
                }
            };
            // SAFETY: `s` was created above and is destroyed only at the end of this thread.
            let begun = retry(|| unsafe { sim.stream_begin_capture(s, mode) });
            if begun.is_err() {
                // SAFETY: as above; nothing is pending on it.
                let _ = retry(|| unsafe { sim.stream_destroy(s) });
                let _ = began.send(None);
                return Ok(());
            }
            let _ = began.send(Some(s.0));
            let _ = wait_go.recv();
            // SAFETY: as above.
            let end = retry(|| unsafe { sim.stream_end_capture(s) });
            let r = match end {
                // SAFETY: the graph was just made by the end of the capture.
                Ok(g) => {
                    let _ = retry(|| unsafe { sim.graph_destroy(g) });
                    Ok(())
                }
                Err(e) => Err(format!(
                    "a foreign capture in {mode:?} mode did not survive the crate's operations: \
                     its end failed: {e}"
                )),
            };
            // SAFETY: as above; the capture has ended (or failed), nothing is pending.
            let _ = retry(|| unsafe { sim.stream_destroy(s) });
            r
        });
        match wait_begin.recv() {
            Ok(Some(raw)) => self.foreign.push(Foreign {
                raw,
                mode,
                go,
                thread,
            }),
            _ => {
                let _ = thread.join();
            }
        }
    }

    /// Ends foreign capture `k`; its end must succeed.
    pub(super) fn end_foreign(&mut self, k: usize) {
        let Some(k) = pick(&self.foreign, k) else {
            return;
        };
        let f = self.foreign.swap_remove(k);
        let _ = f.go.send(());
        let r = f
            .thread
            .join()
            .expect("a foreign capture's thread panicked");
        if let Err(e) = r {
            panic!("{e}");
        }
    }

    /// The live foreign captures are still active, and nothing was called outside relaxed mode.
    pub(super) fn check_foreign(&self) {
        for f in &self.foreign {
            // SAFETY: the stream lives until its capture's thread ends, after `end_foreign`.
            let status = retry(|| unsafe { self.sim.stream_is_capturing(Stream(f.raw)) });
            assert!(
                matches!(status, Ok(CaptureStatus::Active)),
                "a foreign capture in {:?} mode was invalidated: {status:?}",
                f.mode
            );
        }
        let unrelaxed = self.sim.unrelaxed_calls();
        assert!(
            unrelaxed.is_empty(),
            "calls of the invalidation table outside relaxed mode: {unrelaxed:?}"
        );
    }
}

impl Model {
    /// See [`Op::LeakUse`].
    pub(super) fn leak_use(
        &mut self,
        buffer: usize,
        holder: usize,
        write: bool,
        ns: u64,
        drop_now: bool,
    ) {
        let (Some(j), Some(h)) = (pick(&self.bufs, buffer), self.holder(holder)) else {
            return;
        };
        let Some(s) = h.stream() else { return };
        if self.leaked_uses.len() >= 8 {
            return;
        }
        self.sync_holdings();
        let b = self.bufs.swap_remove(j).b;
        if let Ok(u) = b.use_on(&s) {
            let _ = self
                .sim
                .enqueue_access(s.raw(), u.ptr(), u.bytes(), write, ns);
            std::mem::forget(u);
            self.use_leaked = true;
            // The leaking thread's later uses are refused (not blocked).
            let again = b.use_on(&s);
            assert!(
                matches!(again, Err(Error::InvalidArgument(_))),
                "a use after a leaked use on the same thread: {again:?}"
            );
        }
        drop(s);
        drop(h);
        if drop_now {
            drop(b);
        } else {
            self.leaked_uses.push(b);
        }
    }

    /// See [`Op::ManyOwners`].
    pub(super) fn many_owners(&mut self, p: i32, extra: usize) {
        // With a cap the owners beyond it would wait for this thread.
        if self.cap.is_some() {
            return;
        }
        let n = MAX_IDLE + extra;
        let mut tmp = Vec::with_capacity(n);
        for _ in 0..n {
            let o = self.ctx().owner();
            if o.set_priority(Priority::Value(p)).is_ok() {
                if let Ok(s) = o.stream() {
                    let _ = self.sim.enqueue_work(s.raw(), 100);
                    // A hand-over the model does not otherwise see.
                    *self.gens.entry(s.model_handle().0).or_insert(0) += 1;
                }
            }
            tmp.push(o);
        }
        drop(tmp);
        self.sim.advance(futs::LONG);
        let _ = self.ctx().stats();
        let st = self
            .ctx()
            .stats_for(Priority::Value(p))
            .expect("a key in range");
        let keep = MAX_IDLE as u64;
        assert!(
            st.idle <= keep,
            "key {p}: {} idle streams after a statistics reading (at most {keep}): {st:?}",
            st.idle
        );
    }
}
