//! Admission pools: per placement, at most `capacity` environments exist at once.
//! A slot is held from environment creation until the assignment is terminal; at start
//! the pools are rebuilt from the drivers' listings.

use std::{collections::HashSet, sync::Mutex};

#[derive(Debug)]
pub struct Pool {
    placement: String,
    capacity: usize,
    held: Mutex<HashSet<String>>,
}

impl Pool {
    pub fn new(placement: impl Into<String>, capacity: usize) -> Self {
        Pool { placement: placement.into(), capacity, held: Mutex::new(HashSet::new()) }
    }

    pub fn placement(&self) -> &str {
        &self.placement
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Takes a slot for `assignment_id`; true if it holds one now (also when it already did).
    pub fn try_acquire(&self, assignment_id: &str) -> bool {
        let mut held = self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if held.contains(assignment_id) {
            return true;
        }
        if held.len() >= self.capacity {
            return false;
        }
        held.insert(assignment_id.to_owned());
        true
    }

    /// Records a slot found in use at start, even beyond capacity (what runs, runs).
    pub fn adopt(&self, assignment_id: &str) {
        self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(assignment_id.to_owned());
    }

    pub fn release(&self, assignment_id: &str) -> bool {
        self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(assignment_id)
    }

    pub fn in_use(&self) -> usize {
        self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_is_never_exceeded() {
        let pool = Pool::new("container.docker", 2);
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
}
