//! Which threads run the crate's host functions: a flag per thread, set for the duration of
//! one. The device rules refuse every driver call there ([`super::DeviceRules`]); the host
//! function wrapper that sets it is `crate::hostfn::host_fn`, above this layer.

#[cfg(not(loom))]
thread_local! {
    static IN_HOST_FN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

// Loom's threads share one OS thread: the flag is one per loom thread.
#[cfg(loom)]
loom::thread_local! {
    static IN_HOST_FN: std::cell::Cell<bool> = std::cell::Cell::new(false);
}

/// Whether the calling thread is running a host function enqueued by the crate. There the driver
/// must not be called (the real driver refuses or deadlocks), and waiting for the GPU would wait
/// for the running host function itself.
pub(crate) fn on_host_fn_thread() -> bool {
    IN_HOST_FN.try_with(|f| f.get()).unwrap_or(false)
}

/// Runs `f` marked as a host function of the crate (the mark is cleared afterwards, also when
/// `f` panics).
pub(crate) fn as_host_fn_thread<R>(f: impl FnOnce() -> R) -> R {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            let _ = IN_HOST_FN.try_with(|x| x.set(false));
        }
    }
    let _ = IN_HOST_FN.try_with(|x| x.set(true));
    let _reset = Reset;
    f()
}
