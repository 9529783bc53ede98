//! The runtime state of each enabled placement, in one registry instead of parallel
//! maps keyed by strings: its capacity, its driver (where this process runs its
//! worker), its environment [`Pool`] (the worker's admission) and its [`Admission`]
//! (the scheduler's: assignments not yet terminal).
//!
//! Two admissions, because they guard different things: the pool bounds environments
//! that exist; the admission bounds tasks taken from Gitea. A task Gitea hands over
//! is "running" there from that moment (its timers start) and cannot be handed back,
//! so the scheduler only fetches while the placement's non-terminal assignments plus
//! the fetches in flight stay below its capacity: a backlog waits in Gitea.

use std::{
    collections::{BTreeMap, HashSet},
    sync::{Arc, Mutex},
};

use crate::{assignment::Placement, driver::Driver, worker::pool::Pool};

#[derive(Debug)]
pub struct PlacementRuntime {
    pub placement: Placement,
    pub capacity: usize,
    /// Present where this process may create and delete this placement's environments.
    pub driver: Option<Arc<dyn Driver>>,
    pub pool: Pool,
    pub admission: Arc<Admission>,
}

/// Every enabled placement of this controller.
#[derive(Debug, Clone, Default)]
pub struct Placements {
    by_placement: BTreeMap<Placement, Arc<PlacementRuntime>>,
}

impl Placements {
    pub fn new() -> Self {
        Placements::default()
    }

    /// Adds a placement; `driver` only where this process runs its worker.
    pub fn add(&mut self, placement: Placement, capacity: usize, driver: Option<Arc<dyn Driver>>) -> Arc<PlacementRuntime> {
        let runtime = Arc::new(PlacementRuntime { placement, capacity, driver, pool: Pool::new(capacity), admission: Arc::new(Admission::new(capacity)) });
        self.by_placement.insert(placement, Arc::clone(&runtime));
        runtime
    }

    pub fn get(&self, placement: Placement) -> Option<&Arc<PlacementRuntime>> {
        self.by_placement.get(&placement)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<PlacementRuntime>> {
        self.by_placement.values()
    }

    pub fn enabled(&self) -> Vec<Placement> {
        self.by_placement.keys().copied().collect()
    }
}

/// The scheduler's admission of one placement: assignments taken from Gitea and not
/// yet terminal, plus fetches in flight, never above capacity.
#[derive(Debug)]
pub struct Admission {
    capacity: usize,
    state: Mutex<AdmissionState>,
    released: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct AdmissionState {
    live: HashSet<String>,
    fetching: usize,
}

impl Admission {
    pub fn new(capacity: usize) -> Self {
        Admission { capacity, state: Mutex::new(AdmissionState::default()), released: tokio::sync::Notify::new() }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, AdmissionState> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Room for one more fetch, held by the returned ticket until it is filled with
    /// an assignment or dropped.
    pub fn try_reserve(self: &Arc<Self>) -> Option<Ticket> {
        let mut state = self.state();
        if state.live.len() + state.fetching >= self.capacity {
            return None;
        }
        state.fetching += 1;
        Some(Ticket { admission: Arc::clone(self), open: true })
    }

    /// Resolves when an assignment was released (call [`Admission::try_reserve`] again).
    pub async fn released(&self) {
        self.released.notified().await;
    }

    /// Counts `assignment_id` as live (start-up recovery, or a task of this placement
    /// fetched by another placement's registration) — even beyond capacity: it is ours.
    pub fn admit(&self, assignment_id: &str) {
        self.state().live.insert(assignment_id.to_owned());
    }

    pub fn release(&self, assignment_id: &str) {
        if self.state().live.remove(assignment_id) {
            self.released.notify_waiters();
        }
    }

    /// The live assignment ids (for a refresh against the store).
    pub fn live(&self) -> Vec<String> {
        self.state().live.iter().cloned().collect()
    }

    /// (live, fetching).
    pub fn usage(&self) -> (usize, usize) {
        let state = self.state();
        (state.live.len(), state.fetching)
    }
}

/// A reserved fetch; dropping it unfilled gives the room back.
#[derive(Debug)]
pub struct Ticket {
    admission: Arc<Admission>,
    open: bool,
}

impl Ticket {
    /// The fetch brought `assignment_id` for this placement: it is live now.
    pub fn fill(mut self, assignment_id: &str) {
        let mut state = self.admission.state();
        state.fetching = state.fetching.saturating_sub(1);
        state.live.insert(assignment_id.to_owned());
        self.open = false;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.open {
            {
                let mut state = self.admission.state();
                state.fetching = state.fetching.saturating_sub(1);
            }
            self.admission.released.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fetches_stop_at_capacity_until_an_assignment_ends() {
        let admission = Arc::new(Admission::new(2));
        let a = admission.try_reserve().unwrap();
        let b = admission.try_reserve().unwrap();
        assert!(admission.try_reserve().is_none(), "two fetches in flight fill capacity 2");
        drop(a);
        let a = admission.try_reserve().unwrap();
        a.fill("gitea-task-1");
        b.fill("gitea-task-2");
        assert_eq!(admission.usage(), (2, 0));
        assert!(admission.try_reserve().is_none());
        admission.release("gitea-task-1");
        assert!(admission.try_reserve().is_some());
        admission.admit("gitea-task-3");
        admission.admit("gitea-task-4");
        assert_eq!(admission.usage(), (3, 0), "admitted beyond capacity: what was fetched is ours");
        assert!(admission.try_reserve().is_none());
    }
}
