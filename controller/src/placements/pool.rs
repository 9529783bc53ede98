//! Admission of environments: per placement, at most `capacity` environments exist at
//! once. A slot is held from environment creation until the assignment is terminal
//! (released by the lifecycle, or by the worker when the environment is gone); at start
//! the pools are rebuilt from the drivers' listings, and every sweep adopts what runs and
//! lets go of what no longer exists (a replica's pool counts the placement's environments,
//! whichever replica created or removed them). Waiters learn at once when a slot frees, so
//! a queued assignment starts without polling.

use std::{
    collections::{HashMap, HashSet},
    sync::Mutex,
    time::{Duration, Instant},
};

#[derive(Debug)]
pub struct Pool {
    capacity: usize,
    /// Assignment id → its slot.
    held: Mutex<HashMap<String, Slot>>,
    freed: tokio::sync::Notify,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    taken: Instant,
    /// Its environment is being created: a listing cannot show it yet (an OpenSandbox
    /// create takes up to a minute), so it is never released for being absent.
    creating: bool,
}

impl Pool {
    pub fn new(capacity: usize) -> Self {
        Pool { capacity, held: Mutex::new(HashMap::new()), freed: tokio::sync::Notify::new() }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes a slot for `assignment_id` whose environment is about to be created (see
    /// [`Pool::created`]); true if it holds one now (also when it already did).
    pub fn try_acquire(&self, assignment_id: &str) -> bool {
        let mut held = self.held();
        if let Some(slot) = held.get_mut(assignment_id) {
            slot.creating = true;
            return true;
        }
        if held.len() >= self.capacity {
            return false;
        }
        held.insert(assignment_id.to_owned(), Slot { taken: Instant::now(), creating: true });
        true
    }

    /// The create of `assignment_id`'s environment returned: from now on listings show it.
    pub fn created(&self, assignment_id: &str) {
        if let Some(slot) = self.held().get_mut(assignment_id) {
            slot.creating = false;
        }
    }

    /// Waits up to `wait` for a slot for `assignment_id`.
    pub async fn acquire_within(&self, assignment_id: &str, wait: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let freed = self.freed.notified();
            if self.try_acquire(assignment_id) {
                return true;
            }
            if tokio::time::timeout_at(deadline, freed).await.is_err() {
                return self.try_acquire(assignment_id);
            }
        }
    }

    /// Records a slot found in use at start, even beyond capacity (what runs, runs).
    pub fn adopt(&self, assignment_id: &str) {
        self.held().entry(assignment_id.to_owned()).or_insert_with(|| Slot { taken: Instant::now(), creating: false });
    }

    pub fn release(&self, assignment_id: &str) -> bool {
        let released = self.held().remove(assignment_id).is_some();
        if released {
            self.freed.notify_waiters();
        }
        released
    }

    /// Releases every slot taken before `listed_at` whose environment is not in a listing
    /// made at that moment: another replica removed it, or it vanished. A slot whose
    /// environment is being created, or that was taken after the listing began, is kept.
    pub fn release_absent(&self, present: &HashSet<String>, listed_at: Instant) -> Vec<String> {
        let mut held = self.held();
        let absent: Vec<String> =
            held.iter().filter(|(id, slot)| slot.taken < listed_at && !slot.creating && !present.contains(*id)).map(|(id, _)| id.clone()).collect();
        for id in &absent {
            held.remove(id);
        }
        drop(held);
        if !absent.is_empty() {
            self.freed.notify_waiters();
        }
        absent
    }

    pub fn holds(&self, assignment_id: &str) -> bool {
        self.held().contains_key(assignment_id)
    }

    pub fn in_use(&self) -> usize {
        self.held().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_is_never_exceeded() {
        let pool = Pool::new(2);
        assert!(pool.try_acquire("a"));
        assert!(pool.try_acquire("a"), "re-acquiring a held slot");
        assert!(pool.try_acquire("b"));
        assert!(!pool.try_acquire("c"));
        assert!(pool.release("a"));
        assert!(!pool.release("a"));
        assert!(pool.try_acquire("c"));
        assert_eq!(pool.in_use(), 2);
        pool.adopt("d");
        assert_eq!(pool.in_use(), 3);
        assert!(!pool.try_acquire("e"));
    }

    #[test]
    fn slots_of_vanished_environments_are_released_but_not_those_being_created() {
        let pool = Pool::new(4);
        for id in ["listed", "vanished", "slow-create"] {
            assert!(pool.try_acquire(id));
        }
        pool.created("listed");
        pool.created("vanished");
        // "slow-create" began before the listing and is still being created (an
        // OpenSandbox create of a minute): not in the listing, yet not gone.
        let listed_at = Instant::now();
        assert!(pool.try_acquire("being-created"));
        let present: HashSet<String> = ["listed".to_owned()].into();
        assert_eq!(pool.release_absent(&present, listed_at), vec!["vanished".to_owned()]);
        assert!(pool.holds("listed") && pool.holds("being-created") && pool.holds("slow-create") && !pool.holds("vanished"));
        pool.created("slow-create");
        assert_eq!(pool.release_absent(&present, Instant::now()), vec!["slow-create".to_owned()]);
    }

    #[tokio::test]
    async fn a_waiter_gets_the_slot_as_soon_as_it_frees() {
        let pool = std::sync::Arc::new(Pool::new(1));
        assert!(pool.try_acquire("a"));
        let waiter = {
            let pool = std::sync::Arc::clone(&pool);
            tokio::spawn(async move {
                let started = tokio::time::Instant::now();
                (pool.acquire_within("b", Duration::from_secs(30)).await, started.elapsed())
            })
        };
        // The test's runtime has one thread: yielding runs the waiter up to its wait.
        tokio::task::yield_now().await;
        pool.release("a");
        let (acquired, waited) = waiter.await.unwrap();
        assert!(acquired && pool.holds("b"));
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        assert!(!pool.acquire_within("c", Duration::from_millis(20)).await);
    }
}
