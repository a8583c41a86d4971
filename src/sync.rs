//! The crate's blocking primitives, in one place: a mutex (poisoning ignored: every critical
//! section of the crate leaves its data consistent before it can panic), a condition variable
//! and thread parking.
//!
//! With the hidden feature `model-hooks` (the crate's own model tests turn it on), a thread
//! that a test scheduler registered ([`hook::enter`]) never blocks inside these primitives:
//! where it would block (a mutex held by another scheduled thread, a condition-variable wait, a
//! park) it yields to the scheduler instead, and tries again when the scheduler lets it run.
//! A scheduler that also stops threads at driver calls (the model's `Hooked` driver) then
//! knows at every moment whether each thread is runnable, with no timing involved: the same
//! input gives the same interleaving on an idle or a loaded machine. A scheduled thread that
//! tries to lock a mutex it holds itself (a re-entrant lock: a deadlock in production) panics
//! with a message instead. Without the feature these are std's primitives and nothing else.
//!
//! Under `cfg(loom)` (`RUSTFLAGS="--cfg loom"`, `scripts/loom.sh`) the mutex, the condition
//! variable, parking, the thread handles of [`thread`] and the atomics of [`atomic`] are loom's,
//! so that loom's exhaustive scheduler sees every synchronisation of the modules that take them
//! from here (the pool's slots and gate); the model's hooks are then left out of them. Such a
//! build runs only the loom tests (`cargo test --lib loom`): loom's objects exist only inside a
//! `loom::model`.

use std::ops::{Deref, DerefMut};

// The lock and condition variable under the crate's wrappers: std's, or loom's (`cfg(loom)`).
#[cfg(loom)]
use loom::sync as imp;
#[cfg(not(loom))]
use std::sync as imp;

/// The atomics of the modules whose lock-free parts loom checks (the pool): std's, or loom's
/// under `cfg(loom)`. (A process-wide `static` counter keeps std's: loom's have no `const`
/// constructor.)
pub(crate) mod atomic {
    #[cfg(not(loom))]
    pub(crate) use std::sync::atomic::{
        fence, AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering,
    };

    #[cfg(loom)]
    pub(crate) use loom::sync::atomic::{
        fence, AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering,
    };
}

/// Thread handles for [`park`] and [`unpark`]: std's, or loom's under `cfg(loom)`.
pub(crate) mod thread {
    #[cfg(not(loom))]
    pub(crate) use std::thread::Thread;

    /// The calling thread's handle.
    #[cfg(all(not(loom), not(feature = "model-hooks")))]
    pub(crate) use std::thread::current;

    /// The calling thread's handle (with `model-hooks`, the thread also leaves the hook's
    /// lists of parked and unparked threads when it exits: `hook::forget_at_exit`).
    #[cfg(all(not(loom), feature = "model-hooks"))]
    pub(crate) fn current() -> Thread {
        super::hook::forget_at_exit();
        std::thread::current()
    }

    /// A loom thread and its park token. Loom's own `unpark` makes a thread that is blocked
    /// elsewhere (on a lock) runnable: the thread then fails loom's assertion "expected to be
    /// able to acquire lock" (loom issue 249, for `join`; the same for a lock), and it keeps
    /// no token for the next `park`, which std keeps. So the token is a flag under a loom mutex
    /// and a park waits on a loom condition variable, which wakes only its own waiter (std's
    /// semantics, with its synchronisation: `unpark` happens before the `park` that takes the
    /// token).
    #[cfg(loom)]
    #[derive(Clone, Debug)]
    pub(crate) struct Thread {
        pub(super) id: loom::thread::ThreadId,
        pub(super) token: std::sync::Arc<Token>,
    }

    /// The park token of a loom thread (see [`Thread`]).
    #[cfg(loom)]
    #[derive(Debug, Default)]
    pub(crate) struct Token {
        pub(super) set: loom::sync::Mutex<bool>,
        pub(super) cv: loom::sync::Condvar,
    }

    #[cfg(loom)]
    impl Thread {
        pub(crate) fn id(&self) -> loom::thread::ThreadId {
            self.id
        }
    }

    #[cfg(loom)]
    loom::thread_local! {
        static TOKEN: std::sync::Arc<Token> = std::sync::Arc::new(Token::default());
    }

    /// The calling thread's handle.
    #[cfg(loom)]
    pub(crate) fn current() -> Thread {
        Thread {
            id: loom::thread::current().id(),
            token: TOKEN.with(|t| t.clone()),
        }
    }
}

/// A mutual-exclusion lock whose [`Mutex::lock`] cannot fail (a poisoned lock is taken as it
/// is).
#[derive(Default)]
pub(crate) struct Mutex<T: ?Sized> {
    /// Who holds the lock (see [`hook`]); only with `model-hooks`.
    #[cfg(all(feature = "model-hooks", not(loom)))]
    holder: std::sync::atomic::AtomicU64,
    inner: imp::Mutex<T>,
}

/// The guard of a [`Mutex`].
pub(crate) struct MutexGuard<'a, T: ?Sized> {
    #[cfg_attr(not(all(feature = "model-hooks", not(loom))), allow(dead_code))]
    lock: &'a Mutex<T>,
    /// `None` only while a [`Condvar::wait`] has released the lock.
    inner: Option<imp::MutexGuard<'a, T>>,
    /// Handed to the user ([`MutexGuard::held_by_user`]): not counted in [`locks_held`].
    #[cfg(all(feature = "model-hooks", not(loom)))]
    user: bool,
}

impl<T> Mutex<T> {
    #[cfg(not(loom))]
    pub(crate) const fn new(value: T) -> Mutex<T> {
        Mutex {
            #[cfg(feature = "model-hooks")]
            holder: std::sync::atomic::AtomicU64::new(0),
            inner: imp::Mutex::new(value),
        }
    }

    /// Not `const` under loom (nor are loom's constructors).
    #[cfg(loom)]
    pub(crate) fn new(value: T) -> Mutex<T> {
        Mutex {
            inner: imp::Mutex::new(value),
        }
    }
}

impl<T: ?Sized> Mutex<T> {
    /// Locks, blocking until the lock is free (a scheduled thread yields instead).
    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        #[cfg(all(feature = "model-hooks", not(loom)))]
        let inner = hook::lock(&self.inner, &self.holder);
        #[cfg(not(all(feature = "model-hooks", not(loom))))]
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        MutexGuard {
            lock: self,
            inner: Some(inner),
            #[cfg(all(feature = "model-hooks", not(loom)))]
            user: false,
        }
    }

    /// The value, through a unique reference (no locking).
    pub(crate) fn get_mut(&mut self) -> &mut T {
        self.inner.get_mut().unwrap_or_else(|p| p.into_inner())
    }
}

impl<T: ?Sized + std::fmt::Debug> std::fmt::Debug for Mutex<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt(f)
    }
}

impl<T: ?Sized> Deref for MutexGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.inner
            .as_deref()
            .expect("a guard holds its lock outside Condvar::wait")
    }
}

impl<T: ?Sized> DerefMut for MutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.inner
            .as_deref_mut()
            .expect("a guard holds its lock outside Condvar::wait")
    }
}

impl<T: ?Sized> MutexGuard<'_, T> {
    /// Marks a guard that the crate hands to its user (a [`crate::BufferUse`] holds the
    /// buffer's use lock while the user's code runs, by design): not counted in [`locks_held`],
    /// which counts the locks the crate's own code holds.
    pub(crate) fn held_by_user(&mut self) {
        #[cfg(all(feature = "model-hooks", not(loom)))]
        if !self.user {
            self.user = true;
            hook::uncount();
        }
    }
}

impl<T: ?Sized> Drop for MutexGuard<'_, T> {
    fn drop(&mut self) {
        #[cfg(all(feature = "model-hooks", not(loom)))]
        if self.inner.is_some() {
            if self.user {
                hook::recount();
            }
            hook::unlocking(&self.lock.holder);
        }
    }
}

/// A condition variable for [`Mutex`]. Waits may wake spuriously, as std's may: callers loop
/// on their condition.
#[derive(Debug, Default)]
pub(crate) struct Condvar(imp::Condvar);

impl Condvar {
    #[cfg(not(loom))]
    pub(crate) const fn new() -> Condvar {
        Condvar(imp::Condvar::new())
    }

    /// Not `const` under loom.
    #[cfg(loom)]
    pub(crate) fn new() -> Condvar {
        Condvar(imp::Condvar::new())
    }

    /// Releases the lock, waits for a notification (a scheduled thread yields once instead: a
    /// spurious wake-up), and locks again.
    pub(crate) fn wait<'a, T>(&self, mut guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        let inner = guard.inner.take().expect("a guard holds its lock");
        #[cfg(all(feature = "model-hooks", not(loom)))]
        if hook::scheduled() {
            hook::unlocking(&guard.lock.holder);
            drop(inner);
            hook::yield_now("condvar wait");
            let lock = guard.lock;
            // Nothing to release: the lock was released above.
            std::mem::forget(guard);
            return lock.lock();
        }
        #[cfg(all(feature = "model-hooks", not(loom)))]
        hook::unlocking(&guard.lock.holder);
        let inner = self.0.wait(inner).unwrap_or_else(|p| p.into_inner());
        #[cfg(all(feature = "model-hooks", not(loom)))]
        hook::locked(&guard.lock.holder);
        guard.inner = Some(inner);
        guard
    }

    pub(crate) fn notify_one(&self) {
        self.0.notify_one();
    }

    pub(crate) fn notify_all(&self) {
        self.0.notify_all();
    }
}

/// How many of the crate's locks the calling thread holds: counted with the model's hooks (every
/// test build), 0 otherwise. The crate's code that runs user code (a waker's clone, wake or drop:
/// [`crate::hostfn::TaskWaker`]) asserts it is 0, so that a call site that runs user code under a
/// lock fails every test that reaches it instead of deadlocking a user now and then.
pub(crate) fn locks_held() -> usize {
    #[cfg(all(feature = "model-hooks", not(loom)))]
    return hook::held();
    #[cfg(not(all(feature = "model-hooks", not(loom))))]
    0
}

/// Parks the calling thread until it is unparked (or spuriously; a scheduled thread yields once
/// instead).
pub(crate) fn park() {
    #[cfg(all(feature = "model-hooks", not(loom)))]
    if hook::scheduled() {
        hook::yield_now("park");
        return;
    }
    #[cfg(all(feature = "model-hooks", not(loom)))]
    let _parked = hook::Parked::new();
    #[cfg(not(loom))]
    std::thread::park();
    #[cfg(loom)]
    {
        let me = thread::current();
        let mut set = me.token.set.lock().unwrap();
        while !std::mem::take(&mut *set) {
            set = me.token.cv.wait(set).unwrap();
        }
    }
}

/// [`park`], but returning after `dur` at the latest: for a thread that waits to be unparked and
/// also looks now and then at something that tells nobody (whether its context died). To a test
/// scheduler it is parked as with [`park`] (only an unpark is a reason for it to go on).
pub(crate) fn park_polling(dur: std::time::Duration) {
    #[cfg(all(feature = "model-hooks", not(loom)))]
    if hook::scheduled() {
        hook::yield_now("park");
        return;
    }
    #[cfg(all(feature = "model-hooks", not(loom)))]
    let _parked = hook::Parked::new();
    #[cfg(not(loom))]
    std::thread::park_timeout(dur);
    // Loom has no clock: as `park_timeout`.
    #[cfg(loom)]
    {
        let _ = dur;
        loom::thread::yield_now();
    }
}

/// Unparks `t` (see [`park`]).
pub(crate) fn unpark(t: &thread::Thread) {
    #[cfg(all(feature = "model-hooks", not(loom)))]
    hook::unparking(t.id());
    #[cfg(not(loom))]
    t.unpark();
    #[cfg(loom)]
    {
        *t.token.set.lock().unwrap() = true;
        t.token.cv.notify_one();
    }
}

/// Parks the calling thread for at most `dur` (a scheduled thread yields once instead).
pub(crate) fn park_timeout(dur: std::time::Duration) {
    #[cfg(all(feature = "model-hooks", not(loom)))]
    if hook::scheduled() {
        hook::yield_now("park");
        return;
    }
    #[cfg(not(loom))]
    std::thread::park_timeout(dur);
    // Loom has no clock: a timed park is a park that may end at once (as a timeout may).
    #[cfg(loom)]
    {
        let _ = dur;
        loom::thread::yield_now();
    }
}

/// Whether the calling thread yields to a test scheduler where it would wait (feature
/// `model-hooks`): then [`yield_now`] stands for a wait that may end spuriously.
pub(crate) fn yields() -> bool {
    #[cfg(feature = "model-hooks")]
    return hook::scheduled();
    #[cfg(not(feature = "model-hooks"))]
    false
}

/// A wake-up (or a destructor's work) handed to one of the crate's background threads (the
/// waker thread, the loans thread, a drop's own thread): counted with feature `model-hooks` (see [`hook::background`]), nothing otherwise.
pub(crate) fn background_queued() {
    #[cfg(feature = "model-hooks")]
    hook::BACKGROUND
        .0
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
}

/// A wake-up counted by [`background_queued`] has run (or was dropped).
pub(crate) fn background_ran() {
    #[cfg(feature = "model-hooks")]
    hook::BACKGROUND
        .1
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
}

/// Lets a test scheduler run the others (see [`yields`]); nothing without one.
pub(crate) fn yield_now(what: &'static str) {
    #[cfg(feature = "model-hooks")]
    hook::yield_now(what);
    #[cfg(not(feature = "model-hooks"))]
    let _ = what;
}

/// The scheduler hook (feature `model-hooks`; not part of the crate's API). Under `cfg(loom)`
/// the primitives above do not call it (loom schedules their threads).
#[cfg(feature = "model-hooks")]
#[cfg_attr(loom, allow(dead_code))]
pub mod hook {
    use std::cell::{Cell, RefCell};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    /// A test scheduler: decides when a registered thread that would block runs again.
    pub trait Scheduler: Send + Sync {
        /// The calling (registered) thread would block on `what`: returns when the scheduler
        /// lets it try again.
        fn yield_now(&self, what: &'static str);

        /// The calling (registered) thread would block on a lock of the crate whose holder
        /// word is `holder` (the holder's [`thread_id`], 0 when free): returns when the
        /// scheduler lets it try again. `holder` stays valid until this returns; while the
        /// thread waits here, a scheduler may read it to tell whether a try could succeed (the
        /// lock free, or held by a thread that it does not stop).
        fn wait_for_lock(&self, holder: &AtomicU64) {
            let _ = holder;
            self.yield_now("lock");
        }
    }

    thread_local! {
        static SCHED: RefCell<Option<Arc<dyn Scheduler>>> = const { RefCell::new(None) };
        static ID: Cell<u64> = const { Cell::new(0) };
        /// The crate's locks this thread holds (see [`super::locks_held`]).
        static HELD: Cell<usize> = const { Cell::new(0) };
    }

    /// The crate's locks the calling thread holds.
    pub(crate) fn held() -> usize {
        HELD.try_with(|h| h.get()).unwrap_or(0)
    }

    /// A held lock leaves the count (see `MutexGuard::held_by_user`).
    pub(crate) fn uncount() {
        let _ = HELD.try_with(|h| h.set(h.get().saturating_sub(1)));
    }

    /// It comes back, to be released.
    pub(crate) fn recount() {
        let _ = HELD.try_with(|h| h.set(h.get() + 1));
    }

    static NEXT_ID: AtomicU64 = AtomicU64::new(1);

    /// Wake-ups handed to the crate's background threads, and those that have run.
    pub(crate) static BACKGROUND: (AtomicU64, AtomicU64) = (AtomicU64::new(0), AtomicU64::new(0));

    /// Threads parked without a timeout in the crate right now (see [`is_parked`]); threads
    /// unparked while not listed (their next park returns at once, as `std`'s token says); and
    /// the live threads that took their own handle (`sync::thread::current`, see
    /// [`forget_at_exit`]), the only ones [`super::unpark`] is given. A thread leaves the three
    /// when it exits, and an unpark of a thread that has exited is not kept: a test process
    /// starts a completion poller per context, which a doorbell can unpark after it exited (the
    /// teardown synchronizes the doorbell stream after the poller's join), and one entry left
    /// per context made every lookup slower as a fuzzing campaign went on.
    struct Lists {
        parked: Vec<std::thread::ThreadId>,
        unparked: Vec<std::thread::ThreadId>,
        live: Option<std::collections::HashSet<std::thread::ThreadId>>,
    }

    static PARKED: std::sync::Mutex<Lists> = std::sync::Mutex::new(Lists {
        parked: Vec::new(),
        unparked: Vec::new(),
        live: None,
    });

    fn parked_list() -> std::sync::MutexGuard<'static, Lists> {
        PARKED.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the thread out of [`PARKED`]'s lists when it exits.
    struct ForgetAtExit(std::thread::ThreadId);

    impl Drop for ForgetAtExit {
        fn drop(&mut self) {
            let mut l = parked_list();
            l.parked.retain(|t| *t != self.0);
            l.unparked.retain(|t| *t != self.0);
            if let Some(live) = l.live.as_mut() {
                live.remove(&self.0);
            }
        }
    }

    thread_local! {
        static EXIT: RefCell<Option<ForgetAtExit>> = const { RefCell::new(None) };
    }

    /// The calling thread is live in [`PARKED`] until it exits, and then leaves its lists
    /// (called where a thread takes its own handle, `sync::thread::current`).
    pub(crate) fn forget_at_exit() {
        let _ = EXIT.try_with(|e| {
            if let Ok(mut e) = e.try_borrow_mut() {
                if e.is_none() {
                    let me = std::thread::current().id();
                    parked_list()
                        .live
                        .get_or_insert_with(Default::default)
                        .insert(me);
                    *e = Some(ForgetAtExit(me));
                }
            }
        });
    }

    /// The calling thread listed in [`PARKED`] while this lives (unless a token was pending).
    pub(crate) struct Parked(std::thread::ThreadId);

    impl Parked {
        pub(crate) fn new() -> Parked {
            let me = std::thread::current().id();
            let mut l = parked_list();
            if let Some(i) = l.unparked.iter().position(|t| *t == me) {
                // Unparked before it parks: the park returns at once.
                l.unparked.swap_remove(i);
            } else {
                l.parked.push(me);
            }
            Parked(me)
        }
    }

    impl Drop for Parked {
        fn drop(&mut self) {
            let mut l = parked_list();
            if let Some(i) = l.parked.iter().position(|t| *t == self.0) {
                l.parked.swap_remove(i);
            }
        }
    }

    /// `t` is unparked: runnable from now on (listed no more), or its next park returns at once
    /// (if it is still live).
    pub(crate) fn unparking(t: std::thread::ThreadId) {
        let mut l = parked_list();
        if let Some(i) = l.parked.iter().position(|x| *x == t) {
            l.parked.swap_remove(i);
        } else if l.live.as_ref().is_some_and(|live| live.contains(&t)) && !l.unparked.contains(&t)
        {
            l.unparked.push(t);
        }
    }

    /// The synchronisation layer's part of `__model_hooks::fresh_thread` (in `lib.rs`, which
    /// adds the pool's): the thread is not listed as parked and no unpark of an earlier use is
    /// pending for it.
    pub(crate) fn fresh_thread_sync() {
        let me = std::thread::current().id();
        {
            let mut l = parked_list();
            l.parked.retain(|t| *t != me);
            l.unparked.retain(|t| *t != me);
        }
        // (A token left by an unpark of an earlier use: a new thread has none. Taken by
        // unparking and parking: the park returns at once, with or without an earlier token. A
        // `park_timeout(ZERO)` without a token slept for the kernel's timer slack, ~50 µs.)
        std::thread::current().unpark();
        std::thread::park();
    }

    /// Whether thread `t` is parked without a timeout inside the crate right now (a blocking
    /// acquisition at a cap, waiting for a stream to come back): it runs again only when
    /// something unparks it.
    pub fn is_parked(t: std::thread::ThreadId) -> bool {
        parked_list().parked.contains(&t)
    }

    /// (handed, run): wake-ups handed to the crate's background threads (the waker thread that
    /// runs the wakers of host functions, the thread that looks for ended loans) and those of
    /// them that have run, process-wide. Equal when none is pending: what a model needs to tell
    /// "nothing will wake this future" from "a thread has not run yet", without timing.
    pub fn background() -> (u64, u64) {
        // `run` first: a reading never shows more run than handed.
        let ran = BACKGROUND.1.load(Ordering::SeqCst);
        (BACKGROUND.0.load(Ordering::SeqCst), ran)
    }

    /// The calling thread's identifier in the holder words of the crate's locks (see
    /// [`Scheduler::wait_for_lock`]).
    pub fn thread_id() -> u64 {
        id()
    }

    /// This thread's identifier in a mutex's holder word, shifted left (bit 0 clear). 0 is
    /// "nobody (or in transition)".
    fn id() -> u64 {
        // During thread exit (a thread-local destructor that locks) the id may be gone: such
        // a thread takes a fresh one, which is all the holder word needs.
        let id = ID
            .try_with(|c| {
                if c.get() == 0 {
                    c.set(NEXT_ID.fetch_add(1, Ordering::Relaxed));
                }
                c.get()
            })
            .unwrap_or_else(|_| NEXT_ID.fetch_add(1, Ordering::Relaxed));
        id << 1
    }

    /// [`id`], with bit 0 set when the thread is scheduled.
    fn me() -> u64 {
        id() | u64::from(scheduled())
    }

    /// Registers the calling thread with `sched` until the returned guard is dropped.
    pub fn enter(sched: Arc<dyn Scheduler>) -> Entered {
        SCHED.with(|s| *s.borrow_mut() = Some(sched));
        Entered(std::marker::PhantomData)
    }

    /// Registration of the calling thread ([`enter`]); dropping it unregisters the thread.
    #[must_use]
    #[derive(Debug)]
    pub struct Entered(std::marker::PhantomData<*const ()>);

    impl Drop for Entered {
        fn drop(&mut self) {
            let _ = SCHED.try_with(|s| *s.borrow_mut() = None);
        }
    }

    pub(crate) fn scheduled() -> bool {
        SCHED.try_with(|s| s.borrow().is_some()).unwrap_or(false)
    }

    pub(crate) fn yield_now(what: &'static str) {
        let s = SCHED.try_with(|s| s.borrow().clone()).ok().flatten();
        if let Some(s) = s {
            s.yield_now(what);
        }
    }

    fn wait_for_lock(holder: &AtomicU64) {
        let s = SCHED.try_with(|s| s.borrow().clone()).ok().flatten();
        if let Some(s) = s {
            s.wait_for_lock(holder);
        }
    }

    // The holder word is only a hint to other threads (whom a contended lock waits for) and a
    // record for the holder itself (a re-entrant lock): relaxed stores suffice (a thread always
    // reads its own latest store; another thread that reads a stale word only retries or
    // yields), and keep the hooks' cost per lock to two plain stores, close to a build without
    // them (the benchmarks and examples are built with the hooks: see BENCHMARKS.md).
    pub(crate) fn locked(holder: &AtomicU64) {
        holder.store(id(), Ordering::Relaxed);
        let _ = HELD.try_with(|h| h.set(h.get() + 1));
    }

    pub(crate) fn unlocking(holder: &AtomicU64) {
        holder.store(0, Ordering::Relaxed);
        let _ = HELD.try_with(|h| h.set(h.get().saturating_sub(1)));
    }

    pub(crate) fn lock<'a, T: ?Sized>(
        m: &'a std::sync::Mutex<T>,
        holder: &AtomicU64,
    ) -> std::sync::MutexGuard<'a, T> {
        if let Ok(g) = m.try_lock() {
            locked(holder);
            return g;
        }
        let me = me();
        loop {
            match m.try_lock() {
                Ok(g) => {
                    locked(holder);
                    return g;
                }
                Err(std::sync::TryLockError::Poisoned(p)) => {
                    locked(holder);
                    return p.into_inner();
                }
                Err(std::sync::TryLockError::WouldBlock) => {}
            }
            let h = holder.load(Ordering::Relaxed);
            if h != 0 && h >> 1 == me >> 1 {
                panic!(
                    "re-entrant lock: this thread already holds this lock of the crate \
                     (a deadlock without the model's hooks)"
                );
            }
            if h != 0 && me & 1 == 1 {
                // Held by another thread: a scheduled one is stopped at the scheduler, and one
                // the scheduler does not stop may itself wait for a stopped one (a host
                // function for a lock that a worker holds): let the scheduler run the others.
                wait_for_lock(holder);
            } else if h != 0 {
                // Held by a thread the scheduler does not stop: it will release it by itself.
                let g = m.lock().unwrap_or_else(|p| p.into_inner());
                locked(holder);
                return g;
            } else {
                // Between a holder's locking and its record (or its release): soon resolved.
                std::hint::spin_loop();
                std::thread::yield_now();
            }
        }
    }
}

/// The hooks' holder word (relaxed stores of the thread's id, a `try_lock` first; from review 12
/// of 53d9a30): a re-entrant lock is still reported (a panic, not a deadlock), never falsely,
/// and a scheduled waiter yields to a scheduled holder stopped at the scheduler. The waits on
/// channels and condition variables below are hang guards only.
#[cfg(all(test, feature = "model-hooks", not(loom)))]
mod holder_word_tests {
    use super::{hook, Condvar, Mutex};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{mpsc, Arc};
    use std::time::Duration;

    fn panics_reentrant(f: impl FnOnce() + Send + 'static) {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
            let _ = tx.send(r.err().map(|e| {
                e.downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| e.downcast_ref::<String>().cloned())
                    .unwrap_or_default()
            }));
        });
        let msg = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("hung: a re-entrant lock deadlocked instead of panicking")
            .expect("no panic");
        assert!(msg.contains("re-entrant lock"), "{msg}");
    }

    /// A scheduler that lets the thread go on at once (a yield of the OS).
    struct Free;
    impl hook::Scheduler for Free {
        fn yield_now(&self, _: &'static str) {
            std::thread::yield_now();
        }
    }

    #[test]
    fn a_reentrant_lock_panics_scheduled_or_not() {
        static M: Mutex<u32> = Mutex::new(0);
        panics_reentrant(|| {
            let _g = M.lock();
            let _h = M.lock();
        });
        static N: Mutex<u32> = Mutex::new(0);
        panics_reentrant(|| {
            let _e = hook::enter(Arc::new(Free));
            let _g = N.lock();
            let _h = N.lock();
        });
    }

    #[test]
    fn a_reentrant_lock_after_a_condvar_wait_and_on_a_poisoned_lock_panics() {
        static M: Mutex<bool> = Mutex::new(false);
        static C: Condvar = Condvar::new();
        panics_reentrant(|| {
            let mut g = M.lock();
            // Spawned while the lock is held: it can set the flag only once the wait below
            // has released the lock, so the wait runs.
            std::thread::spawn(|| {
                *M.lock() = true;
                C.notify_all();
            });
            while !*g {
                g = C.wait(g);
            }
            let _h = M.lock();
        });
        // The panic above poisoned M (its guard was held): a new lock takes it, a second panics.
        panics_reentrant(|| {
            let _g = M.lock();
            let _h = M.lock();
        });
        // Scheduled: the wait yields and locks again.
        static S: Mutex<u32> = Mutex::new(0);
        static SC: Condvar = Condvar::new();
        panics_reentrant(|| {
            let _e = hook::enter(Arc::new(Free));
            let g = S.lock();
            let _g = SC.wait(g);
            let _h = S.lock();
        });
    }

    /// A lock taken in a thread-local destructor at thread exit, then again while held.
    #[test]
    fn a_reentrant_lock_in_a_thread_exit_destructor_panics() {
        static M: Mutex<u32> = Mutex::new(0);
        struct Tls(mpsc::Sender<bool>);
        impl Drop for Tls {
            fn drop(&mut self) {
                let r = std::panic::catch_unwind(|| {
                    let _g = M.lock();
                    let _h = M.lock();
                });
                let _ = self.0.send(r.is_err());
            }
        }
        thread_local! { static T: std::cell::RefCell<Option<Tls>> = const { std::cell::RefCell::new(None) }; }
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            // Earlier lock and release on this thread: its id is taken now.
            drop(M.lock());
            T.with(|t| *t.borrow_mut() = Some(Tls(tx)));
        });
        assert!(rx
            .recv_timeout(Duration::from_secs(20))
            .expect("hung: re-entrant lock at thread exit deadlocked"));
    }

    /// Threads that held and released, contended by others (scheduled and not), many times: no
    /// false re-entrancy, no hang, mutual exclusion kept.
    #[test]
    fn no_false_reentrancy_under_contention() {
        static M: Mutex<u64> = Mutex::new(0);
        static INSIDE: AtomicBool = AtomicBool::new(false);
        static DONE: AtomicU64 = AtomicU64::new(0);
        let n = 4;
        let per = 20_000;
        let hs: Vec<_> = (0..n)
            .map(|k| {
                std::thread::spawn(move || {
                    let _e = (k % 2 == 0).then(|| hook::enter(Arc::new(Free)));
                    for i in 0..per {
                        let mut g = M.lock();
                        assert!(!INSIDE.swap(true, Ordering::SeqCst));
                        *g += 1;
                        if i % 64 == 0 {
                            std::thread::yield_now();
                        }
                        INSIDE.store(false, Ordering::SeqCst);
                    }
                    DONE.fetch_add(1, Ordering::SeqCst);
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(*M.lock(), (n * per) as u64);
    }

    /// Fresh threads (fresh ids) each take a lock another thread held and released: no false
    /// re-entrancy.
    #[test]
    fn fresh_threads_never_see_themselves_as_holders() {
        static M: Mutex<u32> = Mutex::new(0);
        for _ in 0..200 {
            let g = M.lock();
            let h = std::thread::spawn(|| {
                *M.lock() += 1;
            });
            std::thread::yield_now();
            drop(g);
            h.join().unwrap();
        }
        assert_eq!(*M.lock(), 200);
    }

    /// A strict turn-taking scheduler of two threads (0 and 1): `yield_now` hands the turn to
    /// the other and waits for it back. Records the reasons of the yields.
    struct Turns {
        turn: std::sync::Mutex<usize>,
        cv: std::sync::Condvar,
        whats: std::sync::Mutex<Vec<(usize, &'static str)>>,
    }
    thread_local! { static WHO: std::cell::Cell<usize> = const { std::cell::Cell::new(0) }; }
    impl Turns {
        fn wait_turn(&self, me: usize) {
            let mut t = self.turn.lock().unwrap();
            while *t != me {
                let (g, to) = self.cv.wait_timeout(t, Duration::from_secs(10)).unwrap();
                assert!(!to.timed_out(), "hung: thread {me} never got its turn back");
                t = g;
            }
        }
        fn pass(&self, to: usize) {
            *self.turn.lock().unwrap() = to;
            self.cv.notify_all();
        }
    }
    impl hook::Scheduler for Turns {
        fn yield_now(&self, what: &'static str) {
            let me = WHO.with(|w| w.get());
            self.whats.lock().unwrap().push((me, what));
            self.pass(1 - me);
            self.wait_turn(me);
        }
    }

    /// A scheduled thread whose lock is held by a scheduled thread stopped at the scheduler
    /// yields to the scheduler (it never spins on a stale "nobody" in the holder word, which
    /// would hang: the holder runs only when the waiter yields).
    #[test]
    fn a_scheduled_waiter_yields_to_a_stopped_scheduled_holder() {
        static M: Mutex<u64> = Mutex::new(0);
        for _ in 0..500 {
            let s = Arc::new(Turns {
                turn: std::sync::Mutex::new(0),
                cv: std::sync::Condvar::new(),
                whats: std::sync::Mutex::new(Vec::new()),
            });
            let (s0, s1) = (s.clone(), s.clone());
            let h = std::thread::spawn(move || {
                WHO.with(|w| w.set(0));
                let _e = hook::enter(s0.clone());
                s0.wait_turn(0);
                let mut g = M.lock();
                *g += 1;
                // Stopped holding the lock (as at a driver call).
                hook::yield_now("driver");
                drop(g);
                s0.pass(1);
            });
            let w = std::thread::spawn(move || {
                WHO.with(|w| w.set(1));
                let _e = hook::enter(s1.clone());
                s1.wait_turn(1);
                *M.lock() += 1;
            });
            h.join().unwrap();
            w.join().unwrap();
            let whats = s.whats.lock().unwrap().clone();
            assert_eq!(whats, vec![(0, "driver"), (1, "lock")]);
        }
        assert_eq!(*M.lock(), 1000);
    }
}
