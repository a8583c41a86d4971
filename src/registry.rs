//! One state per (driver, CUDA context) in the process: the states that can be joined, by key.
//!
//! The registry holds only weak references: a state lives as long as its users hold it. Its
//! entries are sorted by key, so a lookup is a binary search, not a scan: a process may hold
//! many states for good (every state kept by a leaked capture guard stays registered, and the
//! model's fuzzing campaigns leak thousands on purpose; scanning them at every
//! `Context::primary` took a sixth of a campaign's time late in its run). A dead entry is
//! pruned when its key is looked up, and all dead entries once the list has grown past twice
//! what the last such pruning left (plus a few), so dead entries never outnumber by much the
//! states that were live then. It never drops a
//! state under its lock (a state's drop is its teardown, which calls the driver and may run
//! user code): whatever it upgrades and does not return is handed back to the caller to drop
//! after the lock is released.

use crate::sync::Mutex;
use std::sync::{Arc, Weak};

/// The key of a state: the driver object's address and the raw CUDA context.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
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

/// The entries, sorted by key, at most one per key.
struct Entries<T> {
    list: Vec<Entry<T>>,
    /// The list's length after its last pruning of every dead entry.
    after_prune: usize,
}

/// Entries a list may hold beyond twice its length after the last pruning, before the next.
const PRUNE_SLACK: usize = 16;

/// Joinable states by [`Key`].
pub(crate) struct Registry<T> {
    entries: Mutex<Entries<T>>,
}

/// Strong references taken under the registry's lock and not returned: drop them after it.
pub(crate) type DropLater<T> = Vec<Arc<T>>;

impl<T> Registry<T> {
    /// An empty registry.
    #[cfg(not(loom))]
    pub(crate) const fn new() -> Registry<T> {
        Registry {
            entries: Mutex::new(Entries {
                list: Vec::new(),
                after_prune: 0,
            }),
        }
    }

    /// An empty registry (loom's mutex has no `const` constructor).
    #[cfg(loom)]
    pub(crate) fn new() -> Registry<T> {
        Registry {
            entries: Mutex::new(Entries {
                list: Vec::new(),
                after_prune: 0,
            }),
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
        let mut e = self.entries.lock();
        let found = Self::find_locked(&mut e, key, &usable, &mut later);
        drop(e);
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
        let mut e = self.entries.lock();
        if let Some(there) = Self::find_locked(&mut e, key, &usable, &mut later) {
            drop(e);
            later.push(new);
            return (there, false, later);
        }
        // A state of this key that is not usable any more (a dead context's) is replaced.
        let entry = Entry {
            key,
            state: Arc::downgrade(&new),
        };
        match e.list.binary_search_by(|x| x.key.cmp(&key)) {
            Ok(i) => e.list[i] = entry,
            Err(i) => e.list.insert(i, entry),
        }
        drop(e);
        (new, true, later)
    }

    fn find_locked(
        e: &mut Entries<T>,
        key: Key,
        usable: &impl Fn(&T) -> bool,
        later: &mut DropLater<T>,
    ) -> Option<Arc<T>> {
        // Prune the entries of states that are gone (a weak reference's drop runs no state
        // code: the state was dropped already): all of them once the list has doubled.
        if e.list.len() > 2 * e.after_prune + PRUNE_SLACK {
            e.list.retain(|x| x.state.strong_count() > 0);
            e.after_prune = e.list.len();
        }
        let i = e.list.binary_search_by(|x| x.key.cmp(&key)).ok()?;
        let Some(s) = e.list[i].state.upgrade() else {
            e.list.remove(i);
            return None;
        };
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
        self.entries.lock().list.len()
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

    /// Keys registered in any order are each found (the list is kept sorted for the binary
    /// search), and a replaced key keeps one entry.
    #[test]
    fn states_of_many_keys_are_each_found_by_their_key() {
        let r = Registry::new();
        let keys: Vec<Key> = (0..64u64)
            .map(|i| Key {
                driver: ((i * 37) % 64) as usize,
                ctx: (i * 11) % 5,
            })
            .collect();
        let states: Vec<Arc<Key>> = keys.iter().map(|&k| Arc::new(k)).collect();
        for (k, s) in keys.iter().zip(&states) {
            let (got, registered, _) = r.register(*k, s.clone(), |_| true);
            assert!(registered && Arc::ptr_eq(&got, s));
        }
        for (k, s) in keys.iter().zip(&states) {
            let (found, _) = r.find(*k, |_| true);
            assert!(Arc::ptr_eq(&found.expect("registered"), s), "{k:?}");
        }
        assert!(r.find(Key { driver: 64, ctx: 0 }, |_| true).0.is_none());
        assert_eq!(r.len(), 64);
    }

    /// The entries of states that are gone are pruned once the list has grown past twice its
    /// size after the last pruning (plus the slack): however many states come and go, the list
    /// stays bounded by the live ones, and the live entries stay.
    #[test]
    fn dead_entries_are_pruned_so_the_list_stays_bounded_by_the_live_states() {
        let r = Registry::new();
        let live: Vec<Arc<u32>> = (0..8).map(Arc::new).collect();
        for (i, s) in live.iter().enumerate() {
            r.register(
                Key {
                    driver: 1_000,
                    ctx: i as u64,
                },
                s.clone(),
                |_| true,
            );
        }
        for i in 0..1_000u64 {
            // Registered, then dropped at once: a dead entry of its own key.
            r.register(Key { driver: 7, ctx: i }, Arc::new(0), |_| true);
        }
        assert!(r.find(Key { driver: 3, ctx: 3 }, |_| true).0.is_none());
        assert!(
            r.len() <= 2 * live.len() + PRUNE_SLACK + 1,
            "{} entries for {} live states",
            r.len(),
            live.len()
        );
        for (i, s) in live.iter().enumerate() {
            let (found, _) = r.find(
                Key {
                    driver: 1_000,
                    ctx: i as u64,
                },
                |_| true,
            );
            assert!(Arc::ptr_eq(&found.unwrap(), s));
        }
    }

    /// Below the bound, a dead entry is pruned when its own key is looked up.
    #[test]
    fn a_dead_entry_is_pruned_when_its_key_is_looked_up() {
        let r = Registry::new();
        let (a, c) = (Arc::new(1), Arc::new(3));
        r.register(Key { driver: 1, ctx: 1 }, a.clone(), |_| true);
        r.register(Key { driver: 1, ctx: 2 }, Arc::new(2), |_| true);
        r.register(Key { driver: 1, ctx: 3 }, c.clone(), |_| true);
        assert_eq!(r.len(), 3);
        assert!(r.find(Key { driver: 1, ctx: 2 }, |_| true).0.is_none());
        assert_eq!(r.len(), 2);
        assert!(Arc::ptr_eq(
            &r.find(Key { driver: 1, ctx: 3 }, |_| true).0.unwrap(),
            &c
        ));
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
