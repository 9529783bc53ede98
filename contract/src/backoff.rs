//! One retry pause for every loop of both binaries: it doubles from a first pause to a
//! ceiling, with ±20 % jitter so many environments or replicas do not retry in step.

use std::time::Duration;

/// Pauses between attempts.
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    ceiling: Duration,
    next: Duration,
}

impl Backoff {
    pub fn new(first: Duration, ceiling: Duration) -> Self {
        Backoff { first, ceiling, next: first }
    }

    /// The pause before the next attempt (jittered); the one after it is twice as long,
    /// up to the ceiling.
    pub fn next_delay(&mut self) -> Duration {
        let base = self.next;
        self.next = (self.next * 2).min(self.ceiling);
        // No randomness source is worth a dependency here: the clock's nanoseconds differ
        // between processes and attempts, which is all jitter needs.
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let jitter = f64::from(nanos % 400) / 1000.0 - 0.2;
        base.mul_f64(1.0 + jitter)
    }

    /// Back to the first pause (after a success).
    pub fn reset(&mut self) {
        self.next = self.first;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_double_to_the_ceiling_with_jitter_and_reset() {
        let mut backoff = Backoff::new(Duration::from_millis(250), Duration::from_secs(5));
        let delays: Vec<Duration> = (0..8).map(|_| backoff.next_delay()).collect();
        assert!(delays[0] >= Duration::from_millis(200) && delays[0] <= Duration::from_millis(300), "{delays:?}");
        assert!(delays[1] >= Duration::from_millis(400) && delays[1] <= Duration::from_millis(600), "{delays:?}");
        for delay in &delays[5..] {
            assert!(*delay >= Duration::from_secs(4) && *delay <= Duration::from_secs(6), "{delays:?}");
        }
        backoff.reset();
        assert!(backoff.next_delay() <= Duration::from_millis(300));
    }
}
