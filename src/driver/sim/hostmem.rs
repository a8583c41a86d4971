//! Host-mapped memory and stream memory operations.
//!
//! * `cuMemHostAlloc` returns real, zero-filled, page-aligned host memory; its device address
//!   (`cuMemHostGetDevicePointer_v2`) is a separate simulated address range, so code that assumed
//!   the two are equal (true on the H200 with unified addressing, not guaranteed) is caught.
//! * `cuStreamWriteValue64_v2` is an operation of the stream: the 64-bit store into the host
//!   memory happens when the simulated stream reaches and completes it (in stream order, after the
//!   earlier work), with release ordering, so a host thread that reads the word with acquire
//!   ordering sees the earlier work's host-visible effects (copies into host memory).
//! * `cuStreamWaitValue32_v2` holds the stream at that point until the 32-bit word satisfies the
//!   condition. Host writes are not driver calls, so the simulation notices a write at its next
//!   driver call or [`SimDriver::advance`]; it is independent of the simulated time. A waiting
//!   call (`cuStreamSynchronize`, ...) behind an unsatisfied wait polls the word (real time,
//!   1 ms steps) and reports a deadlock after 10 s.
//! * Both are refused in a capture (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, the capture is
//!   invalidated): stricter than CUDA, which captures them as memory-operation nodes; the crate
//!   never enqueues them into a capture.
//! * Freeing host memory that a pending write or wait still targets, and a write or wait that
//!   lands in freed memory, are misuse.
//!
//! * A landed write is a host observation of the work before it for the race detector (see
//!   streams.rs): the crate's completion hub reads such words and then hands a stream on without
//!   a query, and the frees that follow on the disposal stream are ordered by that read.

use super::*;
use std::alloc::Layout;
use std::sync::atomic::{AtomicU32, AtomicU64};

/// Where simulated device addresses of host-mapped memory start (below device allocations).
const HOST_DEV_BASE: u64 = 0x6000_0000_0000;
const PAGE: usize = 4096;

/// One `cuMemHostAlloc` allocation.
pub(super) struct HostAlloc {
    /// The host address (the start of a `std::alloc` allocation of `layout`).
    pub(super) addr: usize,
    pub(super) layout: Layout,
    pub(super) bytes: usize,
}

/// Host-mapped allocations by device base address, and device base by host address.
#[derive(Default)]
pub(super) struct HostMem {
    pub(super) by_dev: BTreeMap<u64, HostAlloc>,
    pub(super) by_host: BTreeMap<usize, u64>,
    pub(super) next_dev: u64,
}

impl HostMem {
    /// The host address of `len` bytes at device address `dev`, when they lie in a live
    /// allocation.
    pub(super) fn host_addr(&self, dev: u64, len: usize) -> Option<usize> {
        let (base, a) = self.by_dev.range(..=dev).next_back()?;
        let off = (dev - base) as usize;
        (off + len <= a.bytes).then_some(a.addr + off)
    }

    /// The device address of `len` bytes at host address `host`, when they lie in a live
    /// allocation.
    pub(super) fn dev_addr(&self, host: usize, len: usize) -> Option<u64> {
        let (base, dev) = self.by_host.range(..=host).next_back()?;
        let off = host - base;
        (off + len <= self.by_dev[dev].bytes).then_some(dev + off as u64)
    }

    /// The current 32-bit word at device address `dev`.
    pub(super) fn load32(&self, dev: u64) -> Option<u32> {
        let h = self.host_addr(dev, 4)?;
        // SAFETY: `h` lies in a live allocation of ours (checked above), 4-byte aligned (checked
        // by the call that enqueued the wait); the host may write it concurrently, so it is read
        // atomically.
        Some(unsafe { &*(h as *const AtomicU32) }.load(Ordering::Acquire))
    }

    /// Frees every allocation (the simulation is being dropped).
    pub(super) fn release_all(&mut self) {
        for (_, a) in std::mem::take(&mut self.by_dev) {
            // SAFETY: allocated by `mem_host_alloc` with this layout and not yet freed.
            unsafe { std::alloc::dealloc(a.addr as *mut u8, a.layout) };
        }
        self.by_host.clear();
    }
}

impl SimDriver {
    pub(super) fn do_mem_host_alloc(&self, bytes: usize, flags: u32) -> Result<*mut u8> {
        let mut st = self.enter("cuMemHostAlloc", None, None, None)?;
        self.need_ctx(&mut st, "cuMemHostAlloc")?;
        self.unsafe_call(&mut st, "cuMemHostAlloc")?;
        if bytes == 0 || flags & !0x7 != 0 {
            return Self::fail(&mut st, ErrorCode::ERROR_INVALID_VALUE, "cuMemHostAlloc");
        }
        let Ok(layout) = Layout::from_size_align(bytes.next_multiple_of(PAGE), PAGE) else {
            return Self::fail(&mut st, ErrorCode::ERROR_OUT_OF_MEMORY, "cuMemHostAlloc");
        };
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            return Self::fail(&mut st, ErrorCode::ERROR_OUT_OF_MEMORY, "cuMemHostAlloc");
        }
        let hm = &mut st.host_mem;
        let dev = HOST_DEV_BASE + hm.next_dev;
        hm.next_dev += layout.size() as u64 + PAGE as u64;
        hm.by_dev.insert(
            dev,
            HostAlloc {
                addr: p as usize,
                layout,
                bytes,
            },
        );
        hm.by_host.insert(p as usize, dev);
        st.counters.live_host_allocs += 1;
        Ok(p)
    }

    pub(super) fn do_mem_host_get_device_pointer(&self, host: *mut u8) -> Result<DevicePtr> {
        const CALL: &str = "cuMemHostGetDevicePointer_v2";
        let mut st = self.enter(CALL, None, None, None)?;
        let h = host as usize;
        let found = st
            .host_mem
            .by_host
            .range(..=h)
            .next_back()
            .map(|(b, d)| (*b, *d));
        match found {
            Some((base, dev)) if h - base < st.host_mem.by_dev[&dev].bytes => {
                Ok(DevicePtr(dev + (h - base) as u64))
            }
            _ => {
                Self::note_misuse(
                    &mut st,
                    format!("{CALL} of {h:#x}, not in live host-mapped memory"),
                );
                Self::fail(&mut st, ErrorCode::ERROR_INVALID_VALUE, CALL)
            }
        }
    }

    pub(super) fn do_mem_free_host(&self, host: *mut u8) -> Result<()> {
        let mut st = self.enter("cuMemFreeHost", None, None, None)?;
        // Treated as `cuMemHostAlloc` is (a call of the invalidation table): not measured on the
        // H200, where a free that waits for every stream of the device would be at least as
        // harmful to a capture (so the simulation is the stricter of the two).
        self.unsafe_call(&mut st, "cuMemFreeHost")?;
        let h = host as usize;
        let Some(dev) = st.host_mem.by_host.remove(&h) else {
            Self::note_misuse(
                &mut st,
                format!("cuMemFreeHost of {h:#x}: not a live host allocation (double free?)"),
            );
            return Self::fail(&mut st, ErrorCode::ERROR_INVALID_VALUE, "cuMemFreeHost");
        };
        self.note_device_wait(&mut st, "cuMemFreeHost");
        let a = st.host_mem.by_dev.remove(&dev).expect("indexed both ways");
        let end = dev + a.bytes as u64;
        let pending = st.streams.values().any(|s| {
            s.queue.iter().any(|op| match op.kind {
                OpKind::WriteValue { addr, .. } | OpKind::WaitValue { addr, .. } => {
                    (dev..end).contains(&addr)
                }
                OpKind::Effect(Effect::HtoDPinned { host_dev, .. }) => {
                    (dev..end).contains(&host_dev)
                }
                _ => false,
            })
        });
        if pending {
            Self::note_misuse(
                &mut st,
                format!(
                    "host memory {h:#x} freed while a stream write, wait or copy on it is pending"
                ),
            );
        }
        // SAFETY: allocated by `do_mem_host_alloc` with this layout; removed from the maps, so
        // freed once. Pending operations that target it find it gone (and report misuse).
        unsafe { std::alloc::dealloc(a.addr as *mut u8, a.layout) };
        st.counters.live_host_allocs -= 1;
        Ok(())
    }

    fn check_memop(
        &self,
        st: &mut State,
        stream: Stream,
        addr: DevicePtr,
        align: u64,
        call: &'static str,
    ) -> Result<()> {
        Self::check_stream(st, stream, call)?;
        Self::not_capturing(st, stream, call)?;
        if addr.0 % align != 0 || st.host_mem.host_addr(addr.0, align as usize).is_none() {
            Self::note_misuse(
                st,
                format!(
                    "{call} at {:#x}: not live host-mapped memory (or misaligned)",
                    addr.0
                ),
            );
            return Self::fail(st, ErrorCode::ERROR_INVALID_VALUE, call);
        }
        Ok(())
    }

    pub(super) fn do_stream_write_value64(
        &self,
        stream: Stream,
        addr: DevicePtr,
        value: u64,
    ) -> Result<()> {
        const CALL: &str = "cuStreamWriteValue64_v2";
        self.cost(|l| l.launch);
        let mut st = self.enter(CALL, Some(stream), None, Some(addr))?;
        self.check_memop(&mut st, stream, addr, 8, CALL)?;
        self.enqueue(
            &mut st,
            stream,
            OpKind::WriteValue {
                addr: addr.0,
                value,
            },
            0,
            CALL,
        )
    }

    pub(super) fn do_stream_wait_value32(
        &self,
        stream: Stream,
        addr: DevicePtr,
        value: u32,
        cond: WaitValue,
    ) -> Result<()> {
        const CALL: &str = "cuStreamWaitValue32_v2";
        self.cost(|l| l.launch);
        let mut st = self.enter(CALL, Some(stream), None, Some(addr))?;
        self.check_memop(&mut st, stream, addr, 4, CALL)?;
        self.enqueue(
            &mut st,
            stream,
            OpKind::WaitValue {
                addr: addr.0,
                value,
                cond,
            },
            0,
            CALL,
        )
    }

    /// A stream write lands: stores `value` at `addr` (called when the operation completes).
    pub(super) fn land_write(st: &mut State, addr: u64, value: u64) {
        match st.host_mem.host_addr(addr, 8) {
            // SAFETY: a live allocation of ours, 8-byte aligned (checked when enqueued); host
            // threads may read it concurrently, so it is written atomically.
            Some(h) => unsafe { &*(h as *const AtomicU64) }.store(value, Ordering::Release),
            None => Self::note_misuse(
                st,
                format!("cuStreamWriteValue64_v2 landed in freed host memory at {addr:#x}"),
            ),
        }
    }

    /// Whether a stream wait on `addr` may pass now (a wait on freed memory passes, reported as
    /// misuse when it completes).
    pub(super) fn wait_passes(hm: &HostMem, addr: u64, value: u32, cond: WaitValue) -> bool {
        hm.load32(addr).is_none_or(|w| cond.holds(w, value))
    }
}
