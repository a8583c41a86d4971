//! Device memory: allocations hold real bytes so results can be checked; kernels, copies and
//! memsets are applied to them when they execute on the simulated GPU, and use after free is
//! recorded as misuse.

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
    Memset {
        ptr: u64,
        value: u32,
        count: usize,
    },
    HtoD {
        dst: u64,
        data: Vec<u8>,
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

pub(super) struct SimAlloc {
    pub(super) data: Vec<u8>,
    pub(super) free_pending: bool,
    /// Reserved by an allocation node during capture: usable by captured work, owned by the
    /// graph, not counted as live memory until the graph runs.
    pub(super) graph_owned: bool,
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
            Some((base, a)) => !a.free_pending && ptr + bytes as u64 <= base + a.data.len() as u64,
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

    pub(super) fn apply(st: &mut State, e: &Effect) {
        fn mem(st: &mut State, ptr: u64, bytes: usize) -> Option<&mut [u8]> {
            let (base, a) = st.allocs.range_mut(..=ptr).next_back()?;
            let off = (ptr - base) as usize;
            a.data.get_mut(off..off + bytes)
        }
        let bad = |st: &mut State, what: &str, ptr: u64| {
            st.misuse.push(format!(
                "{what} at {ptr:#x} executed on the GPU after the memory was freed"
            ))
        };
        match e {
            Effect::Work => {}
            Effect::Memset { ptr, value, count } => match mem(st, *ptr, count * 4) {
                Some(m) => {
                    for w in m.chunks_exact_mut(4) {
                        w.copy_from_slice(&value.to_ne_bytes());
                    }
                }
                None => bad(st, "memset", *ptr),
            },
            Effect::HtoD { dst, data } => match mem(st, *dst, data.len()) {
                Some(m) => m.copy_from_slice(data),
                None => bad(st, "host-to-device copy", *dst),
            },
            Effect::DtoH { dst, src, bytes } => match mem(st, *src, *bytes) {
                Some(m) => {
                    // SAFETY: `memcpy_dtoh_async`'s contract keeps `dst` valid for `bytes`
                    // writes until the copy completes, which is now.
                    unsafe { std::ptr::copy_nonoverlapping(m.as_ptr(), *dst as *mut u8, *bytes) }
                }
                None => bad(st, "device-to-host copy", *src),
            },
            Effect::Free { ptr } => match st.allocs.remove(ptr) {
                Some(a) if !a.graph_owned => {
                    st.counters.live_alloc_bytes -= a.data.len() as u64;
                    st.counters.live_allocs -= 1;
                }
                Some(_) => {}
                None => bad(st, "free", *ptr),
            },
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
                        st.allocs.insert(
                            *ptr,
                            SimAlloc {
                                data: vec![0; *bytes],
                                free_pending: false,
                                graph_owned: false,
                            },
                        );
                        true
                    }
                };
                if counted {
                    st.counters.live_alloc_bytes += *bytes as u64;
                    st.counters.live_allocs += 1;
                }
            }
            Effect::Kernel { k, args } => {
                let n = args[1] as usize;
                match k {
                    Kernel::AddOneF32 | Kernel::AddU32 => match mem(st, args[0], n * 4) {
                        Some(m) => {
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
                        None => bad(st, "kernel", args[0]),
                    },
                    Kernel::SumF32 => {
                        let n = args[2] as usize;
                        let sum: f32 = match mem(st, args[0], n * 4) {
                            Some(m) => m
                                .chunks_exact(4)
                                .map(|w| f32::from_ne_bytes(w.try_into().unwrap()))
                                .sum(),
                            None => {
                                bad(st, "kernel", args[0]);
                                return;
                            }
                        };
                        match mem(st, args[1], 4) {
                            Some(m) => {
                                let old = f32::from_ne_bytes(m[..4].try_into().unwrap());
                                m.copy_from_slice(&(old + sum).to_ne_bytes());
                            }
                            None => bad(st, "kernel", args[1]),
                        }
                    }
                }
            }
            Effect::Host(h) => {
                let f = h.lock().unwrap_or_else(|p| p.into_inner()).take();
                if let Some(f) = f {
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
                }
            }
        }
    }

    pub(super) fn device_bytes(&self, st: &State) -> u64 {
        st.counters.live_alloc_bytes + st.counters.live_streams * STREAM_BYTES
    }

    pub(super) fn note_peak(&self, st: &mut State) {
        let b = self.device_bytes(st);
        st.counters.peak_device_bytes = st.counters.peak_device_bytes.max(b);
    }

    /// Device memory in use: allocations plus 560 KiB per live stream.
    pub fn device_memory_used(&self) -> u64 {
        let st = self.lock();
        self.device_bytes(&st)
    }
}
