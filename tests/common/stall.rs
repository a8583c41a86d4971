//! A GPU-side wait on host-mapped memory (`cuStreamWaitValue32`), and a watchdog that releases it:
//! the setting in which `cuStreamCreate` blocked on the H200 (see `SimConfig::create_stall_at`).

use cuda_stream_pool::driver::{host_alloc_flags, DevicePtr, Driver, SimDriver, Stream, WaitValue};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A 32-bit word of host-mapped memory that streams wait on.
pub struct HostWord {
    d: Arc<dyn Driver>,
    host: *mut u8,
    dev: DevicePtr,
}

// SAFETY: the word is only accessed atomically; the pointer is freed once, by `Drop`.
unsafe impl Send for HostWord {}
// SAFETY: as above.
unsafe impl Sync for HostWord {}

impl HostWord {
    pub fn new(d: &Arc<dyn Driver>) -> HostWord {
        let host = d
            .mem_host_alloc(64, host_alloc_flags::DEVICEMAP | host_alloc_flags::PORTABLE)
            .unwrap();
        // SAFETY: `host` is a live allocation just made.
        let dev = unsafe { d.mem_host_get_device_pointer(host) }.unwrap();
        HostWord {
            d: d.clone(),
            host,
            dev,
        }
    }

    fn word(&self) -> &AtomicU32 {
        // SAFETY: a live, page-aligned allocation of 64 bytes; accessed only atomically.
        unsafe { &*(self.host as *const AtomicU32) }
    }

    /// Holds `s` (later work included) until the word reaches `value`.
    ///
    /// # Safety
    /// `s` must be a live stream that is not capturing, and the word must be set to `value`
    /// (or more) before the stream is synchronized or destroyed, and before `self` is dropped.
    pub unsafe fn hold(&self, s: Stream, value: u32) {
        // SAFETY: the caller's contract; the word lives until `self` is dropped.
        unsafe {
            self.d
                .stream_wait_value32(s, self.dev, value, WaitValue::Geq)
        }
        .unwrap();
    }

    /// Releases the waits up to `value`.
    pub fn set(&self, value: u32) {
        self.word().store(value, Ordering::Release);
    }
}

impl Drop for HostWord {
    fn drop(&mut self) {
        // SAFETY: allocated by `new`, freed once; the caller synchronized the streams that
        // waited on it (`hold`'s contract).
        let _ = unsafe { self.d.mem_free_host(self.host) };
    }
}

/// When the watchdog releases the wait.
pub enum Trigger {
    /// As soon as a create is blocked in the simulation (its state, not time), or the work ends.
    Sim(Arc<SimDriver>),
    /// After this long, or when the work ends (the GPU).
    After(Duration),
}

impl Trigger {
    fn wait(&self, done: &AtomicBool) {
        match self {
            Trigger::Sim(sim) => {
                while !done.load(Ordering::Acquire) && sim.blocked_creates() == 0 {
                    std::thread::yield_now();
                }
            }
            Trigger::After(t) => {
                let t0 = Instant::now();
                while !done.load(Ordering::Acquire) && t0.elapsed() < *t {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }
}

/// Runs `work` on another thread while `word` holds a stream below `value`; the watchdog sets the
/// word to `value` when `trigger` fires (or the work ended). `work` gets a flag that is set just
/// before the release: a step that sees it set after it returned was blocked until the release.
pub fn with_watchdog<R: Send + 'static>(
    word: &HostWord,
    value: u32,
    trigger: &Trigger,
    work: impl FnOnce(Arc<AtomicBool>) -> R + Send + 'static,
) -> R {
    let released = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicBool::new(false));
    let h = {
        let (released, done) = (released.clone(), done.clone());
        std::thread::spawn(move || {
            let r = work(released);
            done.store(true, Ordering::Release);
            r
        })
    };
    trigger.wait(&done);
    released.store(true, Ordering::Release);
    word.set(value);
    h.join().unwrap()
}
