//! [`Leases`] on JetStream: the KV bucket `<bucket>-leases`, one key per lease, taken
//! and renewed by compare-and-set on its revision.

use std::time::Duration;

use async_nats::jetstream::kv;
use async_trait::async_trait;

use super::{JetStream, unavailable};
use crate::store::{Lease, Leases, StoreError, now_ms};

#[async_trait]
impl Leases for JetStream {
    async fn lease(&self, name: &str, holder: &str, ttl: Duration) -> Result<bool, StoreError> {
        let what = || format!("the lease {name}");
        let corrupt = |e: serde_json::Error| StoreError::Corrupt { key: name.to_owned(), reason: e.to_string() };
        let entry = self.leases.entry(name).await.map_err(unavailable(what()))?.filter(|e| e.operation == kv::Operation::Put);
        let current: Option<Lease> = entry.as_ref().map(|e| serde_json::from_slice(&e.value)).transpose().map_err(corrupt)?;
        let Some(next) = Lease::take(current.as_ref(), holder, now_ms(), ttl) else { return Ok(false) };
        let next = serde_json::to_vec(&next).map_err(corrupt)?;
        let outcome = match entry {
            None => self.leases.create(name, next.into()).await.map(|_| ()).map_err(|e| e.to_string()),
            Some(entry) => self.leases.update(name, next.into(), entry.revision).await.map(|_| ()).map_err(|e| e.to_string()),
        };
        // Losing the compare-and-set means another holder took it first.
        Ok(outcome.is_ok())
    }

    async fn release_lease(&self, name: &str, holder: &str) -> Result<(), StoreError> {
        let what = || format!("the lease {name}");
        if let Some(entry) = self.leases.entry(name).await.map_err(unavailable(what()))?
            && entry.operation == kv::Operation::Put
            && serde_json::from_slice::<Lease>(&entry.value).is_ok_and(|l| l.holder == holder)
        {
            let _ = self.leases.delete_expect_revision(name, Some(entry.revision)).await;
        }
        Ok(())
    }
}
