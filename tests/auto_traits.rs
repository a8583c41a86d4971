//! The auto traits that the crate's safety rests on, checked at run time, so that an accidental
//! `unsafe impl Send` or `Sync` fails a test: a `StreamRef` stays on its thread and with its
//! owner, an owner's (and an owned stream's) streams have one thread, capture guards end on the
//! thread that began them. The rules the type system carries are also pinned by the crate's
//! `compile_fail` doctests.

use cuda_stream_pool::{CaptureGuard, CaptureModeGuard, OwnedStream};
use std::marker::PhantomData;

/// Whether a type is `Send`, at run time (autoref specialization: the inherent method exists
/// only when `T: Send` and wins over the trait's fallback).
struct SendProbe<T: ?Sized>(PhantomData<T>);
trait NotSend {
    fn is_send(&self) -> bool {
        false
    }
}
impl<T: ?Sized> NotSend for SendProbe<T> {}
impl<T: ?Sized + Send> SendProbe<T> {
    fn is_send(&self) -> bool {
        true
    }
}
macro_rules! is_send {
    ($t:ty) => {
        SendProbe::<$t>(PhantomData).is_send()
    };
}

/// The same probe for `Sync`.
struct SyncProbe<T: ?Sized>(PhantomData<T>);
trait NotSync {
    fn is_sync(&self) -> bool {
        false
    }
}
impl<T: ?Sized> NotSync for SyncProbe<T> {}
impl<T: ?Sized + Sync> SyncProbe<T> {
    fn is_sync(&self) -> bool {
        true
    }
}
macro_rules! is_sync {
    ($t:ty) => {
        SyncProbe::<$t>(PhantomData).is_sync()
    };
}
// Pins soundness review (issue 12) defect 5: the stale-handle check was check-then-act (now compile errors and these traits)
#[test]
fn stream_refs_are_neither_send_nor_sync_and_owners_are_send_but_not_sync() {
    // The check-then-act window is gone: a `StreamRef` borrows its owner, so the owner cannot be
    // dropped while a reference is in use, and a reference cannot reach another thread (compile
    // errors, pinned by the `compile_fail` doctests of `StreamRef`). What is left to check at run
    // time is that the types really are neither `Send` nor `Sync`.
    assert!(
        is_sync!(u32) && !is_sync!(std::cell::Cell<u32>),
        "the probe works"
    );
    assert!(!is_send!(cuda_stream_pool::StreamRef<'static>));
    assert!(!is_sync!(cuda_stream_pool::StreamRef<'static>));
    assert!(
        !is_sync!(cuda_stream_pool::Owner),
        "an owner's streams have one thread"
    );
    assert!(
        !is_sync!(OwnedStream),
        "an owned stream's references have one thread"
    );
    assert!(is_send!(cuda_stream_pool::Owner) && is_send!(OwnedStream));
}

// Pins soundness review (issue 12) defect 11: capture guards were `Send`
#[test]
fn capture_guards_are_not_send() {
    // The probe itself works.
    assert!(is_send!(u32));
    assert!(!is_send!(std::rc::Rc<u32>));
    let guard = is_send!(CaptureGuard<'static>);
    let mode = is_send!(CaptureModeGuard<'static>);
    assert!(
        !guard && !mode,
        "capture guards must not be Send (a capture ends on its own thread; a thread's capture \
         mode is per thread): CaptureGuard Send = {guard}, CaptureModeGuard Send = {mode}"
    );
}
