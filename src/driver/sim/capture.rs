//! Stream capture and graphs, following what the real driver does on an H200.
//!
//! * Capture modes are per thread. Potentially unsafe calls (`cuStreamQuery`,
//!   `cuStreamSynchronize`, `cuEventQuery`, `cuEventSynchronize`, `cuCtxSynchronize`, and
//!   `cuMemAllocAsync` / `cuMemFreeAsync` on a stream that is NOT capturing) fail with
//!   `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidate (i) every other thread's
//!   global-mode capture when the calling thread is in global mode, and (ii) the calling
//!   thread's own global or thread-local capture; a thread in relaxed mode makes them freely.
//!   So do `cuMemHostAlloc`, `cuMemPoolCreate`, `cuMemPoolSetAttribute` and
//!   `cuGraphInstantiateWithFlags` (measured on the H200); `cuModuleLoadData` succeeds but
//!   invalidates the same captures. Any such call made outside relaxed mode while a capture is
//!   live is noted ([`SimDriver::unrelaxed_calls`]), conflicting or not.
//!   Creating and destroying (idle) streams and events, recording and waiting on events, host
//!   functions, memsets, `cuMemGetInfo` and `cuCtxGet/SetCurrent` invalidate nothing.
//! * Fork/join: an event recorded in a capture and waited on by a stream that is not capturing
//!   pulls that stream into the capture (same id, its later work becomes graph nodes). Ending
//!   the capture on its origin stream requires every pulled-in stream's last node to have been
//!   joined back (an event recorded on it waited on by another stream of the capture), else
//!   `CUDA_ERROR_STREAM_CAPTURE_UNJOINED` (904) and the capture is gone.
//! * A capturing stream may not wait on an event recorded outside the capture:
//!   `CUDA_ERROR_STREAM_CAPTURE_ISOLATION` (905), and the capture is invalidated (on an event of
//!   another capture: `CUDA_ERROR_STREAM_CAPTURE_MERGE`, 902).
//! * `cuMemFreeAsync` into a capture of memory not allocated by a graph returns
//!   `CUDA_ERROR_INVALID_VALUE` and the capture stays valid.
//! * A captured host function is a host node that the real driver runs on every launch, with the
//!   same user data; the simulation's host functions run once, so a second run is misuse.
//! * The graph's operations execute, at launch, in capture order with the launch's clock.

use super::*;

pub(super) struct Capture {
    pub(super) mode: CaptureMode,
    pub(super) id: u64,
    pub(super) thread: ThreadId,
    /// The stream that began the capture (and must end it).
    pub(super) origin: u64,
    pub(super) ops: Vec<(Effect, u64)>,
    pub(super) invalidated: bool,
    /// Graph nodes captured so far, per stream.
    pub(super) tips: HashMap<u64, u64>,
    /// Streams pulled into the capture by an event wait.
    pub(super) forked: std::collections::BTreeSet<u64>,
    /// Per stream: how many of its nodes another stream of the capture has waited for.
    pub(super) joined: HashMap<u64, u64>,
}

impl Capture {
    pub(super) fn new(mode: CaptureMode, id: u64, origin: u64) -> Capture {
        Capture {
            mode,
            id,
            thread: std::thread::current().id(),
            origin,
            ops: Vec::new(),
            invalidated: false,
            tips: HashMap::default(),
            forked: Default::default(),
            joined: HashMap::default(),
        }
    }

    /// A pulled-in stream whose last node no other stream of the capture waited for.
    pub(super) fn unjoined(&self) -> Option<u64> {
        self.forked.iter().copied().find(|s| {
            self.tips.get(s).copied().unwrap_or(0) > self.joined.get(s).copied().unwrap_or(0)
        })
    }
}

#[derive(Clone, Copy)]
pub(super) struct ThreadState {
    pub(super) mode: CaptureMode,
    pub(super) ctx: u64,
}

thread_local! {
    pub(super) static THREAD: std::cell::RefCell<HashMap<u64, ThreadState>> =
        std::cell::RefCell::new(HashMap::default());
}

impl SimDriver {
    /// The calling thread's driver state. A thread in its exit, after its thread-locals are
    /// gone (an implicit owner dropped last), is in global mode with no current context, as a
    /// fresh thread would be on the real driver.
    pub(super) fn thread(&self) -> ThreadState {
        const FRESH: ThreadState = ThreadState {
            mode: CaptureMode::Global,
            ctx: 0,
        };
        THREAD
            .try_with(|t| *t.borrow_mut().entry(self.id).or_insert(FRESH))
            .unwrap_or(FRESH)
    }

    pub(super) fn set_thread(&self, f: impl FnOnce(&mut ThreadState)) {
        let _ = THREAD.try_with(|t| {
            let mut m = t.borrow_mut();
            f(m.entry(self.id).or_insert(ThreadState {
                mode: CaptureMode::Global,
                ctx: 0,
            }))
        });
    }

    /// The capture stream `s` takes part in.
    pub(super) fn capture_of(st: &State, s: u64) -> Option<u64> {
        st.streams.get(&s).and_then(|x| x.capture)
    }

    /// Ends capture `id`: no stream takes part in it any more.
    pub(super) fn drop_capture(st: &mut State, id: u64) -> Option<Capture> {
        for s in st.streams.values_mut() {
            if s.capture == Some(id) {
                s.capture = None;
            }
        }
        st.captures.remove(&id)
    }

    /// Rules for "potentially unsafe" calls (queries and synchronizations) under capture: the
    /// calling thread in global mode conflicts with any global capture of another thread, and
    /// any thread not in relaxed mode conflicts with its own non-relaxed captures. Conflicting
    /// captures are invalidated and the call fails.
    pub(super) fn unsafe_call(&self, st: &mut State, call: &'static str) -> Result<()> {
        if self.invalidate_conflicts(st, call) {
            return Self::fail(st, ErrorCode::ERROR_STREAM_CAPTURE_UNSUPPORTED, call);
        }
        Ok(())
    }

    /// A call of the invalidation table that the H200 lets through (a module load): it
    /// succeeds, but the conflicting captures are invalidated as for [`SimDriver::unsafe_call`].
    pub(super) fn unsafe_call_succeeds(&self, st: &mut State, call: &'static str) {
        self.invalidate_conflicts(st, call);
    }

    /// The rule of [`SimDriver::unsafe_call`]: invalidates the captures that a call of the
    /// invalidation table made now conflicts with; whether there were any. A call made outside
    /// relaxed mode while any capture is live is noted ([`SimDriver::unrelaxed_calls`]), whether
    /// or not it conflicts.
    fn invalidate_conflicts(&self, st: &mut State, call: &'static str) -> bool {
        let me = std::thread::current().id();
        let mode = self.thread().mode;
        if mode == CaptureMode::Relaxed {
            return false;
        }
        if let Some(c) = st.captures.values().find(|c| !c.invalidated) {
            let note = format!(
                "{call} in {mode:?} mode on {me:?} while capture {} ({:?} mode, {:?}) is live",
                c.id, c.mode, c.thread
            );
            st.unrelaxed.push(note);
        }
        let mut hit = false;
        for c in st.captures.values_mut() {
            {
                let conflict = (c.thread == me && c.mode != CaptureMode::Relaxed)
                    || (c.thread != me
                        && c.mode == CaptureMode::Global
                        && mode == CaptureMode::Global);
                if conflict {
                    c.invalidated = true;
                    hit = true;
                }
            }
        }
        hit
    }

    /// Querying or synchronizing a capturing stream is illegal and invalidates its capture.
    pub(super) fn not_capturing(st: &mut State, s: Stream, call: &'static str) -> Result<()> {
        if let Some(id) = st.streams.get(&s.0).and_then(|x| x.capture) {
            if let Some(c) = st.captures.get_mut(&id) {
                c.invalidated = true;
            }
            return Self::fail(st, ErrorCode::ERROR_STREAM_CAPTURE_UNSUPPORTED, call);
        }
        Ok(())
    }

    /// Synchronizing a context waits for its capturing streams too: illegal in any mode (the
    /// caller's relaxed mode included), it invalidates every capture of a stream of the context
    /// (measured on the H200: `cuCtxSynchronize` fails with 900 and the capture, begun by
    /// another thread in any mode, ends 901).
    pub(super) fn no_capture_in_ctx(st: &mut State, ctx: u64, call: &'static str) -> Result<()> {
        let ids: Vec<u64> = st
            .streams
            .values()
            .filter(|x| x.ctx == ctx)
            .filter_map(|x| x.capture)
            .collect();
        let mut hit = false;
        for id in ids {
            if let Some(c) = st.captures.get_mut(&id) {
                c.invalidated = true;
                hit = true;
            }
        }
        if hit {
            return Self::fail(st, ErrorCode::ERROR_STREAM_CAPTURE_UNSUPPORTED, call);
        }
        Ok(())
    }

    pub(super) fn clone_effect(e: &Effect) -> Effect {
        match e {
            Effect::Work => Effect::Work,
            Effect::Access { ptr, bytes, write } => Effect::Access {
                ptr: *ptr,
                bytes: *bytes,
                write: *write,
            },
            Effect::Memset { ptr, value, count } => Effect::Memset {
                ptr: *ptr,
                value: *value,
                count: *count,
            },
            Effect::HtoD { dst, data } => Effect::HtoD {
                dst: *dst,
                data: data.clone(),
            },
            Effect::HtoDPinned {
                dst,
                host_dev,
                bytes,
            } => Effect::HtoDPinned {
                dst: *dst,
                host_dev: *host_dev,
                bytes: *bytes,
            },
            Effect::DtoH { dst, src, bytes } => Effect::DtoH {
                dst: *dst,
                src: *src,
                bytes: *bytes,
            },
            Effect::Free { ptr } => Effect::Free { ptr: *ptr },
            Effect::GraphAlloc { ptr, bytes } => Effect::GraphAlloc {
                ptr: *ptr,
                bytes: *bytes,
            },
            Effect::Kernel { k, args } => Effect::Kernel {
                k: *k,
                args: args.clone(),
            },
            Effect::Host(h) => Effect::Host(h.clone()),
        }
    }

    /// `cuStreamBeginCapture_v2` once the handles are checked.
    pub(super) fn begin_capture(st: &mut State, stream: Stream, mode: CaptureMode) -> Result<()> {
        if stream.is_null() {
            return Self::fail(
                st,
                ErrorCode::ERROR_STREAM_CAPTURE_UNSUPPORTED,
                "cuStreamBeginCapture_v2",
            );
        }
        if st.streams[&stream.0].capture.is_some() {
            // Measured on the H200: the nested begin fails and the outer capture stays active.
            return Self::fail(
                st,
                ErrorCode::ERROR_ILLEGAL_STATE,
                "cuStreamBeginCapture_v2",
            );
        }
        st.capture_seq += 1;
        let id = st.capture_seq;
        st.captures.insert(id, Capture::new(mode, id, stream.0));
        st.streams.get_mut(&stream.0).unwrap().capture = Some(id);
        Ok(())
    }

    /// Ends capture `id` after a failure: reservations of its allocation nodes go with it.
    fn abandon_capture(st: &mut State, id: u64) {
        Self::drop_capture(st, id);
        st.allocs
            .retain(|_, a| !(a.graph_owned && a.graph_capture == Some(id)));
    }

    /// `cuStreamEndCapture` once the handles are checked.
    pub(super) fn end_capture(st: &mut State, stream: Stream) -> Result<Graph> {
        const CALL: &str = "cuStreamEndCapture";
        let me = std::thread::current().id();
        let Some(id) = Self::capture_of(st, stream.0) else {
            return Self::fail(st, ErrorCode::ERROR_ILLEGAL_STATE, CALL);
        };
        let c = &st.captures[&id];
        if c.origin != stream.0 {
            // Ending a capture on a stream that was pulled into it, not the one that began it.
            c_invalidate(st, id);
            return Self::fail(st, ErrorCode::ERROR_STREAM_CAPTURE_UNMATCHED, CALL);
        }
        if c.mode != CaptureMode::Relaxed && c.thread != me {
            // Measured on the H200: the call fails and the capture is terminated.
            Self::abandon_capture(st, id);
            return Self::fail(st, ErrorCode::ERROR_STREAM_CAPTURE_WRONG_THREAD, CALL);
        }
        if c.invalidated {
            Self::abandon_capture(st, id);
            return Self::fail(st, ErrorCode::ERROR_STREAM_CAPTURE_INVALIDATED, CALL);
        }
        if c.unjoined().is_some() {
            // Measured on the H200: a stream forked into the capture and not joined back makes
            // the end fail with CUDA_ERROR_STREAM_CAPTURE_UNJOINED; the capture is gone.
            Self::abandon_capture(st, id);
            return Self::fail(st, ErrorCode::ERROR_STREAM_CAPTURE_UNJOINED, CALL);
        }
        let c = Self::drop_capture(st, id).unwrap();
        let gid = Self::new_id(st);
        st.graphs.insert(gid, Arc::new(c.ops));
        st.counters.live_graphs += 1;
        Ok(Graph(gid))
    }

    /// The capture rules of `cuStreamWaitEvent(stream, event)`. `Ok(true)`: handled here (a
    /// graph edge, or a stream pulled into a capture); `Ok(false)`: an ordinary wait.
    pub(super) fn capture_wait(
        &self,
        st: &mut State,
        stream: Stream,
        event: Event,
    ) -> Result<bool> {
        const CALL: &str = "cuStreamWaitEvent";
        let ev = &st.events[&event.0];
        let from = ev.captured.filter(|(c, _, _)| st.captures.contains_key(c));
        let recorded_outside = ev.captured.is_none() && ev.recorded > 0;
        match (Self::capture_of(st, stream.0), from) {
            (Some(mine), Some((theirs, src, tip))) if mine == theirs => {
                // A graph edge inside the capture: `src`'s nodes up to `tip` are joined.
                let c = st.captures.get_mut(&mine).unwrap();
                if src != stream.0 {
                    let j = c.joined.entry(src).or_insert(0);
                    *j = (*j).max(tip);
                }
                self.enqueue(st, stream, OpKind::Wait { event: 0, seq: 0 }, 0, CALL)?;
                Ok(true)
            }
            (Some(mine), Some(_)) => {
                c_invalidate(st, mine);
                Self::fail(st, ErrorCode::ERROR_STREAM_CAPTURE_MERGE, CALL)
            }
            (Some(mine), None) if recorded_outside => {
                // Measured on the H200: a capture may not depend on work outside it.
                c_invalidate(st, mine);
                Self::fail(st, ErrorCode::ERROR_STREAM_CAPTURE_ISOLATION, CALL)
            }
            // A wait on an event never recorded (or recorded in a capture that ended) is a no-op.
            (Some(_), None) => Ok(true),
            (None, Some((theirs, _, _))) => {
                // Fork: the stream joins the capture; its later work becomes graph nodes.
                let c = st.captures.get_mut(&theirs).unwrap();
                if c.invalidated {
                    return Self::fail(st, ErrorCode::ERROR_STREAM_CAPTURE_INVALIDATED, CALL);
                }
                c.forked.insert(stream.0);
                st.streams.get_mut(&stream.0).unwrap().capture = Some(theirs);
                self.enqueue(st, stream, OpKind::Wait { event: 0, seq: 0 }, 0, CALL)?;
                Ok(true)
            }
            (None, None) => Ok(ev_captured_stale(st, event)),
        }
    }
}

fn c_invalidate(st: &mut State, id: u64) {
    if let Some(c) = st.captures.get_mut(&id) {
        c.invalidated = true;
    }
}

/// Whether the event's latest record was made in a capture that has ended (the wait is then a
/// no-op, as the simulation always did).
fn ev_captured_stale(st: &State, event: Event) -> bool {
    st.events[&event.0].captured.is_some()
}

impl SimDriver {
    /// `graph_instantiate` of the [`Driver`] impl.
    pub(super) fn do_graph_instantiate(&self, graph: Graph) -> Result<GraphExec> {
        let mut st = self.enter("cuGraphInstantiateWithFlags", None, None, None)?;
        self.need_ctx(&mut st, "cuGraphInstantiateWithFlags")?;
        self.unsafe_call(&mut st, "cuGraphInstantiateWithFlags")?;
        let Some(g) = st.graphs.get(&graph.0).cloned() else {
            return Self::fail(
                &mut st,
                ErrorCode::ERROR_INVALID_VALUE,
                "cuGraphInstantiateWithFlags",
            );
        };
        let id = Self::new_id(&mut st);
        st.execs.insert(id, g);
        st.counters.live_graph_execs += 1;
        Ok(GraphExec(id))
    }

    /// `graph_launch` of the [`Driver`] impl.
    pub(super) fn do_graph_launch(&self, exec: GraphExec, stream: Stream) -> Result<()> {
        self.cost(|l| l.launch);
        let mut st = self.enter("cuGraphLaunch", Some(stream), None, None)?;
        Self::check_stream(&mut st, stream, "cuGraphLaunch")?;
        let Some(g) = st.execs.get(&exec.0).cloned() else {
            return Self::fail(&mut st, ErrorCode::ERROR_INVALID_VALUE, "cuGraphLaunch");
        };
        let dur = g.iter().map(|(_, d)| d).sum();
        self.enqueue(&mut st, stream, OpKind::Graph(g), dur, "cuGraphLaunch")
    }

    /// `graph_destroy` of the [`Driver`] impl.
    pub(super) fn do_graph_destroy(&self, graph: Graph) -> Result<()> {
        let mut st = self.enter("cuGraphDestroy", None, None, None)?;
        let Some(ops) = st.graphs.remove(&graph.0) else {
            Self::note_misuse(&mut st, format!("destroy of unknown graph {:#x}", graph.0));
            return Self::fail(&mut st, ErrorCode::ERROR_INVALID_VALUE, "cuGraphDestroy");
        };
        // Reservations of allocation nodes that never ran go with the graph.
        for (e, _) in ops.iter() {
            if let Effect::GraphAlloc { ptr, .. } = e {
                if st.allocs.get(ptr).is_some_and(|a| a.graph_owned) {
                    st.allocs.remove(ptr);
                }
            }
        }
        st.counters.live_graphs -= 1;
        Ok(())
    }
}
