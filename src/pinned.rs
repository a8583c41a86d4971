//! Page-locked host memory that the crate does not free while the process runs.
//!
//! `cuMemFreeHost` waits for the work of every stream of the device, and while it waits it
//! holds a lock of the driver that every other thread's call in the context needs (measured on
//! the H200: `tests/differential_implicit_sync.rs`, `tests/differential_stall_others.rs`). A
//! context's teardown that freed its completion slabs and staging blocks could therefore wait
//! for other libraries' work, and deadlock the process when a stream waits for the host (a
//! flag that a thread writes after its next driver call, as NCCL's proxies do): the writer's
//! call waits for the lock, the free for the writer. So a teardown puts its blocks on a shelf
//! of the CUDA context instead, and later states of that context take them from there. The
//! shelf keeps the primary context retained while it holds blocks (they live as long as their
//! context); [`release_pinned_cache`] frees them when the program asks, as PyTorch's caching
//! host allocator does.
//!
//! Only primary contexts have a shelf (an adopted one too when it is adopted with what keeps it
//! alive, as cudarc's are; see [`crate::Context::adopt`]): a context that
//! its creator destroys once the crate's state for it is gone would take its blocks with it, so
//! the teardown of such a state frees them (and waits).

use crate::driver::{self, Device, Driver};
use crate::error::Result;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// Where blocks come from and go back to: a CUDA context of a driver.
#[derive(Clone)]
pub(crate) struct Home {
    /// The context's driver behind the device rules (the context set): the hub frees through
    /// it.
    pub(crate) driver: Arc<dyn Driver>,
    /// The context's driver as given (under no rules): a shelf makes rules of its own on it
    /// (see [`shelf_driver`]).
    pub(crate) raw: Arc<dyn Driver>,
    /// The world of the driver under the device rules ([`Driver::world`]): the contexts and
    /// memory it shares with other driver objects (every instance of the real driver).
    pub(crate) world: usize,
    pub(crate) ctx: driver::Context,
    pub(crate) device: Device,
    /// Whether `ctx` may be the device's primary context: a state of the primary context, or
    /// an adopted one kept alive by another crate's handle (cudarc's contexts are primary).
    /// Only then does a teardown ask whether it is (`cuDevicePrimaryCtxGetState`, then a
    /// retain only if the primary context is active: a retain would activate an inactive one).
    pub(crate) maybe_primary: bool,
}

impl std::fmt::Debug for Home {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Home")
            .field("ctx", &self.ctx)
            .finish_non_exhaustive()
    }
}

/// A block of page-locked host memory: its address, size and `cuMemHostAlloc` flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    pub(crate) host: usize,
    pub(crate) bytes: usize,
    pub(crate) flags: u32,
}

struct Shelf {
    /// Frees through it (device rules of its own, with the shelf's context set: the state that
    /// shelved the blocks is gone, and its rules make calls in no context any more); keeps the
    /// driver alive (and so a world that is an address unique).
    driver: Arc<dyn Driver>,
    world: usize,
    ctx: driver::Context,
    device: Device,
    blocks: Vec<Block>,
    /// Retains of the device's primary context that the shelf holds: one while it has blocks,
    /// plus any that could not be released ([`keep_retain`]); released by
    /// [`release_pinned_cache`].
    retains: usize,
}

/// The driver a shelf of `ctx` frees and releases through: `raw` behind device rules of its own
/// whose context is `ctx`, so that each free is made with its context current (and in relaxed
/// capture mode), and the caller's thread state restored after it.
fn shelf_driver(raw: &Arc<dyn Driver>, ctx: driver::Context) -> Arc<dyn Driver> {
    let hooked = driver::Hooked {
        inner: raw.clone(),
        hook: driver::DeviceRules::new(raw.clone()),
    };
    hooked.hook.set_context(ctx);
    Arc::new(hooked)
}

fn shelves() -> MutexGuard<'static, Vec<Shelf>> {
    static SHELVES: OnceLock<Mutex<Vec<Shelf>>> = OnceLock::new();
    // No user code and no driver call runs under this lock, so it is never poisoned by a
    // panic of the crate's; a poisoned one is still consistent (every change is one push or
    // one removal).
    SHELVES
        .get_or_init(|| Mutex::new(Vec::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// A shelved block of `home`'s context with this size and flags, if there is one.
pub(crate) fn take(home: &Home, bytes: usize, flags: u32) -> Option<Block> {
    let mut sh = shelves();
    let shelf = sh
        .iter_mut()
        .find(|s| s.world == home.world && s.ctx == home.ctx)?;
    let i = shelf
        .blocks
        .iter()
        .position(|b| b.bytes == bytes && b.flags == flags)?;
    Some(shelf.blocks.swap_remove(i))
}

/// Puts `blocks` (no longer used by anyone, no write to them pending) on the shelf of `home`'s
/// context; the first block of a shelf retains the primary context. Returns the blocks it
/// could not shelve (those of a context that is not the device's primary one, such as a
/// context the caller created and adopted, or all of them when the retain failed): the caller
/// frees those.
pub(crate) fn give(home: &Home, blocks: Vec<Block>) -> Vec<Block> {
    if blocks.is_empty() || !home.maybe_primary {
        return blocks;
    }
    {
        let mut sh = shelves();
        if let Some(s) = sh
            .iter_mut()
            .find(|s| s.world == home.world && s.ctx == home.ctx)
        {
            s.blocks.extend(blocks);
            return Vec::new();
        }
    }
    // An inactive primary context is not `home.ctx` (which is alive): no retain then, which
    // would activate (create) it. (A primary context released by its last holder between
    // this question and the retain below is activated again, and released at once.)
    match home.driver.primary_ctx_state(home.device) {
        Ok((_, true)) => {}
        Ok((_, false)) | Err(_) => return blocks,
    }
    // A new shelf: its retain keeps the context (and the blocks) alive. Made outside the lock.
    // It also tells whether the context is the primary one (an adopted context may be, as
    // cudarc's is).
    let primary = match home.driver.primary_ctx_retain(home.device) {
        Ok(p) => p,
        Err(_) => return blocks,
    };
    if primary != home.ctx {
        // SAFETY: the retain just made, released once.
        if unsafe { home.driver.primary_ctx_release(home.device) }.is_err() {
            keep_retain(home, primary);
        }
        return blocks;
    }
    let mut sh = shelves();
    if let Some(s) = sh
        .iter_mut()
        .find(|s| s.world == home.world && s.ctx == home.ctx)
    {
        // Another teardown made the shelf meanwhile: one retain is enough.
        s.blocks.extend(blocks);
        drop(sh);
        // SAFETY: the retain just made, released once.
        if unsafe { home.driver.primary_ctx_release(home.device) }.is_err() {
            keep_retain(home, primary);
        }
        return Vec::new();
    }
    sh.push(Shelf {
        driver: shelf_driver(&home.raw, home.ctx),
        world: home.world,
        ctx: home.ctx,
        device: home.device,
        blocks,
        retains: 1,
    });
    Vec::new()
}

/// A retain of `primary` (the primary context of `home`'s device) whose release failed: kept on
/// that context's shelf (made empty if needed), so that [`release_pinned_cache`] releases it
/// later. Never lost, never released twice.
fn keep_retain(home: &Home, primary: driver::Context) {
    let mut sh = shelves();
    match sh
        .iter_mut()
        .find(|s| s.world == home.world && s.ctx == primary)
    {
        Some(s) => s.retains += 1,
        None => sh.push(Shelf {
            driver: shelf_driver(&home.raw, primary),
            world: home.world,
            ctx: primary,
            device: home.device,
            blocks: Vec::new(),
            retains: 1,
        }),
    }
}

/// Frees `b` through `driver` (its context set by the device rules).
///
/// # Safety
/// `b` must be a live block of `driver`'s context that nothing uses, freed once.
pub(crate) unsafe fn free(driver: &dyn Driver, b: Block) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { driver.mem_free_host(b.host as *mut u8) }
}

/// Whether the context that `driver` makes its calls in (a shelf's driver) is dead, asked of
/// the context itself after one of its calls returned a sticky error (a call may report
/// another context's fault; a dead context's blocks are given up, a live one's kept): an event
/// made and destroyed there, which every dead context refuses with its sticky error (on the
/// H200 event creation fails with it, docs/gpu.md). Only on that error path.
fn context_is_dead(driver: &dyn Driver) -> bool {
    match driver.event_create(crate::driver::event_flags::DISABLE_TIMING) {
        Ok(ev) => {
            // SAFETY: made just above, destroyed once (a failed destroy has no effect). Where
            // every try fails, the event of a live context is leaked (a few bytes): safe.
            driver::tries(|| unsafe { driver.event_destroy(ev) });
            false
        }
        Err(e) => e.is_sticky(),
    }
}

/// Frees the page-locked host memory that the crate keeps for reuse by later states of
/// `driver`'s primary contexts (completion flags and staging blocks of torn-down states), and
/// releases the primary contexts it kept for it. `driver` is the one the contexts were made
/// with, or any driver of its world ([`Driver::world`]: any instance of the real driver, such
/// as `driver::load(Choice::Cuda)`'s, for contexts adopted from cudarc too). Returns how many
/// blocks it freed.
///
/// The crate never frees that memory on its own: `cuMemFreeHost` waits for the work of every
/// stream of the device, holding a lock of the driver that other threads' calls need, so a
/// free at an unchosen moment can stall other work for as long as it runs, or deadlock a
/// process in which a stream waits for a flag that the host writes after a driver call.
/// Call this where that cannot happen (at the end of a program, or between phases), if the
/// few kilobytes per context matter.
///
/// ```
/// use cuda_stream_pool::{driver::{Driver, SimDriver}, release_pinned_cache, Context};
/// use std::sync::Arc;
/// let sim = Arc::new(SimDriver::new());
/// let drv: Arc<dyn Driver> = sim.clone();
/// let ctx = Context::primary(drv.clone(), 0).unwrap();
/// let owner = ctx.owner();
/// let s = owner.stream().unwrap();
/// let done = s.completed().unwrap(); // the context's completion flags: a host-mapped slab
/// sim.advance(0);
/// assert!(done.is_complete());
/// drop((done, s));
/// drop((owner, ctx));
/// assert_eq!(sim.counters().live_host_allocs, 1); // kept for the context's next state
/// assert_eq!(release_pinned_cache(&*sim).unwrap(), 1);
/// assert_eq!(sim.counters().live_host_allocs, 0);
/// assert_eq!(sim.counters().live_contexts, 0);
/// ```
///
/// # Errors
/// `CUDA_ERROR_NOT_PERMITTED` on a host function's thread (nothing is freed); otherwise the
/// first failure of a free or a release (the others are still made). A block whose free
/// failed stays on its shelf, and its context stays retained for it; a retain whose release
/// failed stays too: a later call frees and releases them. But a block whose free fails with a
/// sticky error ([`crate::Error::is_sticky`]: a kernel faulted the context) in a context that
/// then confirms it is dead (it refuses to make an event with a sticky error too) is taken off
/// its shelf unfreed, and the retain released: its memory goes with the context's reset or
/// destruction, which is then safe (the error is still returned).
///
/// It frees what is on the shelves when it is called. A teardown that was handed to a thread of
/// its own (the last [`Context`](crate::Context) dropped on a host-function thread, or while the
/// completion poller ran a waker: see the crate's safety contract) may still be running, and
/// shelves its blocks after this call: call it again later to free those.
///
/// Call it before any `cuDevicePrimaryCtxReset` of these devices (by this program or a
/// library): a reset destroys the primary context and its page-locked memory with it, retains
/// or not, and a later free of a shelved block would free memory that is gone.
pub fn release_pinned_cache(driver: &dyn Driver) -> Result<usize> {
    // Every driver call is refused there (and the frees would wait for the host function's
    // own stream): refused before anything is taken off a shelf.
    if crate::hostfn::on_host_fn_thread() {
        return Err(crate::error::Error::driver(
            crate::error::ErrorCode::ERROR_NOT_PERMITTED,
            "cuMemFreeHost",
        ));
    }
    // Asked before the lock: `world` is the caller's `Driver` code, which runs under no lock of
    // the crate (review 24).
    let world = driver.world();
    let mine: Vec<Shelf> = {
        let mut sh = shelves();
        let (mine, rest) = std::mem::take(&mut *sh)
            .into_iter()
            .partition(|s| s.world == world);
        *sh = rest;
        mine
    };
    let mut first = Ok(());
    let mut freed = 0;
    let mut kept = Vec::new();
    for mut s in mine {
        let mut left = Vec::new();
        for b in std::mem::take(&mut s.blocks) {
            // SAFETY: a shelved block: live (its context is retained by the shelf), used by
            // no one, removed from the shelf above, so freed once.
            match unsafe { free(&*s.driver, b) } {
                Ok(()) => freed += 1,
                Err(e) => {
                    // A sticky error, and the context confirms it is dead: every later call in
                    // it fails the same way, and its memory goes with its reset or destruction.
                    // The block is given up unfreed (a later call would only fail again, and
                    // after a reset it would free memory that is gone). Otherwise it is still
                    // allocated: back on the shelf, with the retain that keeps it.
                    if !(e.is_sticky() && context_is_dead(&*s.driver)) {
                        left.push(b);
                    }
                    if first.is_ok() {
                        first = Err(e);
                    }
                }
            }
        }
        // The shelf's retains, each released once; with blocks left, one stays (theirs).
        let keep = usize::from(!left.is_empty());
        while s.retains > keep {
            // SAFETY: a retain the shelf holds, released once (counted down below).
            match unsafe { s.driver.primary_ctx_release(s.device) } {
                Ok(()) => s.retains -= 1,
                Err(e) => {
                    if first.is_ok() {
                        first = Err(e);
                    }
                    break;
                }
            }
        }
        s.blocks = left;
        if s.retains > 0 {
            kept.push(s);
        }
    }
    if !kept.is_empty() {
        // What could not be freed or released stays for a later call.
        shelves().extend(kept);
    }
    first.map(|()| freed)
}

/// The shelves of `driver`'s world and their blocks, for the model's tests (feature
/// `model-hooks`).
#[cfg(feature = "model-hooks")]
pub fn model_shelved(driver: &dyn Driver) -> (usize, usize) {
    let world = driver.world();
    let sh = shelves();
    let mine = sh.iter().filter(|s| s.world == world);
    (mine.clone().count(), mine.map(|s| s.blocks.len()).sum())
}
