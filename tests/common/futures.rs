//! Driving futures by hand in the async tests: a counting waker, a no-op waker, one poll, and a
//! future that yields once.
#![allow(dead_code)]

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Poll, Wake, Waker};

/// A waker that counts its wake-ups.
#[derive(Default)]
pub struct Counting(pub AtomicUsize);
impl Wake for Counting {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// A counting waker and its counter.
pub fn waker() -> (Arc<Counting>, Waker) {
    let c = Arc::new(Counting::default());
    (c.clone(), Waker::from(c))
}

/// A waker that does nothing.
pub struct Noop;
impl Wake for Noop {
    fn wake(self: Arc<Self>) {}
}

/// Polls `f` once with `w`.
pub fn poll<F: Future + ?Sized>(f: Pin<&mut F>, w: &Waker) -> Poll<F::Output> {
    f.poll(&mut std::task::Context::from_waker(w))
}

/// A future that is pending once (waking itself), then ready.
pub struct Yield(pub bool);
impl Future for Yield {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<()> {
        if self.0 {
            Poll::Ready(())
        } else {
            self.0 = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }
}
