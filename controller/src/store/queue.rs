//! The work queues, one per placement: the [`Queue`] trait, and the [`Consumer`] and
//! [`Delivery`] it hands out. (An assignment's first delivery is queued together with
//! its record, by [`Records::persist`](super::Records::persist).)

use std::time::Duration;

use async_trait::async_trait;

use super::{Record, StoreError};
use crate::assignment::Placement;

/// The placements' queues of assignment ids.
#[async_trait]
pub trait Queue: Send + Sync {
    /// Queues a pending assignment again under a new delivery (its environment ended
    /// before the claim and is to be made again). `generation` tells the deliveries of
    /// one assignment apart; a repeated call with the same one adds nothing.
    async fn requeue(&self, record: &Record, generation: u32) -> Result<(), StoreError>;

    /// Messages waiting (not yet delivered) on a placement's queue.
    async fn queue_depth(&self, placement: Placement) -> Result<u64, StoreError>;

    /// The consumer of one placement's queue, with at most `max_in_flight`
    /// unacknowledged deliveries. Durable: a restarted process gets the same consumer,
    /// and deliveries that were never acknowledged come again (after their ack wait).
    async fn consumer(&self, placement: Placement, max_in_flight: usize) -> Result<Box<dyn Consumer>, StoreError>;
}

#[async_trait]
pub trait Consumer: Send {
    /// The next delivery, or `None` if nothing came within `wait`.
    async fn next(&mut self, wait: Duration) -> Result<Option<Box<dyn Delivery>>, StoreError>;
}

#[async_trait]
pub trait Delivery: Send + Sync {
    fn assignment_id(&self) -> &str;
    /// 1 on first delivery.
    fn attempt(&self) -> u64;
    /// Give it back to be delivered again not before `delay` (the pool is full).
    async fn nak(self: Box<Self>, delay: Duration) -> Result<(), StoreError>;
    /// Done for good; returns once the store has confirmed (JetStream double ack).
    async fn ack(self: Box<Self>) -> Result<(), StoreError>;
}
