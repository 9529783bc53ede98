//! One retry pause for every loop of both binaries: it doubles from a first pause to a
//! ceiling, with ±20 % jitter so many environments or replicas do not retry in step; and
//! one retry loop, [`retry_until`], for the calls that are tried again until a deadline.

use std::{future::Future, time::Duration};

use tokio::time::Instant;

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

/// Runs `op` until it succeeds, fails for good, or the deadline would pass: after an
/// error that `is_transient` accepts, `on_retry` hears of it and of the pause (where a
/// caller logs "retrying"), and `op` runs again once the backoff's next pause is over. An
/// error that is not transient, or one whose pause would not end before `deadline`, is
/// returned as it is, at once. On tokio's clock, so a test with a paused clock runs it
/// without waiting.
///
/// # Errors
/// The last error of `op`: a permanent one, or a transient one at the deadline.
pub async fn retry_until<T, E, F, Fut>(
    deadline: Instant,
    backoff: &mut Backoff,
    is_transient: impl Fn(&E) -> bool,
    mut on_retry: impl FnMut(&E, Duration),
    mut op: F,
) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    loop {
        let error = match op().await {
            Ok(value) => return Ok(value),
            Err(error) => error,
        };
        let pause = backoff.next_delay();
        if !is_transient(&error) || Instant::now() + pause >= deadline {
            return Err(error);
        }
        on_retry(&error, pause);
        tokio::time::sleep(pause).await;
    }
}

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};

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

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Failure {
        Transient,
        Permanent,
    }

    /// `op` answers from `answers` in turn (the last one again once they run out), and
    /// the test sees when each attempt ran and which pauses were announced.
    async fn run(answers: &[Result<u32, Failure>], within: Duration) -> (Result<u32, Failure>, Vec<Duration>, Vec<Duration>) {
        let start = Instant::now();
        let attempts = RefCell::new(Vec::new());
        let announced = RefCell::new(Vec::new());
        let next = Cell::new(0);
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let outcome = retry_until(
            start + within,
            &mut backoff,
            |failure| *failure == Failure::Transient,
            |_, pause| announced.borrow_mut().push(pause),
            || {
                attempts.borrow_mut().push(start.elapsed());
                let answer = answers[next.get().min(answers.len() - 1)];
                next.set(next.get() + 1);
                async move { answer }
            },
        )
        .await;
        (outcome, attempts.into_inner(), announced.into_inner())
    }

    #[tokio::test(start_paused = true)]
    async fn success_is_returned_at_once() {
        let (outcome, attempts, announced) = run(&[Ok(7)], Duration::from_secs(10)).await;
        assert_eq!(outcome, Ok(7));
        assert_eq!(attempts, [Duration::ZERO]);
        assert!(announced.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn transient_errors_are_retried_until_success() {
        let (outcome, attempts, announced) = run(&[Err(Failure::Transient), Err(Failure::Transient), Ok(3)], Duration::from_secs(10)).await;
        assert_eq!(outcome, Ok(3));
        assert_eq!(attempts.len(), 3, "{attempts:?}");
        // Each attempt came after the pause announced before it (the timer's resolution
        // is a millisecond).
        for (between, pause) in attempts.windows(2).map(|pair| pair[1] - pair[0]).zip(&announced) {
            assert!(between >= *pause && between - *pause <= Duration::from_millis(1), "{attempts:?} {announced:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_permanent_error_is_returned_at_once() {
        let (outcome, attempts, announced) = run(&[Err(Failure::Transient), Err(Failure::Permanent), Ok(1)], Duration::from_secs(10)).await;
        assert_eq!(outcome, Err(Failure::Permanent));
        assert_eq!(attempts.len(), 2, "{attempts:?}");
        assert_eq!(announced.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn transient_errors_are_retried_until_the_deadline() {
        let within = Duration::from_secs(5);
        let (outcome, attempts, announced) = run(&[Err(Failure::Transient)], within).await;
        assert_eq!(outcome, Err(Failure::Transient));
        // 100 ms doubling to 1 s (±20 %): about 8 attempts in 5 s; none after the
        // deadline, and no pause that would have reached it.
        assert!((6..=10).contains(&attempts.len()), "{attempts:?}");
        assert_eq!(attempts.len(), announced.len() + 1);
        let last = *attempts.last().unwrap_or(&Duration::ZERO);
        assert!(last < within, "{attempts:?}");
        assert!(within - last <= Duration::from_millis(1200), "gave up {:?} early: {attempts:?}", within - last);
    }
}
