//! Work that could not be done yet, kept for a later attempt: a free whose stream is capturing
//! or whose ordered free the driver refused, a stream still busy when its handle went, a stream
//! whose loan is still out, host memory a copy may still use. The context keeps one list per
//! kind and one count of everything kept, so that the fast path of every flush reads an atomic
//! and takes no lock. Nothing here runs user code or calls the driver: items are taken out
//! whole and acted on by the caller, outside the list's lock.

use crate::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// One kind of kept work (see the module docs).
pub(crate) struct RetryList<T>(Mutex<Vec<T>>);

impl<T> RetryList<T> {
    pub(crate) fn new() -> Self {
        RetryList(Mutex::new(Vec::new()))
    }

    /// Keeps `item` for a later attempt, counted in `pending`.
    pub(crate) fn keep(&self, item: T, pending: &AtomicUsize) {
        let mut list = self.0.lock();
        list.push(item);
        // Counted under the list's lock, as `take_all` uncounts: `pending` never underflows.
        pending.fetch_add(1, Ordering::AcqRel);
    }

    /// Takes every kept item for an attempt, uncounted from `pending` (an item that fails
    /// again is kept, and counted, again).
    pub(crate) fn take_all(&self, pending: &AtomicUsize) -> Vec<T> {
        let mut list = self.0.lock();
        pending.fetch_sub(list.len(), Ordering::AcqRel);
        std::mem::take(&mut *list)
    }

    /// Whether any kept item satisfies `f` (under the list's lock: `f` must not block or run
    /// user code).
    pub(crate) fn any(&self, f: impl FnMut(&T) -> bool) -> bool {
        self.0.lock().iter().any(f)
    }

    /// The items, with exclusive access (teardown).
    pub(crate) fn get_mut(&mut self) -> &mut Vec<T> {
        self.0.get_mut()
    }

    /// Moves the items into a new list (a state moved elsewhere for its teardown).
    pub(crate) fn take_list(&mut self) -> RetryList<T> {
        RetryList(Mutex::new(std::mem::take(self.0.get_mut())))
    }
}
