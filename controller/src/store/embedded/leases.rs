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
