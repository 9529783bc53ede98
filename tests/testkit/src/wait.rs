//! Waiting on a condition instead of a fixed sleep: the one home of the tests' deadline
//! loops, async (on the tokio clock, so a paused clock applies) and blocking (for
//! `#[test]`s that drive processes). Each panics after its timeout, naming what it waited
//! for, so a hung peer fails the test with a sentence instead of a CI timeout.
//!
//! A probe is polled at a tenth of the time already waited, between 10 ms and 250 ms: a
//! condition that holds at once is seen at once, and a probe that spawns a process (`docker
//! ps`, `kubectl get`) is not run fifty times a second through a minutes-long wait.

use std::{future::Future, process::Child, process::ExitStatus, time::Duration};

fn pause_after(waited: Duration) -> Duration {
    (waited / 10).clamp(Duration::from_millis(10), Duration::from_millis(250))
}

fn timed_out(what: &str, timeout: Duration) -> ! {
    panic!("timed out after {timeout:?} waiting until {what}")
}

/// Polls `probe` until it returns `Ok`; after `timeout`, returns its last `Err` — for a
/// test that says why it gave up (the last error, a log) in its own words.
pub async fn poll<T, E, F, Fut>(timeout: Duration, mut probe: F) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let start = tokio::time::Instant::now();
    loop {
        let error = match probe().await {
            Ok(value) => return Ok(value),
            Err(error) => error,
        };
        let waited = start.elapsed();
        if waited >= timeout {
            return Err(error);
        }
        tokio::time::sleep(pause_after(waited)).await;
    }
}

/// Polls `probe` until it returns a value; panics after `timeout` naming `what`.
pub async fn wait_for_async<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    poll(timeout, || {
        let check = probe();
        async move { check.await.ok_or(()) }
    })
    .await
    .unwrap_or_else(|()| timed_out(what, timeout))
}

/// [`wait_for_async`] for a probe that need not await.
pub async fn wait_for<T>(what: &str, timeout: Duration, mut probe: impl FnMut() -> Option<T>) -> T {
    wait_for_async(what, timeout, || std::future::ready(probe())).await
}

/// Waits until `condition` holds.
pub async fn wait_until(what: &str, timeout: Duration, mut condition: impl FnMut() -> bool) {
    wait_for(what, timeout, || condition().then_some(())).await;
}

/// [`wait_until`] for a condition that must itself await.
pub async fn wait_until_async<F, Fut>(what: &str, timeout: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    wait_for_async(what, timeout, || {
        let check = condition();
        async move { check.await.then_some(()) }
    })
    .await;
}

/// The blocking [`poll`], for tests without a runtime (or that must not yield to it).
pub fn poll_blocking<T, E>(timeout: Duration, mut probe: impl FnMut() -> Result<T, E>) -> Result<T, E> {
    let start = std::time::Instant::now();
    loop {
        let error = match probe() {
            Ok(value) => return Ok(value),
            Err(error) => error,
        };
        let waited = start.elapsed();
        if waited >= timeout {
            return Err(error);
        }
        std::thread::sleep(pause_after(waited));
    }
}

/// The blocking [`wait_for`].
pub fn wait_for_blocking<T>(what: &str, timeout: Duration, mut probe: impl FnMut() -> Option<T>) -> T {
    poll_blocking(timeout, || probe().ok_or(())).unwrap_or_else(|()| timed_out(what, timeout))
}

/// The blocking [`wait_until`].
pub fn wait_until_blocking(what: &str, timeout: Duration, mut condition: impl FnMut() -> bool) {
    wait_for_blocking(what, timeout, || condition().then_some(()));
}

/// Waits for `child` to exit and returns how; after `timeout` kills it (so that it does
/// not outlive the test) and panics naming `what` — e.g. "the controller exits at its
/// crash point".
pub fn wait_for_exit(child: &mut Child, timeout: Duration, what: &str) -> ExitStatus {
    let start = std::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap_or_else(|e| panic!("waiting until {what}: {e}")) {
            return status;
        }
        let waited = start.elapsed();
        if waited >= timeout {
            let _ = child.kill();
            let _ = child.wait();
            timed_out(what, timeout);
        }
        std::thread::sleep(pause_after(waited));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_poll_is_a_tenth_of_the_wait_within_bounds() {
        for (waited_ms, pause_ms) in [(0, 10), (50, 10), (1_000, 100), (2_500, 250), (600_000, 250)] {
            assert_eq!(pause_after(Duration::from_millis(waited_ms)), Duration::from_millis(pause_ms), "after {waited_ms} ms");
        }
    }

    #[test]
    fn a_poll_gives_back_the_last_error_when_it_gives_up() {
        let mut calls = 0;
        let outcome: Result<(), String> = poll_blocking(Duration::from_millis(40), || {
            calls += 1;
            Err(format!("attempt {calls}"))
        });
        assert_eq!(outcome, Err(format!("attempt {calls}")));
        assert!(calls > 1, "polled once only");
    }

    #[test]
    fn a_blocking_wait_returns_the_probes_value_or_names_what_it_waited_for() {
        let mut calls = 0;
        assert_eq!(
            wait_for_blocking("the third call", Duration::from_secs(5), || {
                calls += 1;
                (calls == 3).then_some(calls)
            }),
            3
        );
        let panic = std::panic::catch_unwind(|| wait_until_blocking("never", Duration::from_millis(30), || false)).unwrap_err();
        assert_eq!(panic.downcast_ref::<String>().map(String::as_str), Some("timed out after 30ms waiting until never"));
    }

    #[tokio::test(start_paused = true)]
    async fn an_async_wait_follows_the_tokio_clock() {
        let start = tokio::time::Instant::now();
        let ready_at = start + Duration::from_secs(30);
        wait_until("thirty seconds passed", Duration::from_secs(60), || tokio::time::Instant::now() >= ready_at).await;
        // Paused: no real time passed, and the wait ended within one poll of the condition.
        assert!(start.elapsed() >= Duration::from_secs(30) && start.elapsed() < Duration::from_millis(30_250), "{:?}", start.elapsed());
    }

    #[test]
    fn wait_for_exit_returns_the_status_and_kills_what_overstays() {
        let mut quick = std::process::Command::new("sh").args(["-c", "exit 3"]).spawn().unwrap();
        assert_eq!(wait_for_exit(&mut quick, Duration::from_secs(10), "sh exits").code(), Some(3));
        let mut slow = std::process::Command::new("sleep").arg("60").spawn().unwrap();
        let pid = slow.id();
        assert!(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| wait_for_exit(&mut slow, Duration::from_millis(50), "sleep exits"))).is_err());
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "the child outlived the wait");
    }
}
