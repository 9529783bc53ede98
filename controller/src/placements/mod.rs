//! The state of each enabled placement, in one registry instead of parallel
//! maps keyed by strings: its capacity, its driver (where this process runs its
//! worker), its environment [`Pool`] (the worker's admission) and its [`Admission`]
//! (the scheduler's: assignments not yet terminal).
//!
//! Two admissions, because they guard different things: the pool bounds environments
//! that exist; the admission bounds tasks taken from Gitea. A task Gitea hands over
//! is "running" there from that moment (its timers start) and cannot be handed back,
//! so the scheduler only fetches while the placement's non-terminal assignments plus
//! the fetches in flight stay below its capacity: a backlog waits in Gitea.

pub mod admission;
pub mod pool;

use std::{collections::BTreeMap, sync::Arc};

pub use self::{
    admission::{Admission, Ticket},
    pool::Pool,
};
use crate::{assignment::Placement, driver::Driver};

#[derive(Debug)]
pub struct PlacementState {
    pub placement: Placement,
    pub capacity: usize,
    /// Set where this process may create and delete this placement's environments —
    /// once its backend answered (a backend down at start holds back only its placement).
    driver: std::sync::OnceLock<Arc<dyn Driver>>,
    /// This process runs the placement's worker: its scheduler fetches only once the
    /// driver is there (a task fetched for a backend that cannot make environments would
    /// wait here with Gitea's timers running).
    worker_here: bool,
    pub pool: Pool,
    pub admission: Arc<Admission>,
}

impl PlacementState {
    pub fn driver(&self) -> Option<Arc<dyn Driver>> {
        self.driver.get().cloned()
    }

    /// The driver connected (later than the start).
    pub fn set_driver(&self, driver: Arc<dyn Driver>) {
        let _ = self.driver.set(driver);
    }

    /// Whether this process runs the placement's worker (once its driver is there).
    pub fn worker_here(&self) -> bool {
        self.worker_here
    }

    /// Whether environments of this placement can be made now, as far as this process
    /// knows (a placement whose worker runs elsewhere: yes).
    pub fn can_place(&self) -> bool {
        !self.worker_here || self.driver.get().is_some()
    }
}

/// Every enabled placement of this controller.
#[derive(Debug, Clone, Default)]
pub struct Placements {
    by_placement: BTreeMap<Placement, Arc<PlacementState>>,
}

impl Placements {
    pub fn new() -> Self {
        Placements::default()
    }

    /// Adds a placement; `driver` only where this process runs its worker.
    pub fn add(&mut self, placement: Placement, capacity: usize, driver: Option<Arc<dyn Driver>>) -> Arc<PlacementState> {
        let worker_here = driver.is_some();
        self.insert(placement, capacity, driver, worker_here)
    }

    /// Adds a placement whose worker runs here once its driver connects
    /// ([`PlacementState::set_driver`]).
    pub fn add_awaiting_driver(&mut self, placement: Placement, capacity: usize) -> Arc<PlacementState> {
        self.insert(placement, capacity, None, true)
    }

    fn insert(&mut self, placement: Placement, capacity: usize, driver: Option<Arc<dyn Driver>>, worker_here: bool) -> Arc<PlacementState> {
        let cell = std::sync::OnceLock::new();
        if let Some(driver) = driver {
            let _ = cell.set(driver);
        }
        let state = Arc::new(PlacementState {
            placement,
            capacity,
            driver: cell,
            worker_here,
            pool: Pool::new(capacity),
            admission: Arc::new(Admission::new(capacity)),
        });
        self.by_placement.insert(placement, Arc::clone(&state));
        state
    }

    pub fn get(&self, placement: Placement) -> Option<&Arc<PlacementState>> {
        self.by_placement.get(&placement)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<PlacementState>> {
        self.by_placement.values()
    }

    pub fn enabled(&self) -> Vec<Placement> {
        self.by_placement.keys().copied().collect()
    }
}
