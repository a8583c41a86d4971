//! Device memory and the memory-ordering checker.
//!
//! * Allocations hold real bytes so results can be checked; kernels, copies and memsets are
//!   applied to them when they execute on the simulated GPU.
//! * Every effect declares the byte ranges it reads and writes ([`Effect::ranges`]). Each
//!   allocation keeps an access history; when an operation executes, each earlier access on
//!   another stream must happen before it (by the vector clocks of streams.rs) unless both are
//!   reads. On the real GPU an unordered pair is a data race whatever the timing, so it is
//!   reported (`"race: ..."`) even when the simulated durations happen to order it. A free is a
//!   write of the whole allocation. The allocation itself is a write at its stream-order point:
//!   `cuMemAllocAsync` memory may only be used in work ordered after the allocation, as CUDA's
//!   stream-ordered allocator documents.
//! * Freed ranges are kept as tombstones and pointer values are never reused, so a stale pointer
//!   is always detected (`"use-after-free: ..."`). The real stream-ordered pool does reuse
//!   blocks (across streams only when ordered, or opportunistically); an access through a stale
//!   pointer is a bug in both cases, and unique addresses make it visible.
//! * Reading bytes never written since the allocation is `"uninitialised read: ..."`.
//! * Memory reserved by a graph's allocation node belongs to the graph until a launch of the graph
//!   has executed the node; touching it from other work before is reported.

use super::*;

/// Kernels the simulation can run, by the name they have in the crate's PTX.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kernel {
    /// `csp_add_one_f32(float *x, unsigned n)`: `x[i] += 1`.
    AddOneF32,
    /// `csp_sum_f32(const float *x, float *out, unsigned n)`: `*out += sum(x)`.
    SumF32,
    /// `csp_add_u32(unsigned *x, unsigned n, unsigned v)`: `x[i] += v`.
    AddU32,
}

impl Kernel {
    pub(super) fn by_name(name: &str) -> Option<Kernel> {
        match name {
            "csp_add_one_f32" => Some(Kernel::AddOneF32),
            "csp_sum_f32" => Some(Kernel::SumF32),
            "csp_add_u32" => Some(Kernel::AddU32),
            _ => None,
        }
    }
    pub(super) fn arity(self) -> usize {
        match self {
            Kernel::AddOneF32 => 2,
            Kernel::SumF32 | Kernel::AddU32 => 3,
        }
    }
}

pub(super) enum Effect {
    Work,
    /// A test's stand-in for a kernel that reads or writes a range ([`SimDriver::enqueue_access`]).
    Access {
        ptr: u64,
        bytes: usize,
        write: bool,
    },
    Memset {
        ptr: u64,
        value: u32,
        count: usize,
    },
    HtoD {
        dst: u64,
        data: Vec<u8>,
    },
    /// A copy from page-locked host memory (`cuMemHostAlloc`): the GPU reads the source when
    /// the copy runs, not when it is enqueued (the driver stages only pageable memory), so the
    /// source must stay allocated and unchanged until then. `host_dev` is the source's
    /// simulated device address (the host allocation's key), read through the live map.
    HtoDPinned {
        dst: u64,
        host_dev: u64,
        bytes: usize,
    },
    DtoH {
        dst: usize,
        src: u64,
        bytes: usize,
    },
    Free {
        ptr: u64,
    },
    /// A graph's allocation node: (re)creates the allocation when the graph runs.
    GraphAlloc {
        ptr: u64,
        bytes: usize,
    },
    Kernel {
        k: Kernel,
        args: Vec<u64>,
    },
    Host(Arc<Mutex<Option<HostFn>>>),
}

/// One access in an allocation's history: a byte range (offsets into the allocation), the stream
/// and that stream's clock component at the access (its epoch), and a description for reports.
#[derive(Clone, Debug)]
pub(super) struct AccessRec {
    pub(super) lo: u64,
    pub(super) hi: u64,
    pub(super) stream: u64,
    pub(super) epoch: u64,
    pub(super) write: bool,
    pub(super) desc: String,
}

/// A set of bits, one per byte of an allocation: which bytes have been written.
#[derive(Clone, Debug, Default)]
pub(super) struct Bits(Vec<u64>);

impl Bits {
    pub(super) fn new(len: usize) -> Bits {
        Bits(vec![0; len.div_ceil(64)])
    }
    pub(super) fn set(&mut self, lo: usize, hi: usize) {
        let mut i = lo;
        while i < hi {
            if i % 64 == 0 && i + 64 <= hi {
                self.0[i / 64] = u64::MAX;
                i += 64;
            } else {
                self.0[i / 64] |= 1 << (i % 64);
                i += 1;
            }
        }
    }
    /// The first byte in `lo..hi` not set.
    pub(super) fn first_unset(&self, lo: usize, hi: usize) -> Option<usize> {
        let mut i = lo;
        while i < hi {
            if i % 64 == 0 && i + 64 <= hi && self.0[i / 64] == u64::MAX {
                i += 64;
            } else if self.0[i / 64] & (1 << (i % 64)) == 0 {
                return Some(i);
            } else {
                i += 1;
            }
        }
        None
    }
}

pub(super) struct SimAlloc {
    pub(super) data: Vec<u8>,
    pub(super) free_pending: bool,
    /// Reserved by an allocation node during capture: usable by captured work, owned by the
    /// graph, not counted as live memory until the graph runs.
    pub(super) graph_owned: bool,
    /// The capture whose allocation node made the reservation, if any (kept after the graph
    /// ran: the memory is then graph-allocated, which a later graph may free).
    pub(super) graph_capture: Option<u64>,
    /// Made by a graph's allocation node (which a graph may free with a free node).
    pub(super) from_graph: bool,
    /// Bytes written since the allocation (memsets, host-to-device copies, kernel writes).
    pub(super) init: Bits,
    /// Accesses not yet superseded: the writes and the reads since the last covering write.
    pub(super) hist: Vec<AccessRec>,
    /// The memory pool it came from (`MemPool(1)`, the default pool, for `cuMemAllocAsync`;
    /// the named pool for `cuMemAllocFromPoolAsync`); [`NO_POOL`] for a graph's memory, which
    /// belongs to no memory pool.
    pub(super) pool: u64,
}

/// The pool of a graph's memory (allocation nodes): none of the memory pools.
pub(super) const NO_POOL: u64 = 0;

/// The device's current memory pool, which `cuMemAllocAsync` allocates from: always the default
/// pool here (the simulation has no `cuDeviceSetMemPool`).
pub(super) const DEFAULT_POOL: u64 = 1;

impl SimAlloc {
    pub(super) fn new(bytes: usize, graph_owned: bool) -> SimAlloc {
        SimAlloc {
            data: vec![0; bytes],
            free_pending: false,
            graph_owned,
            graph_capture: None,
            from_graph: false,
            init: Bits::new(bytes),
            hist: Vec::new(),
            pool: NO_POOL,
        }
    }
}

/// What an effect does to a byte range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    Read,
    Write,
    ReadWrite,
}

impl Mode {
    fn reads(self) -> bool {
        self != Mode::Write
    }
    fn writes(self) -> bool {
        self != Mode::Read
    }
}

/// Whether a report is a finding of the memory-ordering checker (see [`SimDriver::findings`]).
pub(super) fn is_finding(m: &str) -> bool {
    m.starts_with("race:")
        || m.starts_with("use-after-free:")
        || m.starts_with("uninitialised read:")
        || m.starts_with("access to graph-owned memory before the graph ran")
}

impl Effect {
    /// The name reports use for the operation.
    pub(super) fn name(&self) -> String {
        match self {
            Effect::Work => "sim:work".into(),
            Effect::Access { write: true, .. } => "sim:access (write)".into(),
            Effect::Access { write: false, .. } => "sim:access (read)".into(),
            Effect::Memset { .. } => "cuMemsetD32Async".into(),
            Effect::HtoD { .. } | Effect::HtoDPinned { .. } => "cuMemcpyHtoDAsync".into(),
            Effect::DtoH { .. } => "cuMemcpyDtoHAsync".into(),
            Effect::Free { .. } => "cuMemFreeAsync".into(),
            Effect::GraphAlloc { .. } => "graph allocation node".into(),
            Effect::Kernel { k, .. } => format!("kernel {}", k.name()),
            Effect::Host(_) => "host function".into(),
        }
    }

    /// The device ranges the effect touches: (pointer, bytes, mode).
    pub(super) fn ranges(&self) -> Vec<(u64, usize, Mode)> {
        match self {
            Effect::Access { ptr, bytes, write } => {
                vec![(*ptr, *bytes, if *write { Mode::Write } else { Mode::Read })]
            }
            Effect::Memset { ptr, count, .. } => vec![(*ptr, count * 4, Mode::Write)],
            Effect::HtoD { dst, data } => vec![(*dst, data.len(), Mode::Write)],
            Effect::HtoDPinned { dst, bytes, .. } => vec![(*dst, *bytes, Mode::Write)],
            Effect::DtoH { src, bytes, .. } => vec![(*src, *bytes, Mode::Read)],
            Effect::Kernel { k, args } => match k {
                Kernel::AddOneF32 | Kernel::AddU32 => {
                    vec![(args[0], args[1] as usize * 4, Mode::ReadWrite)]
                }
                Kernel::SumF32 => vec![
                    (args[0], args[2] as usize * 4, Mode::Read),
                    (args[1], 4, Mode::ReadWrite),
                ],
            },
            Effect::Work | Effect::Free { .. } | Effect::GraphAlloc { .. } | Effect::Host(_) => {
                vec![]
            }
        }
    }
}

impl Kernel {
    pub(super) fn name(self) -> &'static str {
        match self {
            Kernel::AddOneF32 => "csp_add_one_f32",
            Kernel::SumF32 => "csp_sum_f32",
            Kernel::AddU32 => "csp_add_u32",
        }
    }
}

fn describe(what: &str, ex: &Exec) -> String {
    if ex.graph {
        format!("{what} (graph launched) on stream {:#x}", ex.stream)
    } else {
        format!("{what} on stream {:#x}", ex.stream)
    }
}

impl SimDriver {
    /// The allocation containing `[ptr, ptr+bytes)`, if live.
    pub(super) fn check_range(
        st: &mut State,
        ptr: u64,
        bytes: usize,
        call: &'static str,
    ) -> Result<()> {
        let ok = match st.allocs.range(..=ptr).next_back() {
            Some((base, a)) => {
                !a.free_pending
                    && ptr
                        .checked_add(bytes as u64)
                        .is_some_and(|end| end <= base + a.data.len() as u64)
            }
            None => false,
        };
        if ok {
            Ok(())
        } else {
            Self::note_misuse(
                st,
                format!("{call} on {bytes} bytes at {ptr:#x}, which is not live device memory"),
            );
            Self::fail(st, ErrorCode::ERROR_INVALID_VALUE, call)
        }
    }

    /// Measured on two H200s: an async copy on a stream of a context that is not current on the
    /// calling thread fails with CUDA_ERROR_INVALID_VALUE.
    pub(super) fn copy_context(&self, st: &mut State, s: Stream, call: &'static str) -> Result<()> {
        let want = st.streams[&s.0].ctx;
        if want != 0 && self.thread().ctx != want {
            return Self::fail(st, ErrorCode::ERROR_INVALID_VALUE, call);
        }
        Ok(())
    }

    pub(super) fn device_bytes(&self, st: &State) -> u64 {
        st.counters.live_alloc_bytes + st.counters.live_streams * STREAM_BYTES
    }

    pub(super) fn note_peak(&self, st: &mut State) {
        let b = self.device_bytes(st);
        st.counters.peak_device_bytes = st.counters.peak_device_bytes.max(b);
    }

    /// Device memory in use: allocations plus [`STREAM_BYTES`] per live stream.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{Driver, SimDriver}, Context, DeviceBuffer, ErrorCode};
    /// # use std::sync::Arc;
    /// # let sim = Arc::new(SimDriver::new());
    /// # let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// use cuda_stream_pool::driver::sim::STREAM_BYTES;
    /// let before = sim.device_memory_used();
    /// let _b = DeviceBuffer::<u8>::alloc(&s, 4096).unwrap();
    /// assert_eq!(sim.device_memory_used(), before + 4096);
    /// let next = ctx.owner();
    /// next.stream().unwrap();                        // one more stream
    /// assert_eq!(sim.device_memory_used(), before + 4096 + STREAM_BYTES);
    /// ```
    pub fn device_memory_used(&self) -> u64 {
        let st = self.lock();
        self.device_bytes(&st)
    }

    /// The base of the live allocation holding `[ptr, ptr+bytes)`.
    fn live_base(st: &State, ptr: u64, bytes: usize) -> Option<u64> {
        let (base, a) = st.allocs.range(..=ptr).next_back()?;
        (ptr + bytes as u64 <= base + a.data.len() as u64).then_some(*base)
    }

    /// Reports an access to memory that is not live: freed (use after free) or never allocated.
    fn dead_access(st: &mut State, desc: &str, ptr: u64, bytes: usize) {
        let freed = st
            .freed
            .range(..=ptr)
            .next_back()
            .filter(|(base, (len, _))| ptr < *base + *len)
            .map(|(_, (_, by))| by.clone());
        let m = match freed {
            Some(by) => format!(
                "use-after-free: {desc} touches {bytes} bytes at {ptr:#x} after the memory was \
                 freed by {by}"
            ),
            None => format!(
                "{desc} touches {bytes} bytes at {ptr:#x}, which is not device memory, on the GPU"
            ),
        };
        st.misuse.push(m);
    }

    /// Checks one access against the allocation's history (races, uninitialised reads,
    /// graph-owned memory) and records it. Returns the allocation's base when the memory is live.
    fn track(st: &mut State, ex: &Exec, what: &str, ptr: u64, bytes: usize, mode: Mode) -> bool {
        let desc = describe(what, ex);
        let Some(base) = Self::live_base(st, ptr, bytes) else {
            Self::dead_access(st, &desc, ptr, bytes);
            return false;
        };
        let mut found = Vec::new();
        let a = st.allocs.get_mut(&base).unwrap();
        if a.graph_owned && !ex.graph {
            found.push(format!(
                "access to graph-owned memory before the graph ran: {desc} touches {bytes} bytes \
                 at {ptr:#x}"
            ));
        }
        let (lo, hi) = (ptr - base, ptr - base + bytes as u64);
        if mode.reads() {
            if let Some(i) = a.init.first_unset(lo as usize, hi as usize) {
                found.push(format!(
                    "uninitialised read: {desc} reads {bytes} bytes at {ptr:#x}, but the byte at \
                     {:#x} was never written since the allocation",
                    base + i as u64
                ));
            }
        }
        for h in &a.hist {
            if h.hi <= lo || hi <= h.lo || h.stream == ex.stream {
                continue;
            }
            if !(h.write || mode.writes()) {
                continue;
            }
            if ex.vc.get(h.stream) < h.epoch {
                let kind = match (h.write, mode.writes()) {
                    (true, true) => "write/write",
                    (true, false) => "write then read",
                    _ => "read then write",
                };
                found.push(format!(
                    "race: {desc} and {} both touch {:#x} ({kind}), unordered: stream {:#x} did \
                     not wait for stream {:#x}",
                    h.desc,
                    base + lo.max(h.lo),
                    ex.stream,
                    h.stream
                ));
            }
        }
        let epoch = ex.vc.get(ex.stream);
        let rec = AccessRec {
            lo,
            hi,
            stream: ex.stream,
            epoch,
            write: mode.writes(),
            desc,
        };
        if mode.writes() {
            a.hist.retain(|h| !(lo <= h.lo && h.hi <= hi));
            a.init.set(lo as usize, hi as usize);
        } else {
            a.hist
                .retain(|h| h.write || h.stream != ex.stream || !(lo <= h.lo && h.hi <= hi));
        }
        a.hist.push(rec);
        st.misuse.extend(found);
        true
    }

    /// Executes an effect on the simulated GPU: checks and records its memory accesses, then
    /// changes the bytes.
    pub(super) fn apply(st: &mut State, e: &Effect, ex: &Exec) {
        fn mem(st: &mut State, ptr: u64, bytes: usize) -> Option<&mut [u8]> {
            let (base, a) = st.allocs.range_mut(..=ptr).next_back()?;
            let off = (ptr - base) as usize;
            a.data.get_mut(off..off + bytes)
        }
        let what = e.name();
        let mut live = true;
        for (ptr, bytes, mode) in e.ranges() {
            live &= Self::track(st, ex, &what, ptr, bytes, mode);
        }
        if !live {
            return;
        }
        match e {
            Effect::Work | Effect::Access { .. } => {}
            Effect::Memset { ptr, value, count } => {
                if let Some(m) = mem(st, *ptr, count * 4) {
                    for w in m.chunks_exact_mut(4) {
                        w.copy_from_slice(&value.to_ne_bytes());
                    }
                }
            }
            Effect::HtoD { dst, data } => {
                if let Some(m) = mem(st, *dst, data.len()) {
                    m.copy_from_slice(data)
                }
            }
            Effect::HtoDPinned {
                dst,
                host_dev,
                bytes,
            } => match st.host_mem.host_addr(*host_dev, *bytes) {
                None => st.misuse.push(format!(
                    "use-after-free: cuMemcpyHtoDAsync read page-locked host memory \
                     {host_dev:#x} ({bytes} bytes) after it was freed"
                )),
                Some(h) => {
                    // SAFETY: `h` is `bytes` bytes inside a live `cuMemHostAlloc` allocation
                    // (`host_addr` checked the range against the live map).
                    let data =
                        unsafe { std::slice::from_raw_parts(h as *const u8, *bytes) }.to_vec();
                    if let Some(m) = mem(st, *dst, *bytes) {
                        m.copy_from_slice(&data)
                    }
                }
            },
            Effect::DtoH { dst, src, bytes } => {
                if let Some(m) = mem(st, *src, *bytes) {
                    // SAFETY: `memcpy_dtoh_async`'s contract keeps `dst` valid for `bytes`
                    // writes until the copy completes, which is now.
                    unsafe { std::ptr::copy_nonoverlapping(m.as_ptr(), *dst as *mut u8, *bytes) }
                }
            }
            Effect::Free { ptr } => Self::apply_free(st, *ptr, ex),
            Effect::GraphAlloc { ptr, bytes } => {
                let counted = match st.allocs.get_mut(ptr) {
                    Some(a) if a.graph_owned => {
                        a.graph_owned = false;
                        true
                    }
                    Some(_) => {
                        st.misuse.push(format!(
                            "graph allocation at {ptr:#x} made again before it was freed"
                        ));
                        false
                    }
                    None => {
                        let mut a = SimAlloc::new(*bytes, false);
                        a.from_graph = true;
                        st.allocs.insert(*ptr, a);
                        st.freed.remove(ptr);
                        true
                    }
                };
                if counted {
                    // The node's memory is new at every run: uninitialised, and ordered after
                    // the launch only.
                    let a = st.allocs.get_mut(ptr).unwrap();
                    a.init = Bits::new(*bytes);
                    a.hist = vec![AccessRec {
                        lo: 0,
                        hi: *bytes as u64,
                        stream: ex.stream,
                        epoch: ex.vc.get(ex.stream),
                        write: true,
                        desc: describe("graph allocation node", ex),
                    }];
                    st.counters.live_alloc_bytes += *bytes as u64;
                    st.counters.live_allocs += 1;
                }
            }
            Effect::Kernel { k, args } => match k {
                Kernel::AddOneF32 | Kernel::AddU32 => {
                    let n = args[1] as usize;
                    if let Some(m) = mem(st, args[0], n * 4) {
                        for w in m.chunks_exact_mut(4) {
                            let b: [u8; 4] = w.try_into().unwrap();
                            let v = if *k == Kernel::AddOneF32 {
                                (f32::from_ne_bytes(b) + 1.0).to_ne_bytes()
                            } else {
                                u32::from_ne_bytes(b)
                                    .wrapping_add(args[2] as u32)
                                    .to_ne_bytes()
                            };
                            w.copy_from_slice(&v);
                        }
                    }
                }
                Kernel::SumF32 => {
                    let n = args[2] as usize;
                    let sum: f32 = match mem(st, args[0], n * 4) {
                        Some(m) => m
                            .chunks_exact(4)
                            .map(|w| f32::from_ne_bytes(w.try_into().unwrap()))
                            .sum(),
                        None => return,
                    };
                    if let Some(m) = mem(st, args[1], 4) {
                        let old = f32::from_ne_bytes(m[..4].try_into().unwrap());
                        m.copy_from_slice(&(old + sum).to_ne_bytes());
                    }
                }
            },
            Effect::Host(h) => {
                let f = h.lock().unwrap_or_else(|p| p.into_inner()).take();
                match f {
                    // A graph's host node runs inline (the simulation holds its lock, so it is
                    // not sent to the host-function thread).
                    Some(f) => run_host_fn(f),
                    None => st.misuse.push(
                        "host node launched twice: the real driver runs it on every launch with \
                         the same user data"
                            .into(),
                    ),
                }
            }
        }
    }

    /// A free executes: it is a write of the whole allocation, so it must be ordered after every
    /// earlier access; the range becomes a tombstone so later accesses are use after free.
    fn apply_free(st: &mut State, ptr: u64, ex: &Exec) {
        let desc = describe("cuMemFreeAsync", ex);
        let Some(a) = st.allocs.remove(&ptr) else {
            Self::dead_access(st, &desc, ptr, 0);
            return;
        };
        if a.graph_owned && !ex.graph {
            st.misuse.push(format!(
                "access to graph-owned memory before the graph ran: {desc} frees {ptr:#x}"
            ));
        }
        for h in &a.hist {
            if h.stream != ex.stream && ex.vc.get(h.stream) < h.epoch {
                st.misuse.push(format!(
                    "race: free of {ptr:#x} ({desc}) not ordered after {}: stream {:#x} did not \
                     wait for stream {:#x}",
                    h.desc, ex.stream, h.stream
                ));
            }
        }
        if !a.graph_owned {
            st.counters.live_alloc_bytes -= a.data.len() as u64;
            st.counters.live_allocs -= 1;
        }
        st.freed.insert(ptr, (a.data.len() as u64, desc));
    }
}

impl SimDriver {
    /// `mem_alloc_async` (`pool` `None`: the device's current pool) and
    /// `mem_alloc_from_pool_async` (`pool` named) of the [`Driver`] impl.
    pub(super) fn do_mem_alloc_async(
        &self,
        bytes: usize,
        stream: Stream,
        pool: Option<MemPool>,
    ) -> Result<DevicePtr> {
        let name = if pool.is_some() {
            "cuMemAllocFromPoolAsync"
        } else {
            "cuMemAllocAsync"
        };
        let n = self.lock().pool_streams;
        self.cost(|l| l.alloc + l.alloc_per_stream * n);
        let mut st = self.enter(name, Some(stream), None, None)?;
        let pool = match pool {
            None => DEFAULT_POOL,
            Some(p) if st.pools.contains_key(&p.0) => p.0,
            Some(_) => return Self::fail(&mut st, ErrorCode::ERROR_INVALID_VALUE, name),
        };
        Self::check_stream(&mut st, stream, name)?;
        if bytes == 0 {
            // Measured on the H200: a zero-byte request succeeds and returns the null pointer.
            return Ok(DevicePtr::NULL);
        }
        let cap = Self::capture_of(&st, stream.0);
        match cap {
            Some(id) if st.captures[&id].invalidated => {
                return Self::fail(&mut st, ErrorCode::ERROR_STREAM_CAPTURE_INVALIDATED, name);
            }
            Some(_) => {}
            // Measured on the H200: on a stream that is not capturing, the allocator is an
            // unsafe call under capture (capture.rs).
            None => self.unsafe_call(&mut st, name)?,
        }
        if self.device_bytes(&st) + bytes as u64 > self.cfg.total_memory {
            return Self::fail(&mut st, ErrorCode::ERROR_OUT_OF_MEMORY, name);
        }
        let p = st.next_ptr;
        st.next_ptr += (bytes as u64).div_ceil(256) * 256 + 256;
        let capturing = cap.is_some();
        let mut a = SimAlloc::new(bytes, capturing);
        a.graph_capture = cap;
        if !capturing {
            a.pool = pool;
            // The allocation is a stream-ordered operation: work on other streams must be
            // ordered after it (memory.rs).
            let vc = Self::tick_stream(&mut st, stream.0);
            a.hist.push(AccessRec {
                lo: 0,
                hi: bytes as u64,
                stream: stream.0,
                epoch: vc.get(stream.0),
                write: true,
                desc: format!("{name} on stream {:#x}", stream.0),
            });
        }
        st.allocs.insert(p, a);
        if capturing {
            // An allocation node: the graph owns the memory (see Effect::GraphAlloc).
            self.enqueue(
                &mut st,
                stream,
                OpKind::Effect(Effect::GraphAlloc { ptr: p, bytes }),
                0,
                name,
            )?;
            return Ok(DevicePtr(p));
        }
        st.counters.live_alloc_bytes += bytes as u64;
        st.counters.live_allocs += 1;
        let s = st.streams.get_mut(&stream.0).unwrap();
        let first_pool_use = !s.used_pool;
        if first_pool_use {
            s.used_pool = true;
            st.pool_streams += 1;
        }
        if let Some(c) = st.log.as_mut().and_then(|l| l.last_mut()) {
            c.ptr = Some(DevicePtr(p));
        }
        self.note_peak(&mut st);
        if first_pool_use {
            drop(st);
            self.cost(|l| l.stream_first_pool_use);
        }
        Ok(DevicePtr(p))
    }

    /// `mem_free_async` of the [`Driver`] impl.
    pub(super) fn do_mem_free_async(&self, ptr: DevicePtr, stream: Stream) -> Result<()> {
        self.cost(|l| l.alloc);
        let mut st = self.enter("cuMemFreeAsync", Some(stream), None, Some(ptr))?;
        Self::check_stream(&mut st, stream, "cuMemFreeAsync")?;
        if ptr.is_null() {
            return Ok(());
        }
        let cap = Self::capture_of(&st, stream.0);
        if cap.is_none() {
            self.unsafe_call(&mut st, "cuMemFreeAsync")?;
        }
        let capturing = cap.is_some();
        match st.allocs.get_mut(&ptr.0) {
            // A free node of a graph's own allocation: the reservation stays for the graph.
            Some(a) if a.graph_owned && capturing && a.graph_capture == cap => {}
            // Measured on the H200: freeing memory into a capture that its graph did not
            // allocate fails, and the capture stays valid.
            Some(a) if capturing && !a.from_graph => {
                return Self::fail(&mut st, ErrorCode::ERROR_INVALID_VALUE, "cuMemFreeAsync");
            }
            Some(a) if !a.free_pending => a.free_pending = true,
            Some(_) => {
                Self::note_misuse(&mut st, format!("double free of {:#x}", ptr.0));
                return Self::fail(&mut st, ErrorCode::ERROR_INVALID_VALUE, "cuMemFreeAsync");
            }
            None => {
                Self::note_misuse(&mut st, format!("free of unknown pointer {:#x}", ptr.0));
                return Self::fail(&mut st, ErrorCode::ERROR_INVALID_VALUE, "cuMemFreeAsync");
            }
        }
        let r = self.enqueue(
            &mut st,
            stream,
            OpKind::Effect(Effect::Free { ptr: ptr.0 }),
            self.free_ns.load(Ordering::Relaxed),
            "cuMemFreeAsync",
        );
        if r.is_err() {
            if let Some(a) = st.allocs.get_mut(&ptr.0) {
                a.free_pending = false;
            }
        }
        r
    }

    /// `memset_d32_async` of the [`Driver`] impl.
    pub(super) fn do_memset_d32_async(
        &self,
        dst: DevicePtr,
        value: u32,
        count: usize,
        stream: Stream,
    ) -> Result<()> {
        self.cost(|l| l.launch);
        let mut st = self.enter("cuMemsetD32Async", Some(stream), None, Some(dst))?;
        Self::check_stream(&mut st, stream, "cuMemsetD32Async")?;
        Self::check_range(&mut st, dst.0, count * 4, "cuMemsetD32Async")?;
        let dur = self.lat().map_or(0, |l| l.copy_gpu);
        self.enqueue(
            &mut st,
            stream,
            OpKind::Effect(Effect::Memset {
                ptr: dst.0,
                value,
                count,
            }),
            dur,
            "cuMemsetD32Async",
        )
    }
}
