//! Leases: one holder of a name at a time until it stops renewing (one scheduler per
//! registration fetches): [`Lease`] with its rule, [`Lease::take`], which both backends
//! apply, and the [`Leases`] trait.

use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use super::StoreError;

/// A lease as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub holder: String,
    pub expires_at_ms: i64,
}

impl Lease {
    /// The rule of both stores' leases: `holder` asking for `current` at `now_ms` gets a
    /// lease until `ttl` from now — new, renewed, or taken over once the other holder's
    /// has expired — or nothing while another holder's has not. Wall-clock time, because
    /// replicas on different machines compare it.
    pub fn take(current: Option<&Lease>, holder: &str, now_ms: i64, ttl: Duration) -> Option<Lease> {
        if current.is_some_and(|lease| lease.holder != holder && lease.expires_at_ms > now_ms) {
            return None;
        }
        Some(Lease { holder: holder.to_owned(), expires_at_ms: now_ms.saturating_add(i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX)) })
    }
}

/// Where the leases are kept.
#[async_trait]
pub trait Leases: Send + Sync {
    /// Takes or renews the lease `name` for `holder` until `ttl` from now; false while
    /// another holder's lease has not expired. (One scheduler per registration fetches at
    /// a time: a second one waits and takes over when the first stops renewing.)
    async fn lease(&self, name: &str, holder: &str, ttl: Duration) -> Result<bool, StoreError>;

    /// Gives the lease up at once if `holder` holds it (a clean stop hands over sooner).
    async fn release_lease(&self, name: &str, holder: &str) -> Result<(), StoreError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lease rule on a made-up clock (the stores' tests check that each applies it).
    #[test]
    fn a_lease_has_one_holder_until_it_expires() {
        let ttl = Duration::from_secs(2);
        let held = |holder: &str, until: i64| Some(Lease { holder: holder.into(), expires_at_ms: until });
        let cases = [
            ("free: taken", None, "a", 1_000, held("a", 3_000)),
            ("held by another: refused", held("a", 3_000), "b", 1_000, None),
            ("renewed by its holder before expiry", held("a", 3_000), "a", 2_200, held("a", 4_200)),
            ("the renewal holds others off", held("a", 4_200), "b", 3_400, None),
            ("another's, a millisecond before it expires", held("a", 4_200), "b", 4_199, None),
            ("expired at its instant: taken over", held("a", 4_200), "b", 4_200, held("b", 6_200)),
            ("its holder renews after expiry too", held("a", 4_200), "a", 9_000, held("a", 11_000)),
        ];
        for (name, current, holder, now, expected) in cases {
            assert_eq!(Lease::take(current.as_ref(), holder, now, ttl), expected, "{name}");
        }
    }
}
