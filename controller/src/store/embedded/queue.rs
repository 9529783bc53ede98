//! [`Queue`] in redb: the table `queue` with its sequence in `meta`, and in memory which
//! entries are in flight or given back for a while; the consumer and its deliveries (see
//! the module docs of `embedded`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use redb::{Database, Durability, ReadableDatabase, ReadableTable};
use tokio::time::Instant;

use super::{Ctx, Embedded, META, QUEUE, QUEUE_SEQ, RECORDS, Shared, blocking, decode};
use crate::{
    assignment::Placement,
    store::{Consumer, Delivery, Queue, Record, State, StoreError},
};

/// In-memory delivery state, keyed by queue sequence.
#[derive(Default)]
pub(super) struct Flights {
    in_flight: HashMap<u64, Flight>,
    /// Given back with a delay: sequence → (placement, deliverable again at).
    delayed: HashMap<u64, (String, Instant)>,
    /// Placement → max in flight, set by the latest `consumer()` for it (like updating
    /// a durable JetStream consumer's MaxAckPending).
    limits: HashMap<String, usize>,
    next_token: u64,
}

struct Flight {
    placement: String,
    /// Tells this delivery apart from a later redelivery of the same entry, so a late
    /// nak of an expired delivery cannot release the new one.
    token: u64,
    deadline: Instant,
}

impl Flights {
    fn expire(&mut self, now: Instant) {
        self.in_flight.retain(|_, flight| flight.deadline > now);
        self.delayed.retain(|_, (_, until)| *until > now);
    }

    /// The earliest moment something of `placement` may become deliverable without a
    /// notification: an ack wait or a nak delay ending.
    fn next_change(&self, placement: &str) -> Option<Instant> {
        let deadlines = self.in_flight.values().filter(|f| f.placement == placement).map(|f| f.deadline);
        let delays = self.delayed.values().filter(|(p, _)| p == placement).map(|(_, until)| *until);
        deadlines.chain(delays).min()
    }
}

/// What one attempt to take a delivery found.
enum Take {
    Got(EmbeddedDelivery),
    /// Nothing deliverable now; re-check on a notification or at this moment.
    Wait(Option<Instant>),
}

fn requeue_blocking(db: &Database, record: &Record) -> Result<(), StoreError> {
    let id = record.assignment_id.as_str();
    let placement = record.placement.to_string();
    let what = || format!("queueing {id} again");
    let txn = db.begin_write().ctx(what)?;
    {
        let records = txn.open_table(RECORDS).ctx(what)?;
        let mut queue = txn.open_table(QUEUE).ctx(what)?;
        let mut meta = txn.open_table(META).ctx(what)?;
        let pending = records.get(id).ctx(what)?.map(|g| decode(id, g.value().1)).transpose()?.is_some_and(|r| r.state == State::Pending);
        let mut queued = false;
        for item in queue.range((placement.as_str(), 0)..=(placement.as_str(), u64::MAX)).ctx(what)? {
            let (_, value) = item.ctx(what)?;
            queued |= value.value().0 == id;
        }
        if pending && !queued {
            let seq = meta.get(QUEUE_SEQ).ctx(what)?.map_or(0, |g| g.value()) + 1;
            queue.insert((placement.as_str(), seq), (id, 0)).ctx(what)?;
            meta.insert(QUEUE_SEQ, seq).ctx(what)?;
        }
    }
    txn.commit().ctx(what)?;
    Ok(())
}

/// Counts one more delivery of a queue entry; `None` if it was acknowledged meanwhile.
/// Committed without fsync: the count is a diagnostic (the attempt number). The next
/// durable commit (any persist, update or ack) writes it, and so does redb when the
/// database is closed cleanly; a crash may lose the latest counts, never an entry.
fn count_delivery(db: &Database, placement: &str, seq: u64) -> Result<Option<u64>, StoreError> {
    let what = || format!("counting a delivery of {placement}#{seq}");
    let mut txn = db.begin_write().ctx(what)?;
    txn.set_durability(Durability::None).ctx(what)?;
    let attempt = {
        let mut queue = txn.open_table(QUEUE).ctx(what)?;
        let current = queue.get((placement, seq)).ctx(what)?.map(|g| {
            let (id, deliveries) = g.value();
            (id.to_owned(), deliveries)
        });
        match current {
            None => None,
            Some((id, deliveries)) => {
                queue.insert((placement, seq), (id.as_str(), deliveries + 1)).ctx(what)?;
                Some(deliveries + 1)
            }
        }
    };
    txn.commit().ctx(what)?;
    Ok(attempt)
}

fn ack_blocking(db: &Database, placement: &str, seq: u64) -> Result<(), StoreError> {
    let what = || format!("acknowledging {placement}#{seq}");
    let txn = db.begin_write().ctx(what)?;
    {
        let mut queue = txn.open_table(QUEUE).ctx(what)?;
        // Already gone is fine: a late ack of an expired delivery whose redelivery was
        // acknowledged first.
        queue.remove((placement, seq)).ctx(what)?;
    }
    txn.commit().ctx(what)?;
    Ok(())
}

#[async_trait]
impl Queue for Embedded {
    async fn requeue(&self, record: &Record, _generation: u32) -> Result<(), StoreError> {
        // One process owns the file: "no queue entry for it" is known exactly, so the
        // generation is not needed to keep a second copy out.
        let (shared, record) = (Arc::clone(&self.shared), record.clone());
        blocking("requeue", move || requeue_blocking(&shared.db, &record)).await?;
        self.shared.notify.notify_waiters();
        Ok(())
    }

    /// Entries of the placement that were never delivered: the same figure as the
    /// JetStream consumer's `num_pending` (entries given back with `nak` or waiting for
    /// redelivery are not counted).
    async fn queue_depth(&self, placement: Placement) -> Result<u64, StoreError> {
        let placement = placement.to_string();
        let placement = placement.as_str();
        // Inline read transaction (see the module docs); a linear scan of one placement's
        // range, which holds at most the assignments waiting for that pool.
        let what = || format!("counting the queue of {placement}");
        let txn = self.shared.db.begin_read().ctx(what)?;
        let queue = txn.open_table(QUEUE).ctx(what)?;
        let mut depth = 0;
        for item in queue.range((placement, 0)..=(placement, u64::MAX)).ctx(what)? {
            let (_, value) = item.ctx(what)?;
            if value.value().1 == 0 {
                depth += 1;
            }
        }
        Ok(depth)
    }

    async fn consumer(&self, placement: Placement, max_in_flight: usize) -> Result<Box<dyn Consumer>, StoreError> {
        let placement = placement.to_string();
        let placement = placement.as_str();
        // At least one: a consumer that may hold nothing would never deliver.
        let max_in_flight = max_in_flight.max(1);
        self.shared.flights().limits.insert(placement.to_owned(), max_in_flight);
        // A raised limit may allow deliveries that waiting consumers could not take.
        self.shared.notify.notify_waiters();
        Ok(Box::new(EmbeddedConsumer { shared: Arc::clone(&self.shared), placement: placement.to_owned(), max_in_flight, ack_wait: self.ack_wait }))
    }
}

struct EmbeddedConsumer {
    shared: Arc<Shared>,
    placement: String,
    /// Fallback for the shared per-placement limit (which the latest `consumer()` sets).
    max_in_flight: usize,
    ack_wait: Duration,
}

impl EmbeddedConsumer {
    /// Marks the oldest deliverable entry of the placement as in flight, if the limit
    /// allows, then counts the delivery on disk.
    async fn take(&self) -> Result<Take, StoreError> {
        let now = Instant::now();
        let (seq, assignment_id, token) = {
            let mut flights = self.shared.flights();
            flights.expire(now);
            let wake = flights.next_change(&self.placement);
            let limit = flights.limits.get(&self.placement).copied().unwrap_or(self.max_in_flight);
            let busy = flights.in_flight.values().filter(|f| f.placement == self.placement).count();
            if busy >= limit {
                return Ok(Take::Wait(wake));
            }
            // Inline read transaction under the (std) mutex: it is short (see the module
            // docs) and holding the mutex makes "find a free entry and mark it" atomic
            // for consumers of the same placement.
            let what = || format!("reading the queue of {}", self.placement);
            let txn = self.shared.db.begin_read().ctx(what)?;
            let queue = txn.open_table(QUEUE).ctx(what)?;
            let mut found = None;
            for item in queue.range((self.placement.as_str(), 0)..=(self.placement.as_str(), u64::MAX)).ctx(what)? {
                let (key, value) = item.ctx(what)?;
                let seq = key.value().1;
                if !flights.in_flight.contains_key(&seq) && !flights.delayed.contains_key(&seq) {
                    found = Some((seq, value.value().0.to_owned()));
                    break;
                }
            }
            let Some((seq, assignment_id)) = found else {
                return Ok(Take::Wait(wake));
            };
            flights.next_token += 1;
            let token = flights.next_token;
            let flight = Flight { placement: self.placement.clone(), token, deadline: now + self.ack_wait };
            flights.in_flight.insert(seq, flight);
            (seq, assignment_id, token)
        };
        let shared = Arc::clone(&self.shared);
        let placement = self.placement.clone();
        let counted = blocking("delivery", move || count_delivery(&shared.db, &placement, seq)).await;
        match counted {
            Ok(Some(attempt)) => {
                Ok(Take::Got(EmbeddedDelivery { shared: Arc::clone(&self.shared), placement: self.placement.clone(), seq, token, assignment_id, attempt }))
            }
            other => {
                // Acknowledged meanwhile (a late ack of an earlier delivery), or the count
                // failed: release the slot so the entry is not stuck until the ack wait.
                release(&self.shared, seq, token);
                other.map(|_| Take::Wait(Some(now)))
            }
        }
    }
}

/// Frees an in-flight slot if it still belongs to the delivery holding `token`.
fn release(shared: &Shared, seq: u64, token: u64) -> bool {
    let mut flights = shared.flights();
    if flights.in_flight.get(&seq).is_some_and(|f| f.token == token) {
        flights.in_flight.remove(&seq);
        true
    } else {
        false
    }
}

#[async_trait]
impl Consumer for EmbeddedConsumer {
    /// Waits on the store's `Notify` and on the earliest timer that can change the
    /// answer; never polls. If this future is dropped after an entry was marked in
    /// flight (while its delivery is being counted), that entry comes again after the
    /// ack wait, as with JetStream.
    async fn next(&mut self, wait: Duration) -> Result<Option<Box<dyn Delivery>>, StoreError> {
        let deadline = Instant::now() + wait;
        loop {
            // Register for notifications before looking, so a persist between the look
            // and the wait is not missed.
            let notified = self.shared.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let wake = match self.take().await? {
                Take::Got(delivery) => return Ok(Some(Box::new(delivery))),
                Take::Wait(wake) => wake,
            };
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            let until = wake.map_or(deadline, |w| w.min(deadline));
            tokio::select! {
                () = &mut notified => {}
                () = tokio::time::sleep_until(until) => {}
            }
        }
    }
}

struct EmbeddedDelivery {
    shared: Arc<Shared>,
    placement: String,
    seq: u64,
    token: u64,
    assignment_id: String,
    attempt: u64,
}

#[async_trait]
impl Delivery for EmbeddedDelivery {
    fn assignment_id(&self) -> &str {
        &self.assignment_id
    }

    fn attempt(&self) -> u64 {
        self.attempt
    }

    /// In memory only, like a JetStream nak (which the server does not confirm): after a
    /// restart the entry is deliverable at once.
    async fn nak(self: Box<Self>, delay: Duration) -> Result<(), StoreError> {
        if release(&self.shared, self.seq, self.token) && !delay.is_zero() {
            let until = Instant::now() + delay;
            self.shared.flights().delayed.insert(self.seq, (self.placement.clone(), until));
        }
        self.shared.notify.notify_waiters();
        Ok(())
    }

    async fn ack(self: Box<Self>) -> Result<(), StoreError> {
        let shared = Arc::clone(&self.shared);
        let placement = self.placement.clone();
        let seq = self.seq;
        blocking("ack", move || ack_blocking(&shared.db, &placement, seq)).await?;
        {
            // The entry is gone, so whichever delivery of it holds the slot frees it.
            let mut flights = self.shared.flights();
            flights.in_flight.remove(&self.seq);
            flights.delayed.remove(&self.seq);
        }
        self.shared.notify.notify_waiters();
        Ok(())
    }
}
