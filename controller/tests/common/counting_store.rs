//! A store that records what was asked of it (leases by holder, reads of a record), in
//! front of a real one: a test that asserts a scheduler did NOT fetch first waits until the
//! scheduler has demonstrably had its chances — asked for its lease, looked at its room —
//! instead of sleeping for a while.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use async_trait::async_trait;
use controller::{
    assignment::Placement,
    store::{Consumer, Leases, Queue, Record, Records, Store, StoreError, Versioned},
};

/// One call, in the order the store saw them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Lease { holder: String, granted: bool },
    Get { assignment_id: String },
}

#[derive(Debug)]
pub struct CountingStore {
    inner: Arc<dyn Store>,
    events: Mutex<Vec<Event>>,
}

impl CountingStore {
    pub fn new(inner: Arc<dyn Store>) -> Arc<Self> {
        Arc::new(Self { inner, events: Mutex::default() })
    }

    /// Every call so far.
    pub fn events(&self) -> Vec<Event> {
        self.events.lock().unwrap().clone()
    }

    fn record(&self, event: Event) {
        self.events.lock().unwrap().push(event);
    }
}

#[async_trait]
impl Records for CountingStore {
    async fn persist(&self, record: &Record) -> Result<bool, StoreError> {
        self.inner.persist(record).await
    }

    async fn get(&self, assignment_id: &str) -> Result<Option<Versioned<Record>>, StoreError> {
        self.record(Event::Get { assignment_id: assignment_id.to_owned() });
        self.inner.get(assignment_id).await
    }

    async fn update(&self, record: &Record, expected: u64) -> Result<u64, StoreError> {
        self.inner.update(record, expected).await
    }

    async fn list(&self) -> Result<Vec<Versioned<Record>>, StoreError> {
        self.inner.list().await
    }

    async fn list_finished(&self) -> Result<Vec<Versioned<Record>>, StoreError> {
        self.inner.list_finished().await
    }

    async fn prune(&self, ended_before_ms: i64) -> Result<usize, StoreError> {
        self.inner.prune(ended_before_ms).await
    }
}

#[async_trait]
impl Queue for CountingStore {
    async fn requeue(&self, record: &Record, generation: u32) -> Result<(), StoreError> {
        self.inner.requeue(record, generation).await
    }

    async fn queue_depth(&self, placement: Placement) -> Result<u64, StoreError> {
        self.inner.queue_depth(placement).await
    }

    async fn consumer(&self, placement: Placement, max_in_flight: usize) -> Result<Box<dyn Consumer>, StoreError> {
        self.inner.consumer(placement, max_in_flight).await
    }
}

#[async_trait]
impl Leases for CountingStore {
    async fn lease(&self, name: &str, holder: &str, ttl: Duration) -> Result<bool, StoreError> {
        let granted = self.inner.lease(name, holder, ttl).await?;
        self.record(Event::Lease { holder: holder.to_owned(), granted });
        Ok(granted)
    }

    async fn release_lease(&self, name: &str, holder: &str) -> Result<(), StoreError> {
        self.inner.release_lease(name, holder).await
    }
}

#[async_trait]
impl Store for CountingStore {
    async fn healthy(&self) -> Result<(), StoreError> {
        self.inner.healthy().await
    }
}
