//! The small kernels the demo and the tests launch: PTX embedded in the crate (source in
//! `src/kernels.cu`), loaded with `cuModuleLoadData`. The simulated driver implements the same
//! kernels by name.

use crate::context::Context;
use crate::driver::{Function, Module};
use crate::error::{Error, Result};
use crate::memory::DeviceBuffer;
use crate::stream::StreamRef;
use std::ffi::CStr;
use std::os::raw::c_void;

/// The PTX text, NUL-terminated for `cuModuleLoadData`.
pub const PTX: &str = concat!(include_str!("kernels.ptx"), "\0");

const BLOCK: u32 = 256;

/// The crate's kernels, loaded into one context; unloaded when dropped.
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
pub struct Kernels {
    ctx: Context,
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
    /// Loads the module into `ctx`.
    pub fn load(ctx: &Context) -> Result<Kernels> {
        let ci = &ctx.inner;
        ci.bind()?;
        let d = &ci.driver;
        let image = CStr::from_bytes_with_nul(PTX.as_bytes()).expect("PTX has one trailing NUL");
        let module = d.module_load_data(image)?;
        let get = |name: &CStr| d.module_get_function(module, name);
        let funcs = (|| {
            Ok((
                get(c"csp_add_one_f32")?,
                get(c"csp_sum_f32")?,
                get(c"csp_add_u32")?,
            ))
        })();
        match funcs {
            Ok((add_one, sum, add_u32)) => Ok(Kernels {
                ctx: ctx.clone(),
                module,
                add_one,
                sum,
                add_u32,
            }),
            Err(e) => {
                let _ = d.module_unload(module);
                Err(e)
            }
        }
    }

    fn check<T: crate::DeviceCopy>(&self, s: &StreamRef, b: &DeviceBuffer<T>) -> Result<()> {
        if !self.ctx.same(s.context()) || !self.ctx.same(b.context()) {
            return Err(Error::invalid(
                "kernels, stream and buffer of different contexts",
            ));
        }
        b.use_on(s)
    }

    fn launch(
        &self,
        f: Function,
        s: &StreamRef,
        n: usize,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let (g, _) = grid(n)?;
        // The function belongs to this context's module: launch with the context current.
        self.ctx.inner.bind()?;
        // SAFETY: every caller passes pointers to values of the kernel's parameter types (a
        // device pointer as u64, then u32s), and the device ranges are whole buffers of at least
        // `n` elements, ordered on `s` by `check`.
        unsafe {
            self.ctx
                .inner
                .driver
                .launch_kernel(f, g, [BLOCK, 1, 1], 0, s.raw(), params)
        }
    }

    /// `x[i] += 1` on `s`.
    pub fn add_one(&self, s: &StreamRef, x: &DeviceBuffer<f32>) -> Result<()> {
        self.check(s, x)?;
        let (_, n) = grid(x.len())?;
        let (mut p, mut n2) = (x.as_raw().0, n);
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
    pub fn sum(&self, s: &StreamRef, x: &DeviceBuffer<f32>, out: &DeviceBuffer<f32>) -> Result<()> {
        self.check(s, x)?;
        self.check(s, out)?;
        let (_, n) = grid(x.len())?;
        let (mut px, mut po, mut n2) = (x.as_raw().0, out.as_raw().0, n);
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
    pub fn add_u32(&self, s: &StreamRef, x: &DeviceBuffer<u32>, v: u32) -> Result<()> {
        self.check(s, x)?;
        let (_, n) = grid(x.len())?;
        let (mut p, mut n2, mut v2) = (x.as_raw().0, n, v);
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

impl Drop for Kernels {
    fn drop(&mut self) {
        let _ = self.ctx.inner.driver.module_unload(self.module);
    }
}
