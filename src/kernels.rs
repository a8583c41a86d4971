//! The small kernels the demo and the tests launch: PTX embedded in the crate (source in
//! `src/kernels.cu`), loaded with `cuModuleLoadData`. The simulated driver implements the same
//! kernels by name.

use crate::context::Context;
use crate::ctx_ref::CtxRef;
use crate::driver::{Function, Module};
use crate::error::{Error, Result};
use crate::memory::{BufferUse, DeviceBuffer};
use crate::stream::StreamRef;
use std::ffi::CStr;
use std::os::raw::c_void;

/// The PTX text, NUL-terminated for `cuModuleLoadData`.
pub const PTX: &str = concat!(include_str!("kernels.ptx"), "\0");

const BLOCK: u32 = 256;

/// The crate's kernels in one context (the module loaded once per context, unloaded with it).
///
/// ```
/// use cuda_stream_pool::{driver, kernels::Kernels, Context, DeviceBuffer};
/// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// let ctx = Context::primary(drv, 0).unwrap();
/// let k = Kernels::load(&ctx).unwrap();
/// let owner = ctx.owner();
/// let s = owner.stream().unwrap();
/// let x = DeviceBuffer::<f32>::zeroed(&s, 1024).unwrap();
/// let sum = DeviceBuffer::<f32>::zeroed(&s, 1).unwrap();
/// k.add_one(&s, &x).unwrap();
/// k.sum(&s, &x, &sum).unwrap();
/// assert_eq!(sum.to_vec(&s).unwrap(), vec![1024.0]);
/// ```
///
/// The module is loaded once per context (a second `load` finds it) and unloaded by the
/// context's teardown, once every stream's work has completed: a `Kernels`, and a graph that
/// captured one of its kernels, keep the context alive. (Unloading earlier would mean waiting
/// for the whole context with `cuCtxSynchronize`, which invalidates every capture in progress on
/// it, in any thread and any mode.)
pub struct Kernels {
    ctx: CtxRef,
    module: Module,
    add_one: Function,
    sum: Function,
    add_u32: Function,
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernels")
            .field("module", &self.module)
            .finish()
    }
}

fn grid(n: usize) -> Result<([u32; 3], u32)> {
    let n = u32::try_from(n).map_err(|_| Error::invalid("kernel length exceeds u32"))?;
    Ok(([n.div_ceil(BLOCK).max(1), 1, 1], n))
}

impl Kernels {
    /// The crate's kernels in `ctx`: the module is loaded by the first call for the context
    /// and unloaded with it.
    ///
    /// ```
    /// use cuda_stream_pool::{driver::SimDriver, kernels::Kernels, Context};
    /// use std::sync::Arc;
    /// let sim = Arc::new(SimDriver::new());
    /// let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// let k = Kernels::load(&ctx).unwrap();
    /// let again = Kernels::load(&ctx).unwrap();         // the same module
    /// assert_eq!(sim.counters().live_modules, 1);
    /// drop((k, again));
    /// assert_eq!(sim.counters().live_modules, 1);     // loaded while the context lives
    /// drop(ctx);
    /// assert_eq!(sim.counters().live_modules, 0);
    /// ```
    ///
    /// # Errors
    /// The driver's error when the module cannot be loaded (e.g.
    /// `CUDA_ERROR_UNSUPPORTED_PTX_VERSION` on a driver older than the PTX) or when one of its
    /// kernels is missing.
    ///
    /// # Panics
    /// Never: the embedded PTX ends with its one NUL byte (checked by every test that loads it).
    pub fn load(ctx: &Context) -> Result<Kernels> {
        let ci = &ctx.inner;
        // One scope: the context current and relaxed mode (a module load invalidates captures
        // otherwise) once for the load and the lookups.
        let _scope = ci.scope();
        let d = &ci.driver;
        let image: &'static CStr =
            CStr::from_bytes_with_nul(PTX.as_bytes()).expect("PTX has one trailing NUL");
        let module = ci.module(image)?;
        // SAFETY: the module is loaded and stays loaded while the context's state lives.
        let get = |name: &CStr| unsafe { d.module_get_function(module, name) };
        Ok(Kernels {
            ctx: CtxRef::new(ctx),
            module,
            add_one: get(c"csp_add_one_f32")?,
            sum: get(c"csp_sum_f32")?,
            add_u32: get(c"csp_add_u32")?,
        })
    }

    /// Begins the buffer's use on `s`; the kernel is launched while the guard lives, so the use
    /// is recorded after the launch.
    fn use_on<'b, T: crate::DeviceCopy>(
        &self,
        s: &'b StreamRef<'_>,
        b: &'b DeviceBuffer<T>,
    ) -> Result<BufferUse<'b>> {
        self.same_context(s, b)?;
        b.use_on(s)
    }

    fn same_context<T: crate::DeviceCopy>(
        &self,
        s: &StreamRef<'_>,
        b: &DeviceBuffer<T>,
    ) -> Result<()> {
        if !self.ctx.same(s.context()) || !self.ctx.same(b.context()) {
            return Err(Error::invalid(
                "kernels, stream and buffer of different contexts",
            ));
        }
        Ok(())
    }

    fn launch(
        &self,
        f: Function,
        s: &StreamRef<'_>,
        n: usize,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let (g, _) = grid(n)?;
        let ci = &self.ctx.inner;
        // The function belongs to this context's module, loaded while the context lives (a
        // graph that captures the launch keeps the context): launched with the context current
        // (the device rules). SAFETY: every caller passes pointers to values of the kernel's parameter types (a
        // device pointer as u64, then u32s); the device ranges are whole buffers of at least `n`
        // elements, kept alive and ordered on `s` by the callers' live `BufferUse` guards; `s`
        // is held by its reference's holder (a launch into a capture becomes a node, and the
        // capture keeps the buffers).
        unsafe {
            ci.driver
                .launch_kernel(f, g, [BLOCK, 1, 1], 0, s.enqueue_handle(), params)
        }
    }

    /// `x[i] += 1` on `s`.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, kernels::Kernels, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// let k = Kernels::load(&ctx).unwrap();
    /// let x = DeviceBuffer::from_slice(&s, &[1.0f32, 2.0]).unwrap();
    /// k.add_one(&s, &x).unwrap();
    /// assert_eq!(x.to_vec(&s).unwrap(), vec![2.0, 3.0]);
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for objects of different contexts or a buffer longer than
    /// `u32::MAX`; as [`DeviceBuffer::use_on`]; the driver's error.
    pub fn add_one(&self, s: &StreamRef<'_>, x: &DeviceBuffer<f32>) -> Result<()> {
        let (_, n) = grid(x.len())?;
        let u = self.use_on(s, x)?;
        let (mut p, mut n2) = (u.ptr().0, n);
        self.launch(
            self.add_one,
            s,
            x.len(),
            &mut [
                &mut p as *mut u64 as *mut c_void,
                &mut n2 as *mut u32 as *mut c_void,
            ],
        )
    }

    /// `out[0] += sum(x)` on `s`.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, kernels::Kernels, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// let k = Kernels::load(&ctx).unwrap();
    /// let x = DeviceBuffer::from_slice(&s, &[1.0f32, 2.0, 3.0]).unwrap();
    /// let out = DeviceBuffer::from_slice(&s, &[10.0f32]).unwrap();
    /// k.sum(&s, &x, &out).unwrap();
    /// assert_eq!(out.to_vec(&s).unwrap(), vec![16.0]);
    /// assert!(k.sum(&s, &x, &x).is_err());          // one buffer twice
    /// ```
    ///
    /// # Errors
    /// As [`Kernels::add_one`]; [`Error::InvalidArgument`] when `x` and `out` are one buffer.
    pub fn sum(
        &self,
        s: &StreamRef<'_>,
        x: &DeviceBuffer<f32>,
        out: &DeviceBuffer<f32>,
    ) -> Result<()> {
        let (_, n) = grid(x.len())?;
        self.same_context(s, x)?;
        self.same_context(s, out)?;
        // Both uses at once, locks in a global order: no deadlock with a thread summing into
        // `x` from `out`.
        let uses = DeviceBuffer::use_all(s, &[x, out])?;
        let (mut px, mut po, mut n2) = (uses[0].ptr().0, uses[1].ptr().0, n);
        self.launch(
            self.sum,
            s,
            x.len(),
            &mut [
                &mut px as *mut u64 as *mut c_void,
                &mut po as *mut u64 as *mut c_void,
                &mut n2 as *mut u32 as *mut c_void,
            ],
        )
    }

    /// `x[i] += v` on `s`.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, kernels::Kernels, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// let k = Kernels::load(&ctx).unwrap();
    /// let x = DeviceBuffer::from_slice(&s, &[1u32, 2, 3]).unwrap();
    /// k.add_u32(&s, &x, 10).unwrap();
    /// assert_eq!(x.to_vec(&s).unwrap(), vec![11, 12, 13]);
    /// ```
    ///
    /// # Errors
    /// As [`Kernels::add_one`].
    pub fn add_u32(&self, s: &StreamRef<'_>, x: &DeviceBuffer<u32>, v: u32) -> Result<()> {
        let (_, n) = grid(x.len())?;
        let u = self.use_on(s, x)?;
        let (mut p, mut n2, mut v2) = (u.ptr().0, n, v);
        self.launch(
            self.add_u32,
            s,
            x.len(),
            &mut [
                &mut p as *mut u64 as *mut c_void,
                &mut n2 as *mut u32 as *mut c_void,
                &mut v2 as *mut u32 as *mut c_void,
            ],
        )
    }
}
