//! The scheduler's admission of one placement: how many tasks it may take from Gitea.
//! A task Gitea hands over is "running" there from that moment and cannot be handed
//! back, so fetches stop while the placement's live assignments plus the fetches in
//! flight reach its capacity.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

/// The scheduler's admission of one placement: assignments taken from Gitea and not
/// yet terminal, plus fetches in flight, never above capacity.
#[derive(Debug)]
pub struct Admission {
    capacity: usize,
    state: Mutex<AdmissionState>,
    released: tokio::sync::Notify,
    /// How many assignments have ended here: idle fetch loops watch it, since a job
    /// that ends often queues the jobs that need it.
    ended: tokio::sync::watch::Sender<u64>,
}

#[derive(Debug, Default)]
struct AdmissionState {
    /// Assignment id → whether its record is persisted (only a persisted one can be
    /// checked against the store: a fetched task whose record is being written is not
    /// "gone").
    live: HashMap<String, bool>,
    fetching: usize,
}

impl Admission {
    pub fn new(capacity: usize) -> Self {
        Admission { capacity, state: Mutex::new(AdmissionState::default()), released: tokio::sync::Notify::new(), ended: tokio::sync::watch::channel(0).0 }
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
        self.state().live.insert(assignment_id.to_owned(), true);
    }

    /// The record of a fetched assignment is persisted: from now on a refresh against
    /// the store may find it finished.
    pub fn persisted(&self, assignment_id: &str) {
        if let Some(persisted) = self.state().live.get_mut(assignment_id) {
            *persisted = true;
        }
    }

    pub fn release(&self, assignment_id: &str) {
        if self.state().live.remove(assignment_id).is_some() {
            self.released.notify_waiters();
            self.ended.send_modify(|ended| *ended = ended.wrapping_add(1));
        }
    }

    /// Changes each time an assignment of this placement ends (not when an unused fetch
    /// ticket is dropped).
    pub fn ended(&self) -> tokio::sync::watch::Receiver<u64> {
        self.ended.subscribe()
    }

    /// The live assignment ids whose records are persisted (for a refresh against the
    /// store; the others are being written).
    pub fn persisted_live(&self) -> Vec<String> {
        self.state().live.iter().filter(|(_, persisted)| **persisted).map(|(id, _)| id.clone()).collect()
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
        state.live.insert(assignment_id.to_owned(), false);
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

    /// A fetched task whose record is still being written is not checked against the
    /// store (it would read as gone and free its room: one fetch too many).
    #[test]
    fn only_persisted_assignments_are_refreshed_against_the_store() {
        let admission = Arc::new(Admission::new(2));
        admission.try_reserve().unwrap().fill("gitea-task-1");
        admission.admit("gitea-task-2");
        assert_eq!(admission.persisted_live(), ["gitea-task-2"]);
        admission.persisted("gitea-task-1");
        let mut live = admission.persisted_live();
        live.sort();
        assert_eq!(live, ["gitea-task-1", "gitea-task-2"]);
    }
}
