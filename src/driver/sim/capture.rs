//! Stream capture and graphs: capture modes per thread, which calls invalidate which capture
//! (as measured on the H200), and the capture of operations into a graph that replays them on
//! every launch.

use super::*;

pub(super) struct Capture {
    pub(super) mode: CaptureMode,
    pub(super) id: u64,
    pub(super) thread: ThreadId,
    pub(super) ops: Vec<(Effect, u64)>,
    pub(super) invalidated: bool,
}

#[derive(Clone, Copy)]
pub(super) struct ThreadState {
    pub(super) mode: CaptureMode,
    pub(super) ctx: u64,
}

thread_local! {
    pub(super) static THREAD: std::cell::RefCell<HashMap<u64, ThreadState>> =
        std::cell::RefCell::new(HashMap::new());
}

impl SimDriver {
    pub(super) fn thread(&self) -> ThreadState {
        THREAD.with(|t| {
            *t.borrow_mut().entry(self.id).or_insert(ThreadState {
                mode: CaptureMode::Global,
                ctx: 0,
            })
        })
    }

    pub(super) fn set_thread(&self, f: impl FnOnce(&mut ThreadState)) {
        THREAD.with(|t| {
            let mut m = t.borrow_mut();
            let e = m.entry(self.id).or_insert(ThreadState {
                mode: CaptureMode::Global,
                ctx: 0,
            });
            f(e)
        })
    }

    /// Rules for "potentially unsafe" calls (queries and synchronizations) under capture: the
    /// calling thread in global mode conflicts with any global capture of another thread, and
    /// any thread not in relaxed mode conflicts with its own non-relaxed captures. Conflicting
    /// captures are invalidated and the call fails.
    pub(super) fn unsafe_call(&self, st: &mut State, call: &'static str) -> Result<()> {
        let me = std::thread::current().id();
        let mode = self.thread().mode;
        if mode == CaptureMode::Relaxed {
            return Ok(());
        }
        let mut hit = false;
        for s in st.streams.values_mut() {
            if let Some(c) = s.capture.as_mut() {
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
        if hit {
            return Self::fail(st, ErrorCode::ERROR_STREAM_CAPTURE_UNSUPPORTED, call);
        }
        Ok(())
    }

    /// Querying or synchronizing a capturing stream is illegal and invalidates its capture.
    pub(super) fn not_capturing(st: &mut State, s: Stream, call: &'static str) -> Result<()> {
        if let Some(c) = st.streams.get_mut(&s.0).and_then(|x| x.capture.as_mut()) {
            c.invalidated = true;
            return Self::fail(st, ErrorCode::ERROR_STREAM_CAPTURE_UNSUPPORTED, call);
        }
        Ok(())
    }

    pub(super) fn clone_effect(e: &Effect) -> Effect {
        match e {
            Effect::Work => Effect::Work,
            Effect::Memset { ptr, value, count } => Effect::Memset {
                ptr: *ptr,
                value: *value,
                count: *count,
            },
            Effect::HtoD { dst, data } => Effect::HtoD {
                dst: *dst,
                data: data.clone(),
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
}
