//! A token bucket per assignment for the facade's reports. gitea-runner reports about
//! once a second (its log and state tickers) and a supervisor a handful of phases; an
//! environment that sends much more is broken or hostile, and every report costs the
//! controller a store read and Gitea a request.

use std::{
    collections::HashMap,
    sync::{Mutex, PoisonError},
    time::Instant,
};

/// Sustained reports per second and assignment.
pub const REPORTS_PER_SECOND: f64 = 20.0;
/// Reports an assignment may send at once (a runner catching up after a pause).
pub const REPORTS_BURST: f64 = 200.0;
/// Log bytes per second and assignment, sustained: a verbose build writes far less.
pub const LOG_BYTES_PER_SECOND: f64 = 1024.0 * 1024.0;
/// Log bytes an assignment may send at once: a runner's backlog after a pause of a
/// minute or two. More goes on at the sustained rate (every piece that went through stays
/// acknowledged), so that one job's flood does not take the controller's and Gitea's time
/// from the others' start-up (tests/e2e neighbours).
pub const LOG_BYTES_BURST: f64 = 8.0 * 1024.0 * 1024.0;
/// Buckets kept before idle ones are dropped.
const MAX_BUCKETS: usize = 10_000;

#[derive(Debug)]
pub struct PerAssignment {
    per_second: f64,
    burst: f64,
    buckets: Mutex<HashMap<String, Bucket>>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl PerAssignment {
    pub fn new(per_second: f64, burst: f64) -> Self {
        PerAssignment { per_second, burst, buckets: Mutex::new(HashMap::new()) }
    }

    /// Whether `assignment_id` may send one more report now.
    pub fn admit(&self, assignment_id: &str) -> bool {
        self.admit_at(assignment_id, 1.0, Instant::now())
    }

    /// Whether `assignment_id` may send `cost` more (bytes) now.
    pub fn admit_cost(&self, assignment_id: &str, cost: f64) -> bool {
        self.admit_at(assignment_id, cost, Instant::now())
    }

    fn admit_at(&self, assignment_id: &str, cost: f64, now: Instant) -> bool {
        let mut buckets = self.buckets.lock().unwrap_or_else(PoisonError::into_inner);
        if buckets.len() >= MAX_BUCKETS && !buckets.contains_key(assignment_id) {
            // A full bucket is as good as none: drop those that refilled.
            let (per_second, burst) = (self.per_second, self.burst);
            buckets.retain(|_, bucket| bucket.tokens + now.duration_since(bucket.at).as_secs_f64() * per_second < burst);
        }
        let bucket = buckets.entry(assignment_id.to_owned()).or_insert(Bucket { tokens: self.burst, at: now });
        bucket.tokens = (bucket.tokens + now.duration_since(bucket.at).as_secs_f64() * self.per_second).min(self.burst);
        bucket.at = now;
        // More than the burst at once is admitted from a full bucket (else never), and
        // leaves it owing.
        if bucket.tokens >= cost.min(self.burst) {
            bucket.tokens -= cost;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_burst_then_the_sustained_rate_per_assignment() {
        let limit = PerAssignment::new(10.0, 5.0);
        let start = Instant::now();
        let admitted = (0..20).filter(|_| limit.admit_at("a", 1.0, start)).count();
        assert_eq!(admitted, 5, "the burst");
        assert!(limit.admit_at("b", 1.0, start), "another assignment has its own bucket");
        assert!(!limit.admit_at("a", 1.0, start + Duration::from_millis(50)), "half a token");
        assert!(limit.admit_at("a", 1.0, start + Duration::from_millis(110)));
        let later = start + Duration::from_secs(10);
        assert_eq!((0..20).filter(|_| limit.admit_at("a", 1.0, later)).count(), 5, "refilled to the burst, no more");
        // Costs (log bytes): more than the burst passes once from a full bucket, then owes.
        assert!(limit.admit_at("c", 12.0, start));
        assert!(!limit.admit_at("c", 1.0, start + Duration::from_millis(500)), "owes 7, refilled 5");
        assert!(limit.admit_at("c", 1.0, start + Duration::from_millis(900)));
    }
}
