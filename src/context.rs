//! Per-context state: the pools, the disposal stream, the priority range, the memory pool, and
//! the one routine that frees stream-ordered memory ([`CtxInner::free_ordered`]): every free of
//! the crate goes through it, and a free it cannot order is kept and retried, never issued
//! unordered.

use crate::driver::{
    self, stream_flags, Device, DevicePtr, Driver, Event, MemPool, MemPoolAttr, Stream,
};
use crate::error::{Error, Result};
use crate::pool::{destroy_idle, Loan, Mode, Pool, PoolStats, Slot};
use crate::refs::Refs;
use crate::registry::{Key, Registry};
use crate::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

/// A stream priority, per owner. Lower numbers are higher priorities (CUDA's convention); the
/// valid numbers are the context's [`PriorityRange`].
///
/// **`Normal` is `Low` on every current NVIDIA GPU.** Their ranges run from 0 (the least
/// priority, also CUDA's default) to a negative number (-5 on the H200), so `Normal` and `Low`
/// both resolve to 0: the same priority, the same pool and, for one owner, the same stream.
/// There is no priority between the default and the least. `Normal` names the default (what an
/// owner uses until [`crate::Owner::set_priority`]); only a range without 0 would make it
/// differ from `Low` (it then resolves to the least priority as well). To run work ahead of
/// default work, use `High` or a `Value` below 0.
///
/// ```
/// # use cuda_stream_pool::{driver, Context};
/// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// # let ctx = Context::primary(drv, 0).unwrap();
/// use cuda_stream_pool::Priority;
/// let r = ctx.priority_range();
/// assert_eq!(r.resolve(Priority::Normal).unwrap(), r.resolve(Priority::Low).unwrap());
/// let owner = ctx.owner();
/// let normal = owner.stream().unwrap().raw();     // the default: Normal
/// owner.set_priority(Priority::Low).unwrap();
/// assert_eq!(owner.stream().unwrap().raw(), normal); // the same stream
/// ```
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
    /// CUDA's default priority, 0, the priority of an owner that chose none. **The same as `Low`
    /// on every current NVIDIA GPU** (their ranges start at 0; see the type's docs); the least
    /// priority for a range without 0.
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
    ///
    /// ```
    /// use cuda_stream_pool::PriorityRange;
    /// let r = PriorityRange { least: 0, greatest: -5 };
    /// assert!(r.contains(0) && r.contains(-3) && r.contains(-5));
    /// assert!(!r.contains(1) && !r.contains(-6));
    /// ```
    pub fn contains(&self, p: i32) -> bool {
        p <= self.least && p >= self.greatest
    }

    /// The number of `p`, or an error naming the range when a `Value` lies outside it (the driver
    /// would clamp it silently).
    ///
    /// ```
    /// use cuda_stream_pool::{Error, Priority, PriorityRange};
    /// let r = PriorityRange { least: 0, greatest: -5 };
    /// assert_eq!(r.resolve(Priority::Low).unwrap(), 0);
    /// assert_eq!(r.resolve(Priority::Normal).unwrap(), 0);
    /// assert_eq!(r.resolve(Priority::High).unwrap(), -5);
    /// assert!(matches!(r.resolve(Priority::Value(3)), Err(Error::InvalidArgument(_))));
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a [`Priority::Value`] outside the range.
    pub fn resolve(&self, p: Priority) -> Result<i32> {
        match p {
            Priority::Low => Ok(self.least),
            Priority::High => Ok(self.greatest),
            // CUDA's default, 0, when the range has it (it has on every NVIDIA GPU), else the
            // least priority (no `clamp`: it panics on a reversed range, which is public data).
            Priority::Normal if self.contains(0) => Ok(0),
            Priority::Normal => Ok(self.least),
            Priority::Value(v) if self.contains(v) => Ok(v),
            Priority::Value(v) => Err(Error::invalid(format!(
                "stream priority {v} is outside the context's range {} (least) ..= {} (greatest)",
                self.least, self.greatest
            ))),
        }
    }
}

/// Where the crate's [`crate::DeviceBuffer`]s allocate from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MemPoolChoice {
    /// A stream-ordered pool that the crate creates for the context (`cuMemPoolCreate`) and
    /// destroys with it, keeping this many bytes of freed memory cached across
    /// synchronizations. The device's default pool, which cudarc and other libraries use, is
    /// left as it is.
    Own {
        /// The pool's release threshold (`u64::MAX` keeps all freed memory cached).
        release_threshold: u64,
    },
    /// The device's default pool, used as configured; the crate changes none of its attributes.
    /// Buffers allocate with `cuMemAllocAsync`, from the device's *current* pool: the default
    /// pool, unless someone made another pool current (`cuDeviceSetMemPool`).
    DeviceDefault,
}

impl Default for MemPoolChoice {
    /// The crate's own pool, keeping freed memory cached (`u64::MAX`).
    fn default() -> Self {
        MemPoolChoice::Own {
            release_threshold: u64::MAX,
        }
    }
}

/// Options of a context's state ([`Context::primary_with`], [`Context::adopt_with`]): where
/// buffers allocate from, and an optional cap on live streams.
///
/// ## Memory
///
/// [`MemPoolChoice::Own`] (the default) or [`MemPoolChoice::DeviceDefault`]; see
/// [`ContextOptions::mem_pool`].
///
/// ## The cap on live streams
///
/// With exclusive streams every concurrent owner holds a stream of its own: 10,000 requests in
/// flight are 10,000 live streams (about 560 KiB of device memory each, and `cuCtxSynchronize`
/// grows with their number: 0.1 ms at 10 live streams, 319 ms at 12,000 on the H200).
/// `max_live_streams_per_key` bounds the streams alive per (priority, flags) key, held and
/// retired together. An acquisition that would have to create a stream beyond the cap waits
/// instead, first come first served, until a stream comes back: [`crate::Owner::stream`] parks
/// the thread, [`crate::Owner::ready`] is a future. A released stream whose work is still
/// running is not handed out (as always): the first waiter enqueues a host function on it that
/// wakes it when the work completes, so nobody polls the driver.
///
/// **Only an owner's first stream waits.** An owner that already holds a stream (of another
/// priority) takes further streams at once, beyond the cap if none is idle (counted in
/// [`crate::PoolStats::over_cap`]). Waiting while holding could close a cycle: with a cap of 1,
/// owner A holds the only priority-0 stream and waits for priority -5, owner B holds the only
/// priority -5 stream and waits for priority 0. With the rule, a waiting owner holds no stream,
/// so no owner waits for a waiting owner: the wait-for graph has no edge out of a stream holder
/// into the crate, hence no cycle. An owner holds at most one stream per key, so the excess is
/// at most one stream per key for each owner that holds several priorities at once.
///
/// What the crate cannot see: a thread that holds `cap` streams of a key through other owners
/// (or `OwnedStream`-like structures of its own that keep owners alive, or handles of streams
/// lent to another crate, such as cudarc slices, which count against the cap after their owner is
/// gone: [`crate::StreamRef::lend`]) and then asks for one more of that key on the same thread
/// waits for itself. Hold one owner per unit of work, or use
/// [`crate::Owner::ready`] in async code, where the holders run on.
///
/// ## The default
///
/// [`ContextOptions::default()`] (what [`Context::primary`] uses) has no cap: a default cap
/// would turn code that holds more than the cap's owners of one key at once on one thread (the
/// benchmarks hold 10,000) from working into waiting forever, which a library must not do
/// silently. A server opts in with [`ContextOptions::server`]: a cap of 64 per key, with which
/// 10,000 tasks in flight take at most 64 streams (35 MiB) per key and queue fairly for them.
/// 64 because more streams add no concurrency on current GPUs (an H200 runs at most 128 grids at
/// once and spreads streams over 32 hardware queues at most), while each costs device memory and
/// synchronization time; pair it with [`Context::reserve`] so that acquisitions never create
/// streams in steady state.
///
/// ```
/// use cuda_stream_pool::{driver, Context, ContextOptions};
/// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// let opts = ContextOptions::default().max_live_streams_per_key(Some(2));
/// let ctx = Context::primary_with(drv, 0, opts).unwrap();
/// let (a, b) = (ctx.owner(), ctx.owner());
/// a.stream().unwrap();
/// b.stream().unwrap();                 // two live streams: the cap
/// let c = std::thread::spawn({
///     let ctx = ctx.clone();
///     move || ctx.owner().stream().map(|s| s.raw())   // waits until `a` is dropped
/// });
/// drop(a);
/// c.join().unwrap().unwrap();
/// assert!(ctx.stats().peak_live <= 2);
/// ```
///
/// ## Building one
///
/// The type is `#[non_exhaustive]`, so that a new option is not a breaking change: start from
/// [`ContextOptions::default()`], [`ContextOptions::unbounded`] or [`ContextOptions::server`] and
/// set fields with the builder methods (the fields stay public to read). A struct literal does
/// not compile outside the crate:
///
/// ```compile_fail,E0639
/// use cuda_stream_pool::{ContextOptions, MemPoolChoice};
/// let opts = ContextOptions { mem_pool: MemPoolChoice::default(), max_live_streams_per_key: None };
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ContextOptions {
    /// Where buffers allocate from (default: the crate's own pool).
    pub mem_pool: MemPoolChoice,
    /// The most streams alive at once per (priority, flags) key; `None`: no cap (the default).
    /// `Some(0)` is refused.
    pub max_live_streams_per_key: Option<usize>,
    /// A state of its own, shared with nobody (default `false`: the process's one state of the
    /// (driver, CUDA context) is joined, or made and shared; see [`Context`]).
    pub isolated: bool,
}

impl ContextOptions {
    /// No cap: [`Context::primary`]'s behaviour.
    pub fn unbounded() -> ContextOptions {
        ContextOptions::default()
    }

    /// What a server wants: at most 64 live streams per key (see the type's docs for why).
    pub fn server() -> ContextOptions {
        ContextOptions::default().max_live_streams_per_key(Some(64))
    }

    /// Sets where buffers allocate from.
    ///
    /// ```
    /// use cuda_stream_pool::{driver, Context, ContextOptions, MemPoolChoice};
    /// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// let opts = ContextOptions::default().mem_pool(MemPoolChoice::DeviceDefault);
    /// let ctx = Context::primary_with(drv.clone(), 0, opts).unwrap();
    /// assert_eq!(ctx.mem_pool(), drv.device_default_mem_pool(ctx.device()).unwrap());
    /// ```
    #[must_use]
    pub fn mem_pool(mut self, choice: MemPoolChoice) -> Self {
        self.mem_pool = choice;
        self
    }

    /// Sets the cap on live streams per (priority, flags) key (`None`: no cap).
    #[must_use]
    pub fn max_live_streams_per_key(mut self, cap: Option<usize>) -> Self {
        self.max_live_streams_per_key = cap;
        self
    }

    /// With `true`, the state made is the caller's alone: it does not join the process's shared
    /// state of the context, and nobody joins it (its own pools, cap, memory pool, poller). For
    /// a library that must not share its cap or streams; two states of one context cannot use
    /// each other's buffers.
    ///
    /// ```
    /// use cuda_stream_pool::{driver, Context, ContextOptions};
    /// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// let shared = Context::primary(drv.clone(), 0).unwrap();
    /// let mine = Context::primary_with(drv, 0, ContextOptions::default().isolated(true)).unwrap();
    /// assert_ne!(shared, mine);
    /// assert_eq!(shared.raw(), mine.raw());   // one CUDA context, two states
    /// ```
    #[must_use]
    pub fn isolated(mut self, isolated: bool) -> Self {
        self.isolated = isolated;
        self
    }
}

/// The process's joinable states (see [`Context`]).
#[cfg(not(loom))]
static STATES: Registry<CtxInner> = Registry::new();
/// Under loom (whose mutex has no `const` constructor) made on first use; no loom test reaches it.
#[cfg(loom)]
static STATES: std::sync::LazyLock<Registry<CtxInner>> = std::sync::LazyLock::new(Registry::new);

static NEXT_CTX: AtomicU64 = AtomicU64::new(1);

use crate::hostfn::on_host_fn_thread;
use crate::retry::RetryList;

/// What keeps an adopted context alive (see [`Context::adopt`]).
type KeepAlive = Box<dyn std::any::Any + Send + Sync>;

/// Whether a state's keep-alives lack a joiner's (see [`Context::join`]).
type Needed<'a> = &'a dyn Fn(&[KeepAlive]) -> bool;

/// A stream whose holder is gone while its loan is out: its pool (`None` for an
/// `OwnedStream`'s) and its slot.
type Parked = (Option<Arc<Pool>>, Arc<Slot>);

/// Host memory kept for a copy on (slot, generation) whose wait failed.
type KeptHost = (Arc<Slot>, u64, Box<dyn std::any::Any + Send>);

/// What became of a lent stream whose holder is gone.
enum LoanEnd {
    /// The other crate holds no handle of it any more and it is not capturing (or only a
    /// capture of the crate's own flags it: see [`CtxInner::end_loan`]): back to the pool.
    Returned,
    /// A handle of it is still out: kept aside, retried by later flushes.
    Out,
    /// Returned but left capturing by the other crate: never used again (leaked).
    Stuck,
}

/// A free that could not be enqueued yet: its last stream is capturing, or the driver refused
/// the ordered free. Retried (ordered) by [`CtxInner::flush_deferred`].
struct Deferred {
    ptr: DevicePtr,
    slot: Arc<Slot>,
    gen: u64,
}

/// Which pool of a context a held stream belongs to ([`CtxInner::pool_key`]).
pub(crate) enum PoolKey {
    /// One of the usual keys (flags 0 or 1, a priority in range): an index of the context's
    /// pools, which live as long as the context.
    Std(usize),
    /// Another key's pool (rare).
    Other(Arc<Pool>),
}

/// Aligned to 128 bytes so that the `Arc`'s reference counts, which a user's `Context` clone
/// raises and lowers (the crate's objects count themselves per shard instead: `refs.rs`), sit on
/// a cache line of their own: not on the line of the fields every acquisition reads (the
/// driver, the pools), which other threads would then miss on each time.
#[repr(align(128))]
pub(crate) struct CtxInner {
    pub(crate) id: u64,
    /// The context's driver behind the device rules: every call of the crate for this context
    /// goes through it.
    pub(crate) driver: Arc<dyn Driver>,
    /// The same driver, typed: its hook opens scopes ([`CtxInner::scope`]).
    rules: Arc<driver::Hooked<driver::DeviceRules>>,
    pub(crate) raw: driver::Context,
    pub(crate) device: Device,
    primary: bool,
    pub(crate) range: PriorityRange,
    options: ContextOptions,
    /// One slot per (priority, flags) key with flags 0 or 1, indexed without a lock: new owners
    /// look their pool up on every first use.
    pools: Box<[OnceLock<Arc<Pool>>]>,
    /// Pools of other flags (rare).
    other_pools: RwLock<Vec<Arc<Pool>>>,
    pub(crate) disposal: Arc<Slot>,
    pub(crate) mem_pool: MemPool,
    /// Whether `mem_pool` was created by the crate (destroyed at teardown; buffers allocate
    /// from it with `cuMemAllocFromPoolAsync`).
    pub(crate) own_pool: bool,
    events: Mutex<Vec<Event>>,
    deferred: RetryList<Deferred>,
    /// Everything the four retry lists keep, readable without a lock: the fast path of every
    /// flush.
    deferred_len: AtomicUsize,
    /// Streams of dropped `OwnedStream`s that could not be destroyed yet (their work did not
    /// complete, or the driver refused): destroyed by later flushes once idle, or at teardown.
    orphans: RetryList<Arc<Slot>>,
    /// Streams whose holder is gone while a handle lent to another crate (cudarc) still lives:
    /// kept out of the pool, never destroyed, until the loan is returned (the pool of a pooled
    /// stream, `None` for an `OwnedStream`'s).
    lent: RetryList<Parked>,
    /// Host memory that a copy may still read or write after the wait for it failed: kept until
    /// that stream generation's work is known to be complete (leaked if that never happens).
    kept_host: RetryList<KeptHost>,
    /// What keeps an adopted context alive (another crate's handle, from the adoption that made
    /// this state; and cudarc's keeper when a `from_cudarc` joined a state that lacked one),
    /// dropped after teardown.
    keep_alive: Mutex<Vec<KeepAlive>>,
    /// Set when the teardown was moved to another state (off a host-function thread).
    torn_down: bool,
    /// Set on a state that lingers because its teardown could not switch to relaxed mode: the
    /// next reaping tries again.
    retry_teardown: bool,
    /// Whether the context is dead (see [`Health`]).
    health: Arc<Health>,
    /// When the state was made, and when (nanoseconds after that) the driver was last asked
    /// about a fault ([`CtxInner::fault_now_and_then`]).
    born: std::time::Instant,
    last_probe: AtomicU64,
    /// Completion futures' flags, poller and staging memory, made on first use.
    hub: OnceLock<Arc<crate::hub::Hub>>,
    /// Modules loaded into the context ([`CtxInner::module`]), by the address of their image:
    /// loaded once, unloaded by the teardown after every stream's work has completed. (An
    /// unload before that would have to wait with `cuCtxSynchronize`, which invalidates every
    /// capture in progress on the context, relaxed mode or not.)
    modules: Mutex<Vec<(usize, driver::Module)>>,
    /// User handles and the crate's objects counted per shard (see `refs.rs`, `ctx_ref.rs`).
    pub(crate) refs: Refs,
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
///
/// ## One state per (driver, CUDA context)
///
/// The process has at most one shared state per driver object and CUDA context: every
/// [`Context::primary`], [`Context::adopt`] and `Context::from_cudarc` of the same context
/// through the same driver object joins it while it lives (two libraries of one process share
/// its streams, cap and memory pool, and each can use the other's buffers). The real driver
/// is one object per process ([`crate::driver::load`] returns the same one every time); each
/// simulation is a driver object of its own. A state is equal (`==`) to its clones and to
/// the joins of it, and to nothing else.
///
/// * Options: the `*_with` constructors join only a state made with the same options (else
///   [`Error::InvalidArgument`]); the others join whatever options it has. A state made with
///   [`ContextOptions::isolated`] is the caller's alone.
/// * A state whose context is dead ([`Context::health`]) is not joined: the next user gets a
///   new state (which fails if the context is still dead).
/// * Every shared state keeps its context alive by itself (its retain, or the keep-alive of
///   the adoption that made it: a state adopted without one is not shared). A keep-alive that
///   a joining adoption passes is not needed and is dropped before the call returns.
///
/// ```
/// use cuda_stream_pool::{driver, Context, DeviceBuffer};
/// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// let lib_a = Context::primary(drv.clone(), 0).unwrap();
/// let lib_b = Context::primary(drv, 0).unwrap();     // another library of the process
/// assert_eq!(lib_a, lib_b);
/// let (oa, ob) = (lib_a.owner(), lib_b.owner());
/// let buf = DeviceBuffer::from_slice(&oa.stream().unwrap(), &[1u32, 2]).unwrap();
/// assert_eq!(buf.to_vec(&ob.stream().unwrap()).unwrap(), vec![1, 2]); // one state: usable
/// ```
pub struct Context {
    pub(crate) inner: Arc<CtxInner>,
    /// Which user of the state this is: every constructor call that makes or joins a state is
    /// a user of its own (its clones are the same user). The thread's implicit owner and
    /// attached owners are per user, so that two libraries sharing a state never share the
    /// thread's stream, its priority or its captures.
    pub(crate) user: u64,
}

/// The next [`Context::user`].
static NEXT_USER: AtomicU64 = AtomicU64::new(1);

impl Context {
    /// A new user of `inner`.
    fn user_of(inner: Arc<CtxInner>) -> Context {
        Context::from_parts(inner, NEXT_USER.fetch_add(1, Ordering::Relaxed))
    }

    /// A handle of user `user` that holds the strong reference `inner` (counted as a handle).
    fn from_parts(inner: Arc<CtxInner>, user: u64) -> Context {
        inner.refs.handle_made();
        Context { inner, user }
    }
}

/// A user handle of `inner` is gone (its strong reference, `inner`, still held): drops the
/// strong references that the state's shards gave up, if it was the last (see `refs.rs`).
fn give_up_shards(inner: &Arc<CtxInner>) {
    for _ in 0..inner.refs.handle_dropped() {
        // SAFETY: a shard's strong reference, taken by `CtxRef::new` with this pointer and
        // given up once (its `HOLDS` cleared by the handle's drop); `inner` is still held, so
        // the count stays above zero here.
        unsafe { Arc::decrement_strong_count(Arc::as_ptr(inner)) };
    }
}

impl Clone for Context {
    fn clone(&self) -> Context {
        Context::from_parts(self.inner.clone(), self.user)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // Before the handle's own strong reference (the field, dropped after this).
        give_up_shards(&self.inner);
    }
}

impl PartialEq for Context {
    fn eq(&self, other: &Context) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for Context {}

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
    /// The state of device `ordinal`'s primary context, which it retains for as long as it
    /// lives: the process's shared state of (`driver`, that context) when there is one, with
    /// whatever options it was made with, else a new one (with the default options), shared
    /// from now on (see [`Context`]).
    ///
    /// ```
    /// use cuda_stream_pool::{driver, Context};
    /// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// let ctx = Context::primary(drv.clone(), 0).unwrap();
    /// assert_eq!(ctx.device(), drv.device_get(0).unwrap());
    /// assert_eq!(Context::primary(drv.clone(), 0).unwrap(), ctx);  // the same state
    /// assert!(Context::primary(drv, 1).is_err());     // the simulation has one device
    /// ```
    ///
    /// # Errors
    /// The driver's error when it cannot initialise, find the device, retain its primary
    /// context, read its priority range or memory pool, or create the disposal stream;
    /// [`Error::InvalidArgument`] when the driver reports an unusable priority range (reversed,
    /// or wider than 1024).
    pub fn primary(driver: Arc<dyn Driver>, ordinal: i32) -> Result<Context> {
        Self::primary_opt(driver, ordinal, None)
    }

    /// [`Context::primary`] with options (see [`ContextOptions`]): the shared state when its
    /// options are these, a new one (shared from now on) when there is none, or a state of the
    /// caller's alone with [`ContextOptions::isolated`].
    ///
    /// ```
    /// use cuda_stream_pool::{driver, Context, ContextOptions};
    /// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// let ctx = Context::primary_with(drv.clone(), 0, ContextOptions::server()).unwrap();
    /// assert_eq!(Context::primary_with(drv.clone(), 0, ContextOptions::server()).unwrap(), ctx);
    /// assert_eq!(Context::primary(drv.clone(), 0).unwrap(), ctx);   // joins, whatever the options
    /// let e = Context::primary_with(drv, 0, ContextOptions::unbounded()).unwrap_err();
    /// assert!(e.to_string().contains("options"), "{e}");             // a conflict
    /// ```
    ///
    /// # Errors
    /// As [`Context::primary`]; [`Error::InvalidArgument`] for a cap of 0, or when the shared
    /// state of the context was made with other options; the driver's error when the crate's
    /// memory pool cannot be created ([`MemPoolChoice::Own`]).
    pub fn primary_with(
        driver: Arc<dyn Driver>,
        ordinal: i32,
        options: ContextOptions,
    ) -> Result<Context> {
        Self::primary_opt(driver, ordinal, Some(options))
    }

    /// [`Context::primary_with`]; `None`: any options of a shared state, the default for a new
    /// one.
    fn primary_opt(
        driver: Arc<dyn Driver>,
        ordinal: i32,
        options: Option<ContextOptions>,
    ) -> Result<Context> {
        let opts = options.unwrap_or_default();
        // Every call, `cuInit` included, goes through the device rules (refused on a
        // host-function thread before anything is touched).
        let rules = Self::device_layer(driver);
        rules.init()?;
        let device = rules.device_get(ordinal)?;
        let raw = rules.primary_ctx_retain(device)?;
        // Keyed by the driver object passed in (the device layer's `inner`).
        let key = Key::new(&rules.inner, raw.0);
        if !opts.isolated {
            if let Some(inner) = Self::find_live(key, |_| true) {
                // Every shared state keeps its context alive by itself (its own retain, or an
                // adopter's keep-alive: states adopted without one are not shared).
                // SAFETY: retained just above, once; nothing of ours uses it.
                driver::tries(|| unsafe { rules.primary_ctx_release(device) });
                return Self::join(inner, options, None);
            }
        }
        rules.hook.set_context(raw);
        match Self::build(rules.clone(), raw, device, true, opts) {
            Ok(c) => Self::share(key, c, options),
            Err(e) => {
                rules.hook.set_context(driver::Context::NULL);
                // SAFETY: retained just above, once; nothing uses it (the build failed).
                driver::tries(|| unsafe { rules.primary_ctx_release(device) });
                Err(e)
            }
        }
    }

    /// The shared state of (`driver`, `raw`) if there is one and `wanted` accepts it, joined
    /// (with `options` checked as [`Context::primary_with`] does) without adding anything to
    /// it: for an adoption whose keep-alive the state holds already.
    #[cfg_attr(not(feature = "cudarc"), allow(dead_code))]
    pub(crate) fn shared_if(
        driver: &Arc<dyn Driver>,
        raw: driver::Context,
        options: Option<ContextOptions>,
        wanted: impl Fn(&CtxInner) -> bool,
    ) -> Option<Result<Context>> {
        let inner = Self::find_live(Key::new(driver, raw.0), wanted)?;
        Some(Self::join(inner, options, None))
    }

    /// The live shared state of `key` that `wanted` accepts (run under the registry's lock:
    /// crate code only), if its context is not dead: asked of the driver (a query of the
    /// state's disposal stream), outside the registry's lock, so that a context that died a
    /// moment ago is not joined (the dead state is dropped here, under no lock).
    fn find_live(key: Key, wanted: impl Fn(&CtxInner) -> bool) -> Option<Arc<CtxInner>> {
        let (found, later) = STATES.find(key, |s| s.joinable() && wanted(s));
        drop(later);
        let inner = found?;
        if inner.fault(true).is_some() {
            return None;
        }
        Some(inner)
    }

    /// A new user of a shared state: refused when it asked for other options than the state's.
    /// The state keeps its context alive already: a keep-alive of the new user is kept only
    /// when `needed` says the state lacks it (cudarc's keeper), else dropped after this returns
    /// (under no lock), so that repeated adoptions add nothing.
    fn join(
        inner: Arc<CtxInner>,
        options: Option<ContextOptions>,
        keep_alive: Option<(KeepAlive, Needed<'_>)>,
    ) -> Result<Context> {
        if let Some(o) = options {
            if o != inner.options {
                let e = Error::invalid(format!(
                    "the context's shared state was made with other options ({:?}) than these \
                     ({o:?}): ask for it without options (Context::primary, Context::adopt), \
                     with the same ones, or make a state of your own \
                     (ContextOptions::isolated)",
                    inner.options
                ));
                // `keep_alive` and `inner` are dropped after the error is made (a last clone of
                // the state tears it down here, under no lock).
                return Err(e);
            }
        }
        let unneeded = keep_alive.and_then(|(k, needed)| inner.keep_if(k, needed));
        drop(unneeded);
        Ok(Context::user_of(inner))
    }

    /// Shares a state just made (unless it is isolated): registers it, or, when another thread
    /// registered one for the same context meanwhile, joins that one and drops this one.
    fn share(key: Key, made: Context, options: Option<ContextOptions>) -> Result<Context> {
        if made.inner.options.isolated {
            return Ok(made);
        }
        // `made` stays a counted handle throughout. (Uncounting it and counting it again, as
        // the first version did, took the state's handles to zero, which marks every shard
        // `CLOSING` for good: each owner then took and gave back a strong reference of the
        // `Arc` that every thread shares, the cost that per-shard counts were made to remove.)
        let (inner, registered, later) =
            STATES.register(key, made.inner.clone(), CtxInner::joinable);
        if registered {
            // `inner` is `made`'s own state.
            drop(inner);
            drop(later);
            return Ok(made);
        }
        // Another thread registered a state of this context first: this one (its last strong
        // reference in `later`) is torn down here, outside the registry's lock.
        drop(made);
        drop(later);
        Self::join(inner, options, None)
    }

    /// Adopts a context that another crate created (e.g. cudarc's `CudaContext::cu_ctx()`).
    /// This state never destroys or releases it.
    ///
    /// At teardown the state's page-locked host memory (completion flags, staging blocks) goes
    /// on the context's shelf for later states ([`crate::release_pinned_cache`]) only when
    /// `keep_alive` is given and `raw` is the device's primary context (cudarc's are). Otherwise
    /// the teardown frees it with `cuMemFreeHost`, which waits for the work of every stream of the
    /// device: so adopt a primary context with a `keep_alive`, and tear a non-primary one down
    /// where such a wait is harmless.
    ///
    /// # Safety
    /// `raw` must be a live context of `driver` and stay alive for as long as this state and
    /// everything made from it (owners, streams, buffers, graphs, and loans of its streams:
    /// [`crate::StreamRef::lend`]) live. Pass what keeps it alive (for example the other crate's
    /// `Arc`) as `keep_alive`: it is dropped after this state's teardown, which waits for every
    /// loan of its streams to end.
    ///
    /// Sharing (see [`Context`]): with a `keep_alive`, the state is the process's shared state
    /// of the context, which later users join and may keep alive after this one is dropped (the
    /// keep-alive lives as long as the shared state). A call that joins a shared state that
    /// keeps its context alive already drops its `keep_alive` before it returns (it is not
    /// needed). Without a `keep_alive`, the state made is the caller's alone (its life rests
    /// on the caller's promise, which covers no other user); it may still join a shared state.
    ///
    /// ```
    /// use cuda_stream_pool::{driver, Context};
    /// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// drv.init().unwrap();
    /// let dev = drv.device_get(0).unwrap();
    /// let raw = drv.primary_ctx_retain(dev).unwrap(); // another crate's context
    /// // SAFETY: retained above and released only after `ctx` and everything made from it.
    /// let ctx = unsafe { Context::adopt(drv.clone(), raw, None) }.unwrap();
    /// assert_eq!(ctx.raw(), raw);
    /// drop(ctx);
    /// // SAFETY: retained once above; nothing uses it any more.
    /// unsafe { drv.primary_ctx_release(dev) }.unwrap();
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a null context, or an unusable priority range (as for
    /// [`Context::primary`]); the driver's error otherwise.
    pub unsafe fn adopt(
        driver: Arc<dyn Driver>,
        raw: driver::Context,
        keep_alive: Option<Box<dyn std::any::Any + Send + Sync>>,
    ) -> Result<Context> {
        // SAFETY: the caller's contract.
        unsafe { Self::adopt_keeping(driver, raw, keep_alive, None, &|_| false) }
    }

    /// [`Context::adopt`] with options (joining a shared state as
    /// [`Context::primary_with`] does).
    ///
    /// # Safety
    /// As [`Context::adopt`].
    ///
    /// # Errors
    /// As [`Context::adopt`] and [`Context::primary_with`].
    pub unsafe fn adopt_with(
        driver: Arc<dyn Driver>,
        raw: driver::Context,
        keep_alive: Option<Box<dyn std::any::Any + Send + Sync>>,
        options: ContextOptions,
    ) -> Result<Context> {
        // SAFETY: the caller's contract.
        unsafe { Self::adopt_keeping(driver, raw, keep_alive, Some(options), &|_| false) }
    }

    /// [`Context::adopt_with`]; `None`: any options of a shared state, the default for a new
    /// one. Joining a shared state, `keep_alive` is kept only if `needed` says the state lacks
    /// it (see [`Context::join`]). A state made without a keep-alive is not shared: its life
    /// rests on its adopter's promise alone, which covers no other user.
    ///
    /// # Safety
    /// As [`Context::adopt`].
    pub(crate) unsafe fn adopt_keeping(
        driver: Arc<dyn Driver>,
        raw: driver::Context,
        keep_alive: Option<KeepAlive>,
        options: Option<ContextOptions>,
        needed: Needed<'_>,
    ) -> Result<Context> {
        if raw.is_null() {
            return Err(Error::invalid("cannot adopt a null context"));
        }
        let opts = options.unwrap_or_default();
        let key = Key::new(&driver, raw.0);
        if !opts.isolated {
            if let Some(inner) = Self::find_live(key, |_| true) {
                return Self::join(inner, options, keep_alive.map(|k| (k, needed)));
            }
        }
        let rules = Self::device_layer(driver);
        // The caller guarantees `raw` is live: calls are made in it from now on.
        rules.hook.set_context(raw);
        let device = rules.ctx_get_device()?;
        let made = Self::build(rules, raw, device, false, opts)?;
        let Some(k) = keep_alive else {
            // Kept by its adopter's promise only: nobody else's.
            return Ok(made);
        };
        // The keep-alive goes with the state made here before it is shared (a joiner finds it
        // kept alive) ...
        let _ = made.inner.keep_if(k, &|_| true);
        // ... or, when another thread shared one meanwhile, with that one if it lacks it (this
        // one is torn down, keep-alive last).
        let mine = made.inner.clone();
        let ctx = Self::share(key, made, options)?;
        if !Arc::ptr_eq(&ctx.inner, &mine) {
            let taken = mine.take_keep_alives();
            drop(mine);
            for k in taken {
                drop(ctx.inner.keep_if(k, needed));
            }
        }
        Ok(ctx)
    }

    /// The driver of a new state: `driver` behind the device rules (driver/rules.rs).
    pub(crate) fn device_layer(
        driver: Arc<dyn Driver>,
    ) -> Arc<driver::Hooked<driver::DeviceRules>> {
        Arc::new(driver::Hooked {
            inner: driver.clone(),
            hook: driver::DeviceRules::new(driver),
        })
    }

    fn build(
        rules: Arc<driver::Hooked<driver::DeviceRules>>,
        raw: driver::Context,
        device: Device,
        primary: bool,
        options: ContextOptions,
    ) -> Result<Context> {
        reap_lingering();
        if options.max_live_streams_per_key == Some(0) {
            return Err(Error::invalid(
                "a cap of 0 live streams per key would make every acquisition wait forever",
            ));
        }
        // One scope for the calls below: the context is made current once (and the caller's
        // restored at the end), relaxed mode is entered once.
        let scope = rules.hook.scope();
        let driver: &dyn Driver = &*rules;
        let (least, greatest) = driver.ctx_stream_priority_range()?;
        if greatest > least || least.checked_sub(greatest).is_none_or(|w| w > 1024) {
            return Err(Error::invalid(format!(
                "the driver reported an unusable stream priority range {least} (least) ..= \
                 {greatest} (greatest)"
            )));
        }
        let (mem_pool, own_pool) = match options.mem_pool {
            MemPoolChoice::DeviceDefault => (driver.device_default_mem_pool(device)?, false),
            MemPoolChoice::Own { release_threshold } => {
                let pool = driver.mem_pool_create(device)?;
                // SAFETY: the pool was just created, and nothing allocated from it yet.
                let set = unsafe {
                    driver.mem_pool_set_attribute(
                        pool,
                        MemPoolAttr::ReleaseThreshold,
                        release_threshold,
                    )
                };
                if let Err(e) = set {
                    // SAFETY: ours, unused, destroyed once.
                    driver::tries(|| unsafe { driver.mem_pool_destroy(pool) });
                    return Err(e);
                }
                (pool, true)
            }
        };
        let disposal = match driver.stream_create(stream_flags::NON_BLOCKING, 0) {
            Ok(s) => s,
            Err(e) => {
                if own_pool {
                    // SAFETY: ours, unused, destroyed once.
                    driver::tries(|| unsafe { driver.mem_pool_destroy(mem_pool) });
                }
                return Err(e);
            }
        };
        drop(scope);
        let disposal = Arc::new(Slot::new(disposal, 0, stream_flags::NON_BLOCKING));
        let health = Arc::new(Health {
            rules: rules.clone(),
            disposal: disposal.clone(),
            fault: OnceLock::new(),
            checked: AtomicU64::new(rules.hook.sticky_seen()),
        });
        Ok(Context::user_of(Arc::new(CtxInner {
            id: NEXT_CTX.fetch_add(1, Ordering::Relaxed),
            driver: rules.clone(),
            rules,
            raw,
            device,
            primary,
            range: PriorityRange { least, greatest },
            options,
            pools: (0..2 * (least - greatest + 1).max(1))
                .map(|_| OnceLock::new())
                .collect(),
            other_pools: RwLock::new(Vec::new()),
            disposal,
            mem_pool,
            own_pool,
            events: Mutex::new(Vec::new()),
            deferred: RetryList::new(),
            deferred_len: AtomicUsize::new(0),
            orphans: RetryList::new(),
            lent: RetryList::new(),
            kept_host: RetryList::new(),
            keep_alive: Mutex::new(Vec::new()),
            torn_down: false,
            retry_teardown: false,
            health,
            born: std::time::Instant::now(),
            last_probe: AtomicU64::new(0),
            hub: OnceLock::new(),
            modules: Mutex::new(Vec::new()),
            refs: Refs::new(crate::pool::shard_count()),
        })))
    }

    /// The driver this context runs on, behind the context's device rules: a call made through
    /// it is refused on a host-function thread (`CUDA_ERROR_NOT_PERMITTED`), runs with this
    /// context current (the caller's current context is restored afterwards), and, for a call
    /// that can invalidate a capture (queries, synchronizations, allocations and frees, host
    /// allocations, pool creation and attributes, graph instantiation, module loads), in
    /// relaxed capture mode (the caller's mode is restored). For a call with the thread's own
    /// mode and current context, use the driver you passed in. It is another driver object
    /// than the one you passed in: a [`Context::primary`] of it makes a state of its own (see
    /// [`Context`]); pass your own driver to join this state.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// assert_eq!(ctx.driver().kind(), "sim");
    /// ```
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.inner.driver
    }

    /// The raw context handle.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// ctx.bind().unwrap();
    /// assert_eq!(ctx.driver().ctx_get_current().unwrap(), ctx.raw());
    /// ```
    pub fn raw(&self) -> driver::Context {
        self.inner.raw
    }

    /// The device.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// use cuda_stream_pool::driver::DeviceAttr;
    /// let supported = ctx.driver().device_attribute(ctx.device(), DeviceAttr::MemoryPoolsSupported);
    /// assert_eq!(supported.unwrap(), 1);
    /// ```
    pub fn device(&self) -> Device {
        self.inner.device
    }

    /// The context's stream priority range.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let r = ctx.priority_range();
    /// assert_eq!((r.least, r.greatest), (0, -5));       // the simulation's (an H200's) range
    /// ```
    pub fn priority_range(&self) -> PriorityRange {
        self.inner.range
    }

    /// The options the context was made with.
    pub fn options(&self) -> ContextOptions {
        self.inner.options
    }

    /// Creates streams of `priority` (non-blocking) until `n` of them are alive, and keeps them
    /// in the pool: owners then take them instead of creating streams, so that a server's
    /// acquisitions never call `cuStreamCreate` in steady state. Returns how many it created.
    ///
    /// Reserved streams are kept: the pool of the key keeps up to `n` idle streams from now on
    /// instead of [`crate::MAX_IDLE`] (the larger of the two), and [`Context::trim`] leaves `n`.
    /// With a cap, `n` may not exceed it; `reserve(p, cap)` with the cap makes every acquisition
    /// of an owner's first stream either take a reserved stream or wait for one (on a
    /// host-function thread, fail instead of waiting). An owner that
    /// already holds a stream of another key (another priority, [`crate::Owner::set_priority`])
    /// never waits: when no reserved stream of the key is idle it creates one beyond the cap
    /// (counted in [`crate::PoolStats::over_cap`]), as without a reserve.
    ///
    /// Why: on the H200, creating a stream can block in `cuStreamCreate` behind other streams'
    /// GPU work. With one stream held by a GPU-side wait (`cuStreamWaitValue32` on host memory),
    /// creating the ~31st live stream blocked until that wait was released, while streams the
    /// driver had created before (then destroyed) were reused at once. An acquisition that has
    /// to create can thus wait behind someone else's blocked stream; one that takes a reserved
    /// stream does not. The context's doorbell stream (see [`crate::Completion`]) is made here
    /// too, if it was not yet, so that a completion never creates a stream either.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, Priority};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// assert_eq!(ctx.reserve(Priority::Normal, 40).unwrap(), 40);
    /// let owners: Vec<_> = (0..40).map(|_| ctx.owner()).collect();
    /// for o in &owners {
    ///     o.stream().unwrap();                   // all taken from the reserve
    /// }
    /// let st = ctx.stats();
    /// assert_eq!((st.created, st.reserved, st.misses), (40, 40, 0));
    /// drop(owners);
    /// ctx.trim().unwrap();
    /// assert_eq!(ctx.stats().idle, 40);         // the reserve stays (beyond MAX_IDLE)
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a priority outside the range or `n` above the cap; the
    /// driver's error (the streams created before it stay reserved).
    pub fn reserve(&self, priority: Priority, n: usize) -> Result<usize> {
        self.reserve_key(priority, stream_flags::NON_BLOCKING, n)
    }

    /// [`Context::reserve`] for a (priority, flags) key.
    ///
    /// # Errors
    /// As [`Context::reserve`].
    pub fn reserve_key(&self, priority: Priority, flags: u32, n: usize) -> Result<usize> {
        let p = self.inner.range.resolve(priority)?;
        let pool = self.inner.pool(p, flags);
        let _scope = self.inner.scope();
        let made = pool.reserve(&*self.inner.driver, n)?;
        // The completion poller's doorbell stream too, so that a completion never creates one.
        self.inner.hub().doorbell_stream()?;
        Ok(made)
    }

    /// The raw handle of the disposal stream: a non-blocking stream, never captured, on which the
    /// crate frees memory whose last stream was recycled. For diagnostics: the crate alone may
    /// enqueue on it.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let owner = ctx.owner();
    /// assert_ne!(owner.stream().unwrap().raw(), ctx.disposal_stream());
    /// assert_eq!(ctx.live_streams(), 2);             // the owner's and the disposal stream
    /// ```
    pub fn disposal_stream(&self) -> driver::Stream {
        self.inner.disposal.observe()
    }

    /// The memory pool buffers allocate from: the crate's own (the default,
    /// [`MemPoolChoice::Own`]) or the device's default pool ([`MemPoolChoice::DeviceDefault`]).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// use cuda_stream_pool::driver::MemPoolAttr;
    /// assert_ne!(ctx.mem_pool(), ctx.driver().device_default_mem_pool(ctx.device()).unwrap());
    /// // SAFETY: the crate's pool lives as long as the context.
    /// let kept = unsafe {
    ///     ctx.driver().mem_pool_get_attribute(ctx.mem_pool(), MemPoolAttr::ReleaseThreshold)
    /// };
    /// assert_eq!(kept.unwrap(), u64::MAX);
    /// ```
    pub fn mem_pool(&self) -> MemPool {
        self.inner.mem_pool
    }

    /// Sets how many bytes of freed memory the memory pool keeps cached across synchronizations
    /// (the crate's own pool starts at the threshold given in [`MemPoolChoice::Own`]). With
    /// [`MemPoolChoice::DeviceDefault`] this changes the device's default pool, for every
    /// library in the process: that is then your explicit choice.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// use cuda_stream_pool::driver::MemPoolAttr;
    /// ctx.set_release_threshold(1 << 20).unwrap();
    /// // SAFETY: the crate's pool lives as long as the context.
    /// let kept = unsafe {
    ///     ctx.driver().mem_pool_get_attribute(ctx.mem_pool(), MemPoolAttr::ReleaseThreshold)
    /// };
    /// assert_eq!(kept.unwrap(), 1 << 20);
    /// ```
    ///
    /// # Errors
    /// The driver's error.
    pub fn set_release_threshold(&self, bytes: u64) -> Result<()> {
        // Relaxed mode and the context current: the device rules (driver/rules.rs).
        // SAFETY: the device's default pool lives as long as the context.
        unsafe {
            self.inner.driver.mem_pool_set_attribute(
                self.inner.mem_pool,
                MemPoolAttr::ReleaseThreshold,
                bytes,
            )
        }
    }

    /// Makes this context current on the calling thread, if it is not already, and leaves it
    /// so (for your own raw driver calls). The crate's operations need no `bind`: each makes the
    /// context current for its calls and restores the thread's current context afterwards.
    ///
    /// ```
    /// use cuda_stream_pool::driver::{Driver, SimConfig, SimDriver};
    /// use cuda_stream_pool::Context;
    /// use std::sync::Arc;
    /// let sim = Arc::new(SimDriver::with_config(SimConfig { devices: 2, ..SimConfig::default() }));
    /// let c0 = Context::primary(sim.clone(), 0).unwrap();
    /// let c1 = Context::primary(sim.clone(), 1).unwrap();
    /// assert!(sim.ctx_get_current().unwrap().is_null());    // the crate left none current
    /// c1.bind().unwrap();
    /// c0.owner().stream().unwrap();                         // an operation of c0 ...
    /// assert_eq!(sim.ctx_get_current().unwrap(), c1.raw()); // ... leaves c1 current
    /// c0.bind().unwrap();
    /// assert_eq!(sim.ctx_get_current().unwrap(), c0.raw());
    /// ```
    ///
    /// # Errors
    /// The driver's error.
    pub fn bind(&self) -> Result<()> {
        self.inner.bind()
    }

    /// Whether the context is alive: `Err` with the driver's sticky error once a kernel
    /// faulted it ([`crate::ErrorCode::is_sticky`]), after which every call that touches the context
    /// fails with that error and work enqueued in it never completes. Pending
    /// [`crate::Completion`]s and [`crate::HostCopy`]s of the context then resolve with the
    /// error (the completion poller asks the driver every few milliseconds while they wait and
    /// nothing lands). Makes one cheap driver call (a stream query) unless the fault is known.
    ///
    /// A dead context cannot be revived. On an H200 (driver 580) the process cannot make a
    /// working context on that device again either (docs/gpu.md): restart the process, or keep
    /// GPU work in a child process that can be replaced.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::SimDriver, Context, ErrorCode};
    /// # use std::sync::Arc;
    /// let sim = Arc::new(SimDriver::new());
    /// let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// assert!(ctx.health().is_ok());
    /// sim.kill_context(ctx.raw(), ErrorCode::ERROR_ILLEGAL_ADDRESS); // a kernel faulted
    /// let e = ctx.health().unwrap_err();
    /// assert_eq!(e.code(), Some(ErrorCode::ERROR_ILLEGAL_ADDRESS));
    /// ```
    ///
    /// # Errors
    /// The sticky error.
    pub fn health(&self) -> Result<()> {
        match self.inner.fault(true) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// `cuCtxSynchronize`: waits for all work of the context, other crates' streams included.
    ///
    /// It waits for capturing streams too, which the driver refuses: while any stream of the
    /// context is capturing (any thread, any mode), it fails with
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and that capture is invalidated, relaxed mode or
    /// not (measured on the H200). To wait without touching captures, synchronize the streams
    /// you used ([`crate::StreamRef::synchronize`]). The crate itself never synchronizes a
    /// context.
    ///
    /// ```
    /// use cuda_stream_pool::{driver::SimDriver, Context};
    /// use std::sync::Arc;
    /// let sim = Arc::new(SimDriver::new());
    /// let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// let (a, b) = (ctx.owner(), ctx.owner());
    /// let (sa, sb) = (a.stream().unwrap(), b.stream().unwrap());
    /// sim.enqueue_work(sa.raw(), 1_000).unwrap();
    /// sim.enqueue_work(sb.raw(), 2_000).unwrap();
    /// ctx.synchronize().unwrap();                         // waits for every stream
    /// assert!(sa.query().unwrap() && sb.query().unwrap());
    /// ```
    ///
    /// # Errors
    /// The driver's error, e.g. a sticky error of earlier work.
    pub fn synchronize(&self) -> Result<()> {
        // Relaxed mode and the context current: the device rules (driver/rules.rs).
        self.inner.driver.ctx_synchronize()
    }

    /// Counters summed over every pool of this context. Reading them first destroys, in each
    /// pool, the idle streams beyond [`crate::MAX_IDLE`] (or the reserve), as a release does:
    /// streams that were busy when released and have completed since.
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
        let _scope = self.inner.scope();
        self.inner
            .all_pools()
            .iter()
            .map(|p| p.stats(&*self.inner.driver))
            .fold(PoolStats::default(), |a, b| a + b)
    }

    /// Streams of this context alive now: the pools' (held and retired), the disposal stream,
    /// and the completion poller's doorbell stream once a completion made while the poller was
    /// idle needed it (see [`crate::Completion`]). Reads counters only (no driver call), so it
    /// is cheap enough to sample often. Streams of [`crate::OwnedStream`]s are not counted.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// assert_eq!(ctx.live_streams(), 1);             // the disposal stream
    /// let (a, b) = (ctx.owner(), ctx.owner());
    /// a.stream().unwrap();
    /// b.stream().unwrap();
    /// assert_eq!(ctx.live_streams(), 3);
    /// ```
    pub fn live_streams(&self) -> u64 {
        let doorbell = self.inner.hub.get().map_or(0, |h| h.streams());
        1 + doorbell + self.inner.all_pools().iter().map(|p| p.live()).sum::<u64>()
    }

    /// Counters of the pool of one priority (non-blocking streams).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// use cuda_stream_pool::Priority;
    /// let o = ctx.owner();
    /// o.set_priority(Priority::High).unwrap();
    /// o.stream().unwrap();
    /// assert_eq!(ctx.stats_for(Priority::High).unwrap().in_use, 1);
    /// assert_eq!(ctx.stats_for(Priority::Low).unwrap().in_use, 0);
    /// assert!(ctx.stats_for(Priority::Value(-6)).is_err());
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a priority outside the context's range.
    pub fn stats_for(&self, priority: Priority) -> Result<PoolStats> {
        self.stats_for_key(priority, stream_flags::NON_BLOCKING)
    }

    /// Counters of the pool of one (priority, flags) key.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, driver::stream_flags, Context, Owner, Priority};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let o = Owner::with_flags(&ctx, stream_flags::DEFAULT);
    /// o.stream().unwrap();
    /// assert_eq!(ctx.stats_for_key(Priority::Normal, stream_flags::DEFAULT).unwrap().in_use, 1);
    /// assert_eq!(ctx.stats_for(Priority::Normal).unwrap().in_use, 0);
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a priority outside the context's range.
    pub fn stats_for_key(&self, priority: Priority, flags: u32) -> Result<PoolStats> {
        let p = self.inner.range.resolve(priority)?;
        Ok(self
            .inner
            .find_pool(p, flags)
            .map(|pool| pool.stats(&*self.inner.driver))
            .unwrap_or_default())
    }

    /// Destroys every retired stream whose work has completed (but the reserve of each key,
    /// [`Context::reserve`]), and retries the frees that are still pending; returns how many
    /// streams were destroyed.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let owners: Vec<_> = (0..3).map(|_| ctx.owner()).collect();
    /// for o in &owners {
    ///     o.stream().unwrap();
    /// }
    /// drop(owners);                                  // three idle streams in the pool
    /// assert_eq!(ctx.trim().unwrap(), 3);
    /// assert_eq!(ctx.stats().live, 0);
    /// ```
    ///
    /// # Errors
    /// The first driver error of a destroy (or of switching to relaxed capture mode). The other
    /// streams of the pool where it happened are still trimmed; the pools after it are not, and
    /// the count is lost.
    pub fn trim(&self) -> Result<usize> {
        let _scope = self.inner.scope();
        self.inner.flush_deferred();
        let mut n = 0;
        for p in self.inner.all_pools() {
            n += p.drain(&*self.inner.driver, false, p.reserved_floor())?;
        }
        Ok(n)
    }

    /// Frees and stream destroys that the crate could not make yet (the stream is capturing,
    /// its work has not completed, or the driver refused): retried, ordered, at the end of the
    /// capture and by later operations of this context (owner drops, allocations, frees,
    /// `trim`), and at teardown.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let o = ctx.owner();
    /// let s = o.stream().unwrap();
    /// let b = DeviceBuffer::<f32>::zeroed(&s, 8).unwrap();
    /// let g = s.begin_capture().unwrap();
    /// drop(b);                                 // its stream is capturing: kept for now
    /// assert_eq!(ctx.pending(), 1);
    /// drop(g);                                 // the capture ends: freed
    /// assert_eq!(ctx.pending(), 0);
    /// ```
    pub fn pending(&self) -> usize {
        self.inner.deferred_len.load(Ordering::Acquire)
    }

    /// The completion poller's progress, `(passes, idle)` (see the hub's `poller_progress`);
    /// `None` before the context's first completion. Not part of the API: for the crate's
    /// model tests (feature `model-hooks`).
    #[cfg(feature = "model-hooks")]
    #[doc(hidden)]
    pub fn model_poller_progress(&self) -> Option<(u64, bool)> {
        self.inner.hub.get().map(|h| h.poller_progress())
    }

    /// Ends the completion poller's nap between two sweeps now, if it has one (a spurious
    /// wake-up to the poller: its next sweep comes sooner, nothing else changes). Not part of
    /// the API: for the crate's model tests (feature `model-hooks`), which wait for the poller's
    /// passes without timing.
    #[cfg(feature = "model-hooks")]
    #[doc(hidden)]
    pub fn model_poller_nudge(&self) {
        if let Some(h) = self.inner.hub.get() {
            h.nudge();
        }
    }

    /// Whether the completion poller is cold: the next completion gets a doorbell (`true`
    /// before the context's first completion). Not part of the API: for the crate's model
    /// tests (feature `model-hooks`).
    #[cfg(feature = "model-hooks")]
    #[doc(hidden)]
    pub fn model_poller_cold(&self) -> bool {
        self.inner.hub.get().is_none_or(|h| h.poller_cold())
    }

    /// A handle that stops this context's completion poller (if the state still lives then and
    /// has one) when the context's state is leaked: the model's teardown of a state that a
    /// leaked capture keeps takes it before dropping its `Context`, and stops the poller once
    /// its last check has run. It does not keep the state alive. The poller of a leaked state
    /// would otherwise read a completion that no clock lands (behind a capture that never
    /// ends) every millisecond for the rest of the process: after 200 s of a fuzzing campaign
    /// the leaked pollers were 586 threads taking 10 % of a core. Not part of the API: for the
    /// crate's model tests (feature `model-hooks`).
    #[cfg(feature = "model-hooks")]
    #[doc(hidden)]
    pub fn model_poller_stopper(&self) -> ModelPollerStopper {
        ModelPollerStopper(Arc::downgrade(&self.inner))
    }

    /// Sets how long the completion poller stays warm with nothing to read (1 ms by default):
    /// a test that needs it warm gives it hours, so that its verdict does not depend on how
    /// long the test's thread was descheduled. Not part of the API: for the crate's model
    /// tests (feature `model-hooks`).
    #[cfg(feature = "model-hooks")]
    #[doc(hidden)]
    pub fn model_set_poller_cold_after(&self, d: std::time::Duration) {
        self.inner.hub().set_cold_after(d)
    }

    /// How many of the state's shards are `CLOSING` (their last owner gives up their strong
    /// reference): none while a user handle lives (a marking still running from the previous
    /// last drop aside). Not part of the API: for the crate's tests (feature `model-hooks`).
    #[cfg(feature = "model-hooks")]
    #[doc(hidden)]
    pub fn model_closing_shards(&self) -> usize {
        self.inner.refs.closing_shards()
    }

    pub(crate) fn same(&self, other: &Context) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl CtxInner {
    /// The context's completion hub (made on first use; its memory and thread come later).
    pub(crate) fn hub(&self) -> &Arc<crate::hub::Hub> {
        if let Some(hub) = self.hub.get() {
            return hub;
        }
        // Asked outside the initialisation (the driver's own code).
        let world = self.rules.inner.world();
        self.hub.get_or_init(|| {
            let home = crate::pinned::Home {
                driver: self.driver.clone(),
                raw: self.rules.inner.clone(),
                world,
                ctx: self.raw,
                device: self.device,
                maybe_primary: self.primary || !self.keep_alive.lock().is_empty(),
            };
            let health = self.health.clone();
            crate::hub::Hub::new(home, Box::new(move |probe| health.fault(probe)))
        })
    }

    /// The context's sticky error, if any (see [`Context::health`]).
    pub(crate) fn fault(&self, probe: bool) -> Option<Error> {
        self.health.fault(probe)
    }

    /// Opens a scope of the device rules (driver/rules.rs) for an operation that makes several
    /// driver calls: the context is made current and relaxed mode entered at most once for all
    /// of them, and the caller's restored at the end. Never held across user code.
    pub(crate) fn scope(&self) -> driver::Scope<'_> {
        self.rules.hook.scope()
    }

    /// The module of `image` (a NUL-terminated PTX or cubin image with a static address) in
    /// this context: loaded by the first call, then the same module, until the teardown unloads
    /// it. Loading runs under the device rules (relaxed mode: a load invalidates no capture).
    ///
    /// # Errors
    /// The driver's error when the module cannot be loaded (the next call tries again).
    #[cfg_attr(not(feature = "kernels"), allow(dead_code))]
    pub(crate) fn module(&self, image: &'static std::ffi::CStr) -> Result<driver::Module> {
        let key = image.as_ptr() as usize;
        let mut list = self.modules.lock();
        if let Some(&(_, m)) = list.iter().find(|(k, _)| *k == key) {
            return Ok(m);
        }
        // Under the list's lock (a driver call, no user code): two first loads make one module.
        let m = self.driver.module_load_data(image)?;
        list.push((key, m));
        Ok(m)
    }

    /// [`Context::bind`]: makes the context current on the calling thread, and leaves it so.
    pub(crate) fn bind(&self) -> Result<()> {
        if self.driver.ctx_get_current()? != self.raw {
            // SAFETY: the context is live while this state lives (retained, or kept alive by
            // `adopt`'s contract).
            unsafe { self.driver.ctx_set_current(self.raw) }?;
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
        self.pool_of(&self.pool_key(priority, flags)).clone()
    }

    /// The key of the pool of (priority, flags): what an owner keeps of the pool of each stream
    /// it holds. A key of the usual flags is an index (no reference count to touch: at 16
    /// threads, every owner raising and lowering one shared count serialises them on its cache
    /// line); its pool is made by the first [`CtxInner::pool_of`]. Another key's pool is made
    /// here if new.
    pub(crate) fn pool_key(&self, priority: i32, flags: u32) -> PoolKey {
        match self.slot_index(priority, flags) {
            Some(i) => PoolKey::Std(i),
            None => PoolKey::Other(self.other_pool(priority, flags)),
        }
    }

    /// The pool of `key` (made by [`CtxInner::pool_key`] on this state).
    pub(crate) fn pool_of<'a>(&'a self, key: &'a PoolKey) -> &'a Arc<Pool> {
        match key {
            PoolKey::Std(i) => self.std_pool(*i),
            PoolKey::Other(p) => p,
        }
    }

    /// The pool of standard key `i` (an index of `slot_index`), made on first use.
    fn std_pool(&self, i: usize) -> &Arc<Pool> {
        let (priority, flags) = (self.range.least - (i / 2) as i32, (i % 2) as u32);
        self.pools[i].get_or_init(|| {
            Arc::new(Pool::new(
                priority,
                flags,
                self.options.max_live_streams_per_key,
            ))
        })
    }

    /// The pool of a (priority, flags) key outside the standard ones, made if new.
    fn other_pool(&self, priority: i32, flags: u32) -> Arc<Pool> {
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
        let p = Arc::new(Pool::new(
            priority,
            flags,
            self.options.max_live_streams_per_key,
        ));
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

    /// Takes a stream from the pool of (priority, flags); with [`Mode::Wait`] at the cap, waits
    /// for one (never on a host-function thread: there it is an error instead).
    pub(crate) fn acquire(&self, pool: &Pool, mode: Mode) -> Result<(Arc<Slot>, u64)> {
        let mode = if mode == Mode::Wait && on_host_fn_thread() {
            Mode::Fail
        } else {
            mode
        };
        if let Some(e) = self.fault(false) {
            // A dead context hands out nothing (its streams' work never completes).
            return Err(e);
        }
        if pool.lent_out() > 0 && !on_host_fn_thread() {
            // Parked loans that ended come back first (they count against the cap); not on a
            // host-function thread, where the flush's driver calls are refused (any mode:
            // `Mode::Fail`, or an `Owner::try_stream` there).
            self.flush_deferred();
        }
        let _scope = self.scope();
        pool.acquire(
            &*self.driver,
            &|| self.reclaim_loans(),
            &|| self.fault_now_and_then(),
            mode,
        )
    }

    /// [`CtxInner::fault`], asking the driver at most every few milliseconds (a waiter at a cap
    /// asks each time it wakes).
    pub(crate) fn fault_now_and_then(&self) -> Option<Error> {
        const EVERY_NS: u64 = 5_000_000;
        let now = self.born.elapsed().as_nanos() as u64;
        let last = self.last_probe.load(Ordering::Relaxed);
        let due = now.saturating_sub(last) >= EVERY_NS
            && self
                .last_probe
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok();
        self.fault(due)
    }

    /// Brings back the parked streams whose loan ended (with the rest of a flush): what a
    /// waiter at a cap calls now and then while streams of its key are parked lent.
    pub(crate) fn reclaim_loans(&self) {
        if !on_host_fn_thread() {
            self.flush_deferred();
        }
    }

    /// Gives a stream back to its pool, then trims the pool and retries pending frees (not on a
    /// host-function thread: there it only puts the stream back, with no driver call).
    pub(crate) fn release(&self, pool: &Arc<Pool>, slot: Arc<Slot>) {
        self.release_slot(pool, slot, false)
    }

    /// [`CtxInner::release`]; `parked`: the stream comes from the list of parked loans (a
    /// flush retrying it), so the cap does not count it and no flush is started from here.
    fn release_slot(&self, pool: &Arc<Pool>, slot: Arc<Slot>, parked: bool) {
        let flush = !parked;
        let driver_ok = !on_host_fn_thread();
        // The loan's last handle is dropped at the end, outside the device rules' scopes: it may
        // hold another crate's value (a cudarc stream) whose drop is user code, which may want
        // this very stream back (at a cap), so it goes after the stream is back in the pool.
        let mut handle = None;
        let _drop_last = DropOutsideScopes(&mut handle);
        if slot.is_lent() {
            let (end, h) = self.end_loan(&slot, driver_ok);
            *_drop_last.0 = h;
            match end {
                LoanEnd::Returned => {}
                LoanEnd::Out => {
                    if !parked {
                        // Still counted against the cap (and in use) until the loan ends.
                        pool.park_lent();
                    }
                    self.park(Some(pool.clone()), slot);
                    // Streams parked earlier may have come back meanwhile.
                    if flush && driver_ok {
                        self.flush_deferred();
                    }
                    return;
                }
                LoanEnd::Stuck => {
                    // Never used again (leaked): no longer counted against the cap.
                    if parked {
                        pool.unpark_lent();
                    }
                    pool.forget_lent();
                    return;
                }
            }
            if parked {
                // A parked stream whose loan ended: back in the pool below.
                pool.unpark_lent();
            }
        }
        pool.release(&*self.driver, slot, driver_ok);
        if flush && driver_ok {
            self.flush_deferred();
        }
    }

    /// The first of what keeps an adopted context alive (see [`Context::adopt`]) for which
    /// `f` answers; `f` runs under the list's lock (crate code only).
    #[cfg_attr(not(feature = "cudarc"), allow(dead_code))]
    pub(crate) fn find_keep_alive<R>(
        &self,
        f: impl Fn(&(dyn std::any::Any + Send + Sync)) -> Option<R>,
    ) -> Option<R> {
        self.keep_alive.lock().iter().find_map(|k| f(&**k))
    }

    /// Keeps `k` with the state if `needed` says the state's keep-alives lack it (checked and
    /// pushed under one lock); else hands it back, for the caller to drop after the lock.
    pub(crate) fn keep_if(&self, k: KeepAlive, needed: Needed<'_>) -> Option<KeepAlive> {
        let mut list = self.keep_alive.lock();
        if needed(&list) {
            list.push(k);
            None
        } else {
            Some(k)
        }
    }

    /// The state's keep-alives, taken out (of a state that lost the race to be shared: what it
    /// keeps goes to the shared one, so it must not be dropped before that one's teardown).
    fn take_keep_alives(&self) -> Vec<KeepAlive> {
        std::mem::take(&mut *self.keep_alive.lock())
    }

    /// Whether a new user may join this state: its context is not known dead (a dead context's
    /// state is left to its users; a new user gets a new state).
    fn joinable(&self) -> bool {
        self.health.fault.get().is_none()
    }

    /// [`CtxInner::order`] for raw streams (e.g. another crate's).
    ///
    /// # Safety
    /// As [`CtxInner::order`].
    pub(crate) unsafe fn order_raw(&self, before: Stream, after: Stream) -> Result<()> {
        // One scope: the context made current once for the record and the wait.
        let _scope = self.scope();
        let e = self.take_event()?;
        // SAFETY: the event is ours; the caller keeps both streams live and not capturing.
        let r = unsafe {
            self.driver
                .event_record(e, before)
                .and_then(|_| self.driver.stream_wait_event(after, e))
        };
        self.give_event(e);
        r
    }

    /// Whether `slot` is capturing: a capture guard of the crate captures it, or (for a stream
    /// lent to another crate, which can begin captures behind the crate's back) the driver says
    /// so. A failed query counts as capturing: the caller then refuses or defers, which is safe.
    ///
    /// # Safety
    /// The stream must be live (held, or its generation current under its lock).
    pub(crate) unsafe fn capturing(&self, slot: &Slot) -> bool {
        if slot.is_capturing() {
            return true;
        }
        if !slot.is_lent() {
            return false;
        }
        // SAFETY: the caller keeps the stream live; `cuStreamIsCapturing` is allowed in every
        // capture mode and invalidates nothing.
        !matches!(
            unsafe { self.driver.stream_is_capturing(slot.observe()) },
            Ok(driver::CaptureStatus::None)
        )
    }

    /// Ends the loan of a stream whose holder is gone, if the other crate holds none of its
    /// handles any more. A stream left capturing by the other crate is never used again (nor
    /// destroyed: ending or destroying it could invalidate streams joined to that capture).
    /// A stream still flagged capturing by a capture guard of the crate's own (a leaked guard,
    /// or one whose end failed) is `Returned`: it goes where such a stream goes without a loan.
    fn end_loan(&self, slot: &Slot, driver_ok: bool) -> (LoanEnd, Option<Loan>) {
        if !driver_ok {
            // (On a host-function thread the capture check below is not possible: kept.)
            return (LoanEnd::Out, None);
        }
        let Some(handle) = slot.loan_returned() else {
            return (LoanEnd::Out, None);
        };
        if slot.is_capturing() {
            // The crate's own capture flag: nobody ends that capture any more (its guard is
            // leaked, or its end failed), and the flag is cleared only by the guard. The loan is
            // over (no handle is out), and the stream is retired as a never-lent one is: the
            // pool's lists never count a flagged stream idle, so it is never handed out, queried
            // or destroyed, and it shows in `retired_busy`, no longer in `in_use`, keeping its
            // place under the cap (see `CaptureGuard`). The driver, asked, would report this
            // capture too, but `Stuck` (in no list, still counted in use) is for a capture the
            // borrower left, which no flag of the crate's covers.
            slot.loan_settled();
            return (LoanEnd::Returned, handle);
        }
        if self.fault(false).is_some() {
            // A dead context's stream is never used again (no query can tell its capture).
            return (LoanEnd::Stuck, handle);
        }
        // SAFETY: the stream is live: its holder is gone but nothing destroyed it.
        let end = match unsafe { self.driver.stream_is_capturing(slot.observe()) } {
            Ok(driver::CaptureStatus::None) => {
                slot.loan_settled();
                LoanEnd::Returned
            }
            Ok(_) => LoanEnd::Stuck,
            // Not known: still taken for lent (maybe capturing), kept and asked again by a
            // later flush.
            Err(_) => LoanEnd::Out,
        };
        (end, handle)
    }

    /// Keeps host memory that a copy enqueued on generation `gen` of `slot` may still access
    /// (its wait failed), until that work is known to be complete.
    pub(crate) fn keep_host(&self, slot: Arc<Slot>, gen: u64, mem: Box<dyn std::any::Any + Send>) {
        self.kept_host.keep((slot, gen, mem), &self.deferred_len);
    }

    /// Whether the work enqueued on generation `gen` of `slot` is known to be complete (a wait
    /// with `wait`, else a query; relaxed mode, never on a capturing stream).
    fn work_done(&self, slot: &Slot, gen: u64, wait: bool) -> bool {
        let st = slot.lock();
        if !st.is_live(gen) {
            // Handed over or destroyed only after its work had completed.
            return true;
        }
        // SAFETY: live (generation current, under its lock).
        if st.capturing || unsafe { self.capturing(slot) } {
            return false;
        }
        // SAFETY: live and not capturing (above); relaxed mode: the device rules.
        unsafe {
            if wait {
                self.driver.stream_synchronize(slot.observe()).is_ok()
            } else {
                self.driver.stream_query(slot.observe()) == Ok(true)
            }
        }
    }

    /// Keeps a stream whose loan is still out, for a later flush.
    fn park(&self, pool: Option<Arc<Pool>>, slot: Arc<Slot>) {
        self.lent.keep((pool, slot), &self.deferred_len);
    }

    /// An event for ordering one stream after another (record + wait), from a small cache.
    fn take_event(&self) -> Result<Event> {
        if let Some(e) = self.events.lock().pop() {
            return Ok(e);
        }
        self.driver
            .event_create(driver::event_flags::DISABLE_TIMING)
    }

    /// Returns an event to the cache. A wait already enqueued keeps waiting for the record it saw.
    fn give_event(&self, e: Event) {
        let mut ev = self.events.lock();
        if ev.len() < 64 {
            ev.push(e);
        } else {
            drop(ev);
            // SAFETY: the event is ours and no longer in the cache; enqueued waits keep their
            // record (destroying an event with pending waits is allowed); a failed destroy had no
            // effect, so it is tried again.
            driver::tries(|| unsafe { self.driver.event_destroy(e) });
        }
    }

    /// Orders later work on `after` after the work enqueued so far on `before`, on the GPU.
    ///
    /// # Safety
    /// Both streams must be live for the duration of the call, and neither may be capturing
    /// (a record in a capture would pull `after` into it; a capturing `after` waiting on an
    /// outside record invalidates the capture).
    pub(crate) unsafe fn order(&self, before: &Slot, after: &Slot) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.order_raw(before.enqueue(), after.enqueue()) }
    }

    /// `cuMemFreeAsync` (in relaxed mode, the context current: the device rules).
    ///
    /// # Safety
    /// As [`Driver::mem_free_async`].
    unsafe fn free_on(&self, ptr: DevicePtr, stream: &Slot) -> Result<()> {
        // A free enqueued on a stream whose work was known complete leaves it so: the stream
        // can be handed on without a query (`Slot::enqueue_free`).
        // SAFETY: the caller's contract.
        unsafe { self.driver.mem_free_async(ptr, stream.enqueue_free()) }
    }

    /// Frees `ptr`, whose last use was generation `gen` of `slot`, ordered after that use; in
    /// relaxed capture mode, so that it invalidates no capture. Returns `false`, having enqueued
    /// nothing, when the free cannot be ordered now (the stream is capturing, or the driver
    /// refused): the caller keeps the pointer and retries.
    ///
    /// * generation live, not capturing: on the last stream; if the driver refuses, on the
    ///   disposal stream after an event wait on the last stream;
    /// * generation recycled or destroyed (its work has completed): on the disposal stream.
    ///
    /// # Safety
    /// `ptr` is a live allocation of this context, freed by nobody else, and every use of it was
    /// enqueued on `slot` no later than generation `gen` (or ordered before such work).
    pub(crate) unsafe fn free_ordered(&self, ptr: DevicePtr, slot: &Slot, gen: u64) -> bool {
        let _scope = self.scope();
        let st = slot.lock();
        if !st.is_live(gen) {
            drop(st);
            // SAFETY: the last use's generation ended: the stream was handed over or destroyed
            // only after its work had completed, so nothing uses `ptr` any more; the disposal
            // stream lives as long as this state and is never captured.
            return unsafe { self.free_on(ptr, &self.disposal) }.is_ok();
        }
        // SAFETY: the stream is live (generation current, under its lock).
        if st.capturing || unsafe { self.capturing(slot) } {
            return false;
        }
        // SAFETY: the stream is live (generation current, under its lock) and not capturing;
        // the free is ordered after every use by stream order.
        if unsafe { self.free_on(ptr, slot) }.is_ok() {
            return true;
        }
        // SAFETY: both streams are live and not capturing (the disposal stream never is); the
        // free on the disposal stream is enqueued only after the wait succeeded.
        unsafe {
            self.order(slot, &self.disposal).is_ok() && self.free_on(ptr, &self.disposal).is_ok()
        }
    }

    /// Frees `ptr` as [`CtxInner::free_ordered`] does, or keeps it for a later retry.
    ///
    /// # Safety
    /// As [`CtxInner::free_ordered`].
    pub(crate) unsafe fn free_or_defer(&self, ptr: DevicePtr, slot: &Arc<Slot>, gen: u64) {
        // SAFETY: the caller's contract.
        if !unsafe { self.free_ordered(ptr, slot, gen) } {
            let d = Deferred {
                ptr,
                slot: slot.clone(),
                gen,
            };
            self.deferred.keep(d, &self.deferred_len);
        }
    }

    /// Destroys a dropped `OwnedStream`'s stream once its work has completed, or keeps it for
    /// a later flush (never destroyed under its work).
    pub(crate) fn destroy_or_keep(&self, slot: Arc<Slot>, wait: bool) {
        let mut handle = None;
        let _drop_last = DropOutsideScopes(&mut handle);
        if slot.is_lent() {
            let (end, h) = self.end_loan(&slot, !on_host_fn_thread());
            *_drop_last.0 = h;
            match end {
                LoanEnd::Returned => {}
                LoanEnd::Out => return self.park(None, slot),
                LoanEnd::Stuck => return,
            }
        }
        let done = {
            let _scope = self.scope();
            destroy_idle(&*self.driver, &slot, wait).unwrap_or(false)
        };
        if !done && !slot.lock().destroyed {
            self.orphans.keep(slot, &self.deferred_len);
        }
    }

    /// Retries the frees that could not be enqueued: each is either enqueued, ordered, or kept.
    /// Then destroys the kept streams that are idle now.
    pub(crate) fn flush_deferred(&self) {
        reap_lingering();
        if self.deferred_len.load(Ordering::Acquire) == 0 {
            return;
        }
        self.flush(false);
    }

    /// [`CtxInner::flush_deferred`]; with `wait`, kept streams are waited for.
    fn flush(&self, wait: bool) {
        let _scope = self.scope();
        let taken = self.deferred.take_all(&self.deferred_len);
        let orphans = self.orphans.take_all(&self.deferred_len);
        for d in taken {
            // SAFETY: the entry was made by `free_or_defer`, whose contract covers it; it left
            // the list, so no other flush frees it.
            if !unsafe { self.free_ordered(d.ptr, &d.slot, d.gen) } {
                self.deferred.keep(d, &self.deferred_len);
            }
        }
        for slot in orphans {
            self.destroy_or_keep(slot, wait);
        }
        let kept = self.kept_host.take_all(&self.deferred_len);
        for (slot, gen, mem) in kept {
            if self.work_done(&slot, gen, wait) {
                drop(mem);
            } else {
                self.kept_host.keep((slot, gen, mem), &self.deferred_len);
            }
        }
        let lent = self.lent.take_all(&self.deferred_len);
        for (pool, slot) in lent {
            match pool {
                Some(pool) => self.release_slot(&pool, slot, true),
                None => self.destroy_or_keep(slot, wait),
            }
        }
    }
}

/// Drops a loan's last handle when it goes (after everything else of the function that holds
/// it), outside the device rules' scopes (user code); or, while an owner acquires on this thread
/// ([`DeferLoanDrops`]), when that acquisition is over.
struct DropOutsideScopes<'a>(&'a mut Option<Loan>);

impl Drop for DropOutsideScopes<'_> {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            let h = DEFERRED_LOAN_DROPS
                .try_with(|d| match d.borrow_mut().as_mut() {
                    Some(list) => {
                        list.push(h);
                        None
                    }
                    None => Some(h),
                })
                .unwrap_or(None);
            if let Some(h) = h {
                driver::outside_scopes(|| drop(h));
            }
        }
    }
}

thread_local! {
    /// The loan handles whose drops wait for the end of this thread's acquisition.
    static DEFERRED_LOAN_DROPS: std::cell::RefCell<Option<Vec<Loan>>> =
        const { std::cell::RefCell::new(None) };
}

/// While it lives (an owner's acquisition), the last handles of loans that the acquisition finds
/// returned are kept, and dropped when it ends: a handle's drop is user code, which may use the
/// same owner (the thread's implicit one) and would wait at a cap for the very stream the
/// acquisition is taking. Nested guards are one.
pub(crate) struct DeferLoanDrops(bool);

impl DeferLoanDrops {
    pub(crate) fn begin() -> DeferLoanDrops {
        let outer = DEFERRED_LOAN_DROPS
            .try_with(|d| {
                let mut d = d.borrow_mut();
                if d.is_none() {
                    *d = Some(Vec::new());
                    true
                } else {
                    false
                }
            })
            .unwrap_or(false);
        DeferLoanDrops(outer)
    }
}

impl Drop for DeferLoanDrops {
    fn drop(&mut self) {
        if !self.0 {
            return;
        }
        let list = DEFERRED_LOAN_DROPS
            .try_with(|d| d.borrow_mut().take())
            .ok()
            .flatten()
            .unwrap_or_default();
        if !list.is_empty() {
            driver::outside_scopes(|| drop(list));
        }
    }
}

/// Whether the context is dead ([`Context::health`]): a sticky error of one of its own calls,
/// confirmed. The device rules count every sticky error a call through them returned; such a
/// call may have named another context (another device's dead one), so the context takes
/// itself for dead only when a call of its own returns one too: a query of its disposal
/// stream (never captured; relaxed by the rules), made when the rules saw a new sticky error or
/// when asked to probe.
struct Health {
    rules: Arc<driver::Hooked<driver::DeviceRules>>,
    disposal: Arc<Slot>,
    /// The confirmed sticky error.
    fault: OnceLock<Error>,
    /// The rules' count of sticky errors when it was last confirmed or not.
    checked: AtomicU64,
}

impl Health {
    fn fault(&self, probe: bool) -> Option<Error> {
        if let Some(e) = self.fault.get() {
            return Some(e.clone());
        }
        let seen = self.rules.hook.sticky_seen();
        if !probe && seen == self.checked.load(Ordering::Acquire) {
            return None;
        }
        {
            let st = self.disposal.lock();
            if !st.destroyed {
                // SAFETY: the disposal stream is live (not destroyed, under its lock) and never
                // captured.
                if let Err(e) = unsafe { self.rules.probe_sticky(self.disposal.observe()) } {
                    if e.is_sticky() {
                        let _ = self.fault.set(e);
                    }
                }
            }
        }
        self.checked
            .store(self.rules.hook.sticky_seen(), Ordering::Release);
        self.fault.get().cloned()
    }
}

impl CtxInner {
    /// Moves the whole state out (for a teardown elsewhere or later); `self` is left torn down
    /// (its own drop does nothing).
    fn take_state(&mut self) -> CtxInner {
        let moved = CtxInner {
            id: self.id,
            driver: self.driver.clone(),
            rules: self.rules.clone(),
            raw: self.raw,
            device: self.device,
            primary: self.primary,
            range: self.range,
            options: self.options,
            pools: std::mem::take(&mut self.pools),
            other_pools: RwLock::new(std::mem::take(
                self.other_pools
                    .get_mut()
                    .unwrap_or_else(|p| p.into_inner()),
            )),
            disposal: self.disposal.clone(),
            mem_pool: self.mem_pool,
            own_pool: self.own_pool,
            events: Mutex::new(std::mem::take(self.events.get_mut())),
            deferred: self.deferred.take_list(),
            deferred_len: AtomicUsize::new(*self.deferred_len.get_mut()),
            orphans: self.orphans.take_list(),
            lent: self.lent.take_list(),
            kept_host: self.kept_host.take_list(),
            keep_alive: Mutex::new(std::mem::take(self.keep_alive.get_mut())),
            torn_down: false,
            retry_teardown: false,
            health: self.health.clone(),
            born: self.born,
            last_probe: AtomicU64::new(0),
            hub: self.hub.take().map(OnceLock::from).unwrap_or_default(),
            modules: Mutex::new(std::mem::take(self.modules.get_mut())),
            refs: Refs::new(1),
        };
        self.torn_down = true;
        moved
    }
}

/// States whose teardown found streams still lent to another crate: kept whole (the context,
/// its retain or what keeps an adopted one alive, cudarc's keeper stream, the lent streams), so
/// that what a loan relies on lives as long as the loan. Torn down again by a later call of the
/// crate (any context's flush, a new context) once a loan of theirs has ended; leaked if that
/// never happens.
#[cfg(not(loom))]
static LINGERING: Mutex<Vec<CtxInner>> = Mutex::new(Vec::new());
/// Under loom (whose mutex has no `const` constructor) made on first use; no loom test reaches it.
#[cfg(loom)]
static LINGERING: std::sync::LazyLock<Mutex<Vec<CtxInner>>> =
    std::sync::LazyLock::new(|| Mutex::new(Vec::new()));
/// `LINGERING.len()`, readable without its lock: the fast path of every flush.
static LINGERING_LEN: AtomicUsize = AtomicUsize::new(0);

/// Tears down again the lingering states of which a loan has ended (a state whose loans are
/// still out lingers again). Not on a host-function thread.
pub(crate) fn reap_lingering() {
    if LINGERING_LEN.load(Ordering::Acquire) == 0 || on_host_fn_thread() {
        return;
    }
    let ended: Vec<CtxInner> = {
        let mut list = LINGERING.lock();
        let (ended, out): (Vec<_>, Vec<_>) = std::mem::take(&mut *list)
            .into_iter()
            .partition(CtxInner::may_end);
        *list = out;
        LINGERING_LEN.store(list.len(), Ordering::Release);
        ended
    };
    // Outside the lock: a teardown that still finds a loan out lingers again.
    drop(ended);
}

impl CtxInner {
    /// Whether a lingering teardown should be tried again: a stream parked while lent has been
    /// returned by its borrower (no driver call), or it lingers because a switch failed.
    fn may_end(&self) -> bool {
        self.retry_teardown || self.lent.any(|(_, slot)| slot.loan_ended())
    }
}

impl Drop for CtxInner {
    fn drop(&mut self) {
        if self.torn_down {
            return;
        }
        // The teardown runs here unless it cannot complete here: on a host-function thread it
        // would call the driver and wait for the GPU (for the running host function itself);
        // on the completion poller's thread (a waker it runs dropped the last context) the
        // poller still reads the flags that the teardown frees, and it cannot wait for itself;
        // while the poller runs a waker, that waker may wait for this thread. Then the
        // teardown is handed to a thread of its own. Stopping the poller first means it runs no
        // user code once this thread may wait for it.
        // So is a thread that is exiting and has lost the device rules' thread-local state
        // (a last clone in a thread-local destroyed after theirs): the rules could not switch.
        let here = !on_host_fn_thread()
            && driver::scopes_available()
            && self.hub.get().is_none_or(|h| h.stop());
        if !here {
            let mut moved = self.take_state();
            crate::hostfn::on_thread_of_its_own(move || moved.teardown());
            return;
        }
        self.teardown();
    }
}

impl CtxInner {
    /// What the teardown's rounds have not finished: (parked loans, pending frees, kept
    /// streams, kept host memory, live pooled streams).
    fn leftovers(&mut self) -> [usize; 5] {
        let live = self.all_pools().iter().map(|p| p.live()).sum::<u64>() as usize;
        [
            self.lent.get_mut().len(),
            self.deferred.get_mut().len(),
            self.orphans.get_mut().len(),
            self.kept_host.get_mut().len(),
            live,
        ]
    }

    /// Waits for every pooled stream's work and destroys the streams (the teardown's).
    fn drain_pools(&self) {
        for p in self.all_pools() {
            // A failed call had no effect: the streams it could not wait for or destroy are
            // tried again (a transient failure must not leak them and, later, the modules).
            driver::tries(|| p.drain(&*self.driver, true, 0).map(drop));
        }
    }

    /// The teardown: waits for the streams' work, frees what is left, destroys the streams and
    /// the crate's memory pool, stops the completion poller (waiting for it to exit) and frees
    /// its memory, and releases the primary context. Never on a host-function thread or the
    /// poller's thread, nor on a thread that a waker the poller runs may wait for (see
    /// [`Drop for CtxInner`](CtxInner)).
    fn teardown(&mut self) {
        // Once: the drop that follows does nothing.
        self.torn_down = true;
        // Everything of this context is gone (owners, streams, buffers and graphs hold it
        // alive). One scope of the device rules for the whole teardown: the context current
        // and relaxed mode (it invalidates no capture) once, the caller's restored at the end.
        let rules = self.rules.clone();
        let scope = rules.hook.scope();
        // Without relaxed mode, waiting and querying could invalidate a capture: then the state
        // lingers (after a few tries), torn down again by a later call of the crate.
        if (0..3).all(|_| scope.relax_now().is_err()) {
            drop(scope);
            let mut moved = self.take_state();
            moved.retry_teardown = true;
            let mut list = LINGERING.lock();
            list.push(moved);
            LINGERING_LEN.store(list.len(), Ordering::Release);
            return;
        }
        // Rounds of a flush (pending frees, kept streams and host memory, parked loans) and a
        // drain (every pooled stream waited for and destroyed) until two rounds in a row change
        // nothing. A loan may end at any moment (its borrower drops its last handle on another
        // thread): the round after that brings its stream back (to its pool, drained by the
        // same round, or destroyed if it was an `OwnedStream`), and the next retries what
        // waited for it (a free deferred behind the borrower's capture); a retry that failed
        // once (a transient driver error) is made again by the next round. It ends: during the
        // teardown nothing enters the lists but an owned stream that leaves `lent` for
        // `orphans`, and `lent` only shrinks (the bound is a safety net). A loan that ends after
        // the last round keeps its stream in `lent`: the state lingers (below).
        let mut last = None;
        let mut unchanged = 0;
        for _ in 0..64 {
            self.flush(true);
            self.drain_pools();
            let now = self.leftovers();
            unchanged = if last == Some(now) { unchanged + 1 } else { 0 };
            if unchanged == 2 {
                break;
            }
            last = Some(now);
        }
        if !self.lent.get_mut().is_empty() {
            // Streams are still lent: what they rely on (this context, its retain or
            // keep-alive, cudarc's keeper stream) stays until a later call of the crate finds
            // their loans ended and tears the state down again.
            let moved = self.take_state();
            let mut list = LINGERING.lock();
            list.push(moved);
            LINGERING_LEN.store(list.len(), Ordering::Release);
            return;
        }
        if let Some(h) = self.hub.get() {
            // Every stream has been drained: the completions' writes and copies have landed.
            h.shutdown();
        }
        // Host memory a copy may still access is leaked (its wait keeps failing).
        for kept in std::mem::take(self.kept_host.get_mut()) {
            std::mem::forget(kept);
        }
        // Frees still pending here are leaked (their stream is captured by a leaked guard, or
        // the driver refuses): leaking is safe, freeing unordered is not.
        {
            let mut st = self.disposal.lock();
            // SAFETY: the disposal stream lives until just below; never captured.
            if driver::tries(|| unsafe { self.driver.stream_synchronize(self.disposal.observe()) })
            {
                st.destroy();
                // SAFETY: idle, and nothing can enqueue on it any more (the state is going);
                // a failed destroy had no effect, so it is tried again.
                driver::tries(|| unsafe { self.driver.stream_destroy(self.disposal.observe()) });
            }
        }
        // Modules: unloaded only when every stream of the context was drained (their kernels
        // have completed); otherwise a kernel may still run, and they stay loaded (leaked).
        let drained =
            self.all_pools().iter().all(|p| p.live() == 0) && self.orphans.get_mut().is_empty();
        for (_, m) in std::mem::take(self.modules.get_mut()) {
            if drained {
                // SAFETY: loaded by `module`, unloaded once; no kernel of it is pending (every
                // stream drained above) and none can be launched (every `Kernels` holds this
                // state alive).
                driver::tries(|| unsafe { self.driver.module_unload(m) });
            }
        }
        for e in self.events.get_mut().drain(..) {
            // SAFETY: the cached events are ours; nothing records them any more.
            driver::tries(|| unsafe { self.driver.event_destroy(e) });
        }
        if self.own_pool {
            // SAFETY: the crate's pool, destroyed once; every buffer of this state is gone, so
            // nothing allocates from it again. The driver keeps the memory of allocations still
            // outstanding (frees in flight, or leaked above) until they are freed.
            driver::tries(|| unsafe { self.driver.mem_pool_destroy(self.mem_pool) });
        }
        // (No stream is lent any more: a state with loans out lingers, above.)
        if self.primary {
            // SAFETY: retained once by `Context::primary`; nothing of this state uses it now
            // (released once: a failed release had no effect).
            driver::tries(|| unsafe { self.driver.primary_ctx_release(self.device) });
        }
        // Whoever still holds this driver (`Context::driver`) makes calls in no context now.
        self.rules.hook.set_context(driver::Context::NULL);
    }
}

/// See [`Context::model_poller_stopper`] (feature `model-hooks`; not part of the API).
#[cfg(feature = "model-hooks")]
#[doc(hidden)]
#[derive(Debug)]
pub struct ModelPollerStopper(std::sync::Weak<CtxInner>);

#[cfg(feature = "model-hooks")]
impl ModelPollerStopper {
    /// Stops the poller of the state, if the state still lives and has one now (it exits at
    /// its next look, leaving its pending completions pending and what they keep unfreed, as a
    /// leaked state keeps everything). Only for a leaked state: a context torn down later does
    /// not restart it, and if this was the last reference to the state, the state is torn down
    /// here.
    pub fn stop(self) {
        if let Some(inner) = self.0.upgrade() {
            if let Some(h) = inner.hub.get() {
                h.stop();
            }
        }
    }
}
