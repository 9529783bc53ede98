//! [`Leases`] of the embedded store: in memory, because one process owns a redb file.

use std::sync::PoisonError;
use std::time::Duration;

use async_trait::async_trait;

use super::Embedded;
use crate::store::{Lease, Leases, StoreError, now_ms};

#[async_trait]
impl Leases for Embedded {
    async fn lease(&self, name: &str, holder: &str, ttl: Duration) -> Result<bool, StoreError> {
        // One process owns a redb file, so the leases live in memory.
        let mut leases = self.leases.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(next) = Lease::take(leases.get(name), holder, now_ms(), ttl) else { return Ok(false) };
        leases.insert(name.to_owned(), next);
        Ok(true)
    }

    async fn release_lease(&self, name: &str, holder: &str) -> Result<(), StoreError> {
        let mut leases = self.leases.lock().unwrap_or_else(PoisonError::into_inner);
        if leases.get(name).is_some_and(|l| l.holder == holder) {
            leases.remove(name);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The embedded store's leases expire on the controller's clock: under paused time a
    /// lease holds until the clock passes its time-to-live and not a millisecond longer,
    /// without the test sleeping.
    #[tokio::test(start_paused = true)]
    async fn a_lease_expires_when_the_clock_passes_its_ttl() {
        let dir = tempfile::tempdir().unwrap();
        let store = Embedded::open(&dir.path().join("store.redb")).unwrap();
        let ttl = Duration::from_secs(30);
        assert!(store.lease("scheduler.container.docker", "a", ttl).await.unwrap());
        tokio::time::advance(ttl - Duration::from_millis(2)).await;
        assert!(!store.lease("scheduler.container.docker", "b", ttl).await.unwrap(), "taken over before the lease expired");
        tokio::time::advance(Duration::from_millis(2)).await;
        assert!(store.lease("scheduler.container.docker", "b", ttl).await.unwrap(), "an expired lease was not taken over");
        assert!(!store.lease("scheduler.container.docker", "a", ttl).await.unwrap(), "two holders");
    }
}
