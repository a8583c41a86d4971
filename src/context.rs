//! Per-context state: the pools, the disposal stream, the priority range, the memory pool.

use crate::driver::{self, stream_flags, Device, DevicePtr, Driver, Event, MemPool, MemPoolAttr};
use crate::error::{Error, Result};
use crate::owner::Owner;
use crate::pool::{Pool, PoolStats, Slot};
use crate::stream::StreamRef;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

/// A stream priority, per owner. Lower numbers are higher priorities (CUDA's convention); the
/// valid numbers are the context's [`PriorityRange`].
///
/// ```
/// # use cuda_stream_pool::{driver, Context};
/// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// # let ctx = Context::primary(drv, 0).unwrap();
/// use cuda_stream_pool::Priority;
/// let r = ctx.priority_range();                 // 0 ..= -5 on an H200
/// assert_eq!(r.resolve(Priority::High).unwrap(), r.greatest);
/// assert_eq!(r.resolve(Priority::Value(-2)).unwrap(), -2);
/// assert!(r.resolve(Priority::Value(-9)).is_err());    // the driver would clamp it silently
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Priority {
    /// The least priority of the range (0 on the H200).
    Low,
    /// CUDA's default priority, 0 (the same stream priority as `Low` where the range starts at 0,
    /// as on every current NVIDIA GPU).
    Normal,
    /// The greatest priority of the range (-5 on the H200).
    High,
    /// A number inside the range.
    Value(i32),
}

/// A context's stream priorities: `least` (e.g. 0) down to `greatest` (e.g. -5).
///
/// ```
/// # use cuda_stream_pool::{driver, Context};
/// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// # let ctx = Context::primary(drv, 0).unwrap();
/// let r = ctx.priority_range();
/// assert!(r.contains(r.least) && r.contains(r.greatest) && !r.contains(r.least + 1));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PriorityRange {
    /// The least priority (the largest number).
    pub least: i32,
    /// The greatest priority (the smallest number).
    pub greatest: i32,
}

impl PriorityRange {
    /// Whether `p` lies in the range.
    pub fn contains(&self, p: i32) -> bool {
        p <= self.least && p >= self.greatest
    }

    /// The number of `p`, or an error naming the range when a `Value` lies outside it (the driver
    /// would clamp it silently).
    pub fn resolve(&self, p: Priority) -> Result<i32> {
        match p {
            Priority::Low => Ok(self.least),
            Priority::High => Ok(self.greatest),
            Priority::Normal => Ok(0.clamp(self.greatest, self.least)),
            Priority::Value(v) if self.contains(v) => Ok(v),
            Priority::Value(v) => Err(Error::invalid(format!(
                "stream priority {v} is outside the context's range {} (least) ..= {} (greatest)",
                self.least, self.greatest
            ))),
        }
    }
}

static NEXT_CTX: AtomicU64 = AtomicU64::new(1);

pub(crate) struct CtxInner {
    pub(crate) id: u64,
    pub(crate) driver: Arc<dyn Driver>,
    pub(crate) raw: driver::Context,
    pub(crate) device: Device,
    primary: bool,
    pub(crate) range: PriorityRange,
    /// One slot per (priority, flags) key with flags 0 or 1, indexed without a lock: new owners
    /// look their pool up on every first use.
    pools: Box<[OnceLock<Arc<Pool>>]>,
    /// Pools of other flags (rare).
    other_pools: RwLock<Vec<Arc<Pool>>>,
    pub(crate) disposal: Arc<Slot>,
    pub(crate) mem_pool: MemPool,
    events: Mutex<Vec<Event>>,
    /// Frees that could not be enqueued because the buffer's stream was capturing.
    pub(crate) deferred: Mutex<Vec<(DevicePtr, Arc<Slot>, u64)>>,
}

/// The crate's state for one CUDA context: the stream pools (one per (priority, flags) key), the
/// disposal stream, the priority range and the memory pool's configuration. Cheap to clone; the
/// state lives until the last clone, owner, stream and buffer of it are gone.
///
/// ```
/// use cuda_stream_pool::{driver, Context};
/// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// let ctx = Context::primary(drv, 0).unwrap();
/// assert_eq!(ctx.priority_range().least, 0);
/// ```
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<CtxInner>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("driver", &self.inner.driver.kind())
            .field("raw", &self.inner.raw)
            .field("device", &self.inner.device)
            .finish()
    }
}

impl Context {
    /// The primary context of device `ordinal`, retained for as long as this state lives.
    pub fn primary(driver: Arc<dyn Driver>, ordinal: i32) -> Result<Context> {
        driver.init()?;
        let device = driver.device_get(ordinal)?;
        let raw = driver.primary_ctx_retain(device)?;
        match Self::build(driver.clone(), raw, device, true) {
            Ok(c) => Ok(c),
            Err(e) => {
                let _ = driver.primary_ctx_release(device);
                Err(e)
            }
        }
    }

    /// Adopts a context that another crate created (e.g. cudarc's `CudaContext::cu_ctx()`). The
    /// context must stay alive as long as this state and everything made from it; this state
    /// never destroys or releases it.
    ///
    /// ```
    /// use cuda_stream_pool::{driver, Context};
    /// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// drv.init().unwrap();
    /// let raw = drv.primary_ctx_retain(drv.device_get(0).unwrap()).unwrap(); // another crate's
    /// let ctx = Context::adopt(drv.clone(), raw).unwrap();
    /// assert_eq!(ctx.raw(), raw);
    /// assert!(Context::adopt(drv, driver::Context::NULL).is_err());
    /// ```
    pub fn adopt(driver: Arc<dyn Driver>, raw: driver::Context) -> Result<Context> {
        if raw.is_null() {
            return Err(Error::invalid("cannot adopt a null context"));
        }
        let prev = driver.ctx_get_current()?;
        driver.ctx_set_current(raw)?;
        let device = driver.ctx_get_device();
        let device = match device {
            Ok(d) => d,
            Err(e) => {
                let _ = driver.ctx_set_current(prev);
                return Err(e);
            }
        };
        Self::build(driver, raw, device, false)
    }

    fn build(
        driver: Arc<dyn Driver>,
        raw: driver::Context,
        device: Device,
        primary: bool,
    ) -> Result<Context> {
        driver.ctx_set_current(raw)?;
        let (least, greatest) = driver.ctx_stream_priority_range()?;
        let mem_pool = driver.device_default_mem_pool(device)?;
        // Keep freed memory cached across synchronizations (the default threshold, 0, returns it
        // to the device at every synchronization).
        driver.mem_pool_set_attribute(mem_pool, MemPoolAttr::ReleaseThreshold, u64::MAX)?;
        let disposal = driver.stream_create(stream_flags::NON_BLOCKING, 0)?;
        Ok(Context {
            inner: Arc::new(CtxInner {
                id: NEXT_CTX.fetch_add(1, Ordering::Relaxed),
                driver,
                raw,
                device,
                primary,
                range: PriorityRange { least, greatest },
                pools: (0..2 * (least - greatest + 1).max(1))
                    .map(|_| OnceLock::new())
                    .collect(),
                other_pools: RwLock::new(Vec::new()),
                disposal: Arc::new(Slot::new(disposal, 0, stream_flags::NON_BLOCKING)),
                mem_pool,
                events: Mutex::new(Vec::new()),
                deferred: Mutex::new(Vec::new()),
            }),
        })
    }

    /// The driver this context runs on.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.inner.driver
    }

    /// The raw context handle.
    pub fn raw(&self) -> driver::Context {
        self.inner.raw
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.inner.device
    }

    /// The context's stream priority range.
    pub fn priority_range(&self) -> PriorityRange {
        self.inner.range
    }

    /// The raw handle of the disposal stream: a non-blocking stream, never captured, on which the
    /// crate frees memory whose last stream was recycled.
    pub fn disposal_stream(&self) -> driver::Stream {
        self.inner.disposal.raw
    }

    /// The default memory pool of the device, as configured by the crate.
    pub fn mem_pool(&self) -> MemPool {
        self.inner.mem_pool
    }

    /// Sets how many bytes of freed memory the memory pool keeps cached across synchronizations
    /// (the crate sets `u64::MAX`, i.e. keep everything, when it creates the state).
    pub fn set_release_threshold(&self, bytes: u64) -> Result<()> {
        self.inner.driver.mem_pool_set_attribute(
            self.inner.mem_pool,
            MemPoolAttr::ReleaseThreshold,
            bytes,
        )
    }

    /// Makes this context current on the calling thread, if it is not already.
    pub fn bind(&self) -> Result<()> {
        self.inner.bind()
    }

    /// `cuCtxSynchronize`.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        self.inner.driver.ctx_synchronize()
    }

    /// Counters summed over every pool of this context.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// for _ in 0..10 {
    ///     let owner = ctx.owner();
    ///     owner.stream().unwrap().synchronize().unwrap();
    /// }
    /// let st = ctx.stats();
    /// assert_eq!((st.created, st.hits, st.idle), (1, 9, 1));
    /// ```
    pub fn stats(&self) -> PoolStats {
        self.inner
            .all_pools()
            .iter()
            .map(|p| p.stats(&*self.inner.driver))
            .fold(PoolStats::default(), |a, b| a + b)
    }

    /// Streams of this context alive now: the pools' (held and retired) plus the disposal
    /// stream. Reads counters only (no driver call), so it is cheap enough to sample often.
    pub fn live_streams(&self) -> u64 {
        1 + self.inner.all_pools().iter().map(|p| p.live()).sum::<u64>()
    }

    /// Counters of the pool of one priority (non-blocking streams).
    pub fn stats_for(&self, priority: Priority) -> Result<PoolStats> {
        let p = self.inner.range.resolve(priority)?;
        Ok(self
            .inner
            .find_pool(p, stream_flags::NON_BLOCKING)
            .map(|pool| pool.stats(&*self.inner.driver))
            .unwrap_or_default())
    }

    /// Destroys every retired stream whose work has completed; returns how many.
    pub fn trim(&self) -> Result<usize> {
        self.inner.flush_deferred(None);
        let mut n = 0;
        for p in self.inner.all_pools() {
            n += p.drain(&*self.inner.driver, false)?;
        }
        Ok(n)
    }

    /// A new explicit owner at normal priority.
    pub fn owner(&self) -> Owner {
        Owner::new(self)
    }

    /// Runs `f` with the calling thread's implicit owner of this context (created on first use,
    /// retired when the thread exits).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let s = ctx.stream().unwrap();                  // the thread's stream
    /// let same = ctx.with_thread_owner(|o| o.stream().unwrap()).unwrap();
    /// assert!(s.same_stream(&same));
    /// ```
    pub fn with_thread_owner<R>(&self, f: impl FnOnce(&Owner) -> R) -> Result<R> {
        crate::owner::with_thread_owner(self, f)
    }

    /// The current stream of the calling thread's implicit owner.
    pub fn stream(&self) -> Result<StreamRef> {
        self.with_thread_owner(|o| o.stream())?
    }

    /// Selects the priority of the calling thread's implicit owner (see [`Owner::set_priority`]).
    pub fn set_priority(&self, p: Priority) -> Result<()> {
        self.with_thread_owner(|o| o.set_priority(p))?
    }

    pub(crate) fn same(&self, other: &Context) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl CtxInner {
    pub(crate) fn bind(&self) -> Result<()> {
        if self.driver.ctx_get_current()? != self.raw {
            self.driver.ctx_set_current(self.raw)?;
        }
        Ok(())
    }

    fn slot_index(&self, priority: i32, flags: u32) -> Option<usize> {
        if flags > stream_flags::NON_BLOCKING || !self.range.contains(priority) {
            return None;
        }
        Some((self.range.least - priority) as usize * 2 + flags as usize)
    }

    fn find_pool(&self, priority: i32, flags: u32) -> Option<Arc<Pool>> {
        if let Some(i) = self.slot_index(priority, flags) {
            return self.pools[i].get().cloned();
        }
        let pools = self.other_pools.read().unwrap_or_else(|p| p.into_inner());
        pools
            .iter()
            .find(|p| p.priority == priority && p.flags == flags)
            .cloned()
    }

    pub(crate) fn pool(&self, priority: i32, flags: u32) -> Arc<Pool> {
        if let Some(i) = self.slot_index(priority, flags) {
            return self.pools[i]
                .get_or_init(|| Arc::new(Pool::new(priority, flags)))
                .clone();
        }
        if let Some(p) = self.find_pool(priority, flags) {
            return p;
        }
        let mut pools = self.other_pools.write().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = pools
            .iter()
            .find(|p| p.priority == priority && p.flags == flags)
        {
            return p.clone();
        }
        let p = Arc::new(Pool::new(priority, flags));
        pools.push(p.clone());
        p
    }

    fn all_pools(&self) -> Vec<Arc<Pool>> {
        let mut v: Vec<Arc<Pool>> = self.pools.iter().filter_map(|p| p.get().cloned()).collect();
        v.extend(
            self.other_pools
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .cloned(),
        );
        v
    }

    /// An event for ordering one stream after another (record + wait), from a small cache.
    pub(crate) fn take_event(&self) -> Result<Event> {
        if let Some(e) = self.events.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok(e);
        }
        self.bind()?;
        self.driver
            .event_create(driver::event_flags::DISABLE_TIMING)
    }

    /// Returns an event to the cache. A wait already enqueued keeps waiting for the record it saw.
    pub(crate) fn give_event(&self, e: Event) {
        let mut ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        if ev.len() < 64 {
            ev.push(e);
        } else {
            drop(ev);
            let _ = self.driver.event_destroy(e);
        }
    }

    /// Orders later work on `after` after the work enqueued so far on `before`, on the GPU.
    pub(crate) fn order(&self, before: driver::Stream, after: driver::Stream) -> Result<()> {
        let e = self.take_event()?;
        let r = self
            .driver
            .event_record(e, before)
            .and_then(|_| self.driver.stream_wait_event(after, e));
        self.give_event(e);
        r
    }

    /// Frees `ptr` on the disposal stream.
    pub(crate) fn free_on_disposal(&self, ptr: DevicePtr) -> Result<()> {
        self.driver.mem_free_async(ptr, self.disposal.raw)
    }

    /// Enqueues the frees deferred while `slot` was capturing (all of them when `slot` is None).
    pub(crate) fn flush_deferred(&self, slot: Option<&Arc<Slot>>) {
        let mut list = self.deferred.lock().unwrap_or_else(|p| p.into_inner());
        if list.is_empty() {
            return;
        }
        let mut keep = Vec::new();
        for (ptr, s, gen) in list.drain(..) {
            if slot.is_some_and(|x| !Arc::ptr_eq(x, &s)) {
                keep.push((ptr, s, gen));
                continue;
            }
            let st = s.lock();
            if st.capturing {
                drop(st);
                keep.push((ptr, s, gen));
                continue;
            }
            let r = if st.generation == gen && !st.destroyed {
                self.driver.mem_free_async(ptr, s.raw)
            } else {
                self.free_on_disposal(ptr)
            };
            drop(st);
            if r.is_err() && self.free_on_disposal(ptr).is_err() {
                // Kept for the next flush.
                keep.push((ptr, s, gen));
            }
        }
        *list = keep;
    }
}

impl Drop for CtxInner {
    fn drop(&mut self) {
        // Everything of this context is gone (owners, streams and buffers hold it alive).
        let _ = self.bind();
        self.flush_deferred(None);
        self.flush_deferred(None);
        for p in self.all_pools() {
            let _ = p.drain(&*self.driver, true);
        }
        let _ = self.driver.stream_synchronize(self.disposal.raw);
        {
            let mut st = self.disposal.lock();
            st.destroy();
        }
        let _ = self.driver.stream_destroy(self.disposal.raw);
        for e in self
            .events
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            let _ = self.driver.event_destroy(e);
        }
        if self.primary {
            let _ = self.driver.primary_ctx_release(self.device);
        }
    }
}
