//! One state per (driver, CUDA context) in the process: the states that can be joined, by key.
//!
//! The registry holds only weak references: a state lives as long as its users hold it, and a
//! dead entry is pruned when met. It never drops a state under its lock (a state's drop is its
//! teardown, which calls the driver and may run user code): whatever it upgrades and does not
//! return is handed back to the caller to drop after the lock is released.

use crate::sync::Mutex;
use std::sync::{Arc, Weak};

/// The key of a state: the driver object's address and the raw CUDA context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Key {
    pub(crate) driver: usize,
    pub(crate) ctx: u64,
}

impl Key {
    /// The key of `ctx` through the driver object `driver` (a state holds its driver, so the
    /// address is not reused while an entry's state lives).
    pub(crate) fn new<D: ?Sized>(driver: &std::sync::Arc<D>, ctx: u64) -> Key {
        Key {
            driver: std::sync::Arc::as_ptr(driver) as *const () as usize,
            ctx,
        }
    }
}

struct Entry<T> {
    key: Key,
    state: Weak<T>,
}

/// Joinable states by [`Key`].
pub(crate) struct Registry<T> {
    entries: Mutex<Vec<Entry<T>>>,
}

/// Strong references taken under the registry's lock and not returned: drop them after it.
pub(crate) type DropLater<T> = Vec<Arc<T>>;

impl<T> Registry<T> {
    /// An empty registry.
    #[cfg(not(loom))]
    pub(crate) const fn new() -> Registry<T> {
        Registry {
            entries: Mutex::new(Vec::new()),
        }
    }

    /// An empty registry (loom's mutex has no `const` constructor).
    #[cfg(loom)]
    pub(crate) fn new() -> Registry<T> {
        Registry {
            entries: Mutex::new(Vec::new()),
        }
    }

    /// The live state registered under `key` for which `usable` holds, if any. `usable` runs
    /// under the registry's lock: crate code only. Drop the second value after this returns.
    pub(crate) fn find(
        &self,
        key: Key,
        usable: impl Fn(&T) -> bool,
    ) -> (Option<Arc<T>>, DropLater<T>) {
        let mut later = Vec::new();
        let mut list = self.entries.lock();
        let found = Self::find_locked(&mut list, key, &usable, &mut later);
        drop(list);
        (found, later)
    }

    /// Registers `new` under `key` unless a usable state is registered there already: returns
    /// the state to use (the registered one, or `new`) and whether `new` was registered. When it
    /// was not, `new` is among the second value's states, to drop after this returns.
    pub(crate) fn register(
        &self,
        key: Key,
        new: Arc<T>,
        usable: impl Fn(&T) -> bool,
    ) -> (Arc<T>, bool, DropLater<T>) {
        let mut later = Vec::new();
        let mut list = self.entries.lock();
        if let Some(there) = Self::find_locked(&mut list, key, &usable, &mut later) {
            drop(list);
            later.push(new);
            return (there, false, later);
        }
        // A state of this key that is not usable any more (a dead context's) is replaced.
        list.retain(|e| e.key != key);
        list.push(Entry {
            key,
            state: Arc::downgrade(&new),
        });
        drop(list);
        (new, true, later)
    }

    fn find_locked(
        list: &mut Vec<Entry<T>>,
        key: Key,
        usable: &impl Fn(&T) -> bool,
        later: &mut DropLater<T>,
    ) -> Option<Arc<T>> {
        // Prune the entries of states that are gone (a weak reference's drop runs no state
        // code: the state was dropped already).
        list.retain(|e| e.state.strong_count() > 0);
        let e = list.iter().find(|e| e.key == key)?;
        let s = e.state.upgrade()?;
        if usable(&s) {
            Some(s)
        } else {
            later.push(s);
            None
        }
    }

    /// How many entries are registered (live or not yet pruned), for tests.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn len(&self) -> usize {
        self.entries.lock().len()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const K: Key = Key { driver: 1, ctx: 2 };

    #[test]
    fn a_registered_state_is_found_until_its_last_user_drops_it() {
        let r = Registry::new();
        let a = Arc::new(7);
        let (got, registered, later) = r.register(K, a.clone(), |_| true);
        assert!(registered && Arc::ptr_eq(&got, &a) && later.is_empty());
        let (found, _) = r.find(K, |_| true);
        assert!(Arc::ptr_eq(&found.unwrap(), &a));
        assert!(r.find(Key { driver: 1, ctx: 3 }, |_| true).0.is_none());
        drop((a, got));
        assert!(r.find(K, |_| true).0.is_none());
        assert_eq!(r.len(), 0, "the dead entry is pruned");
    }

    #[test]
    fn a_second_registration_joins_the_first_and_hands_back_the_new_state_to_drop() {
        let r = Registry::new();
        let a = Arc::new(1);
        let _keep = r.register(K, a.clone(), |_| true);
        let b = Arc::new(2);
        let (got, registered, later) = r.register(K, b.clone(), |_| true);
        assert!(!registered && Arc::ptr_eq(&got, &a));
        assert!(later.iter().any(|s| Arc::ptr_eq(s, &b)));
    }

    #[test]
    fn an_unusable_state_is_replaced_and_handed_back_to_drop() {
        let r = Registry::new();
        let dead = Arc::new(0);
        let _keep = r.register(K, dead.clone(), |_| true);
        let (found, later) = r.find(K, |v| *v != 0);
        assert!(found.is_none() && later.iter().any(|s| Arc::ptr_eq(s, &dead)));
        let b = Arc::new(5);
        let (got, registered, _) = r.register(K, b.clone(), |v| *v != 0);
        assert!(registered && Arc::ptr_eq(&got, &b));
        assert_eq!(r.len(), 1);
    }
}
