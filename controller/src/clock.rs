//! The one clock that leases, records, keep-alive and facade sessions read: Unix time
//! as tokio sees it. In production tokio's clock is the system's, so this is the
//! system's wall clock (what replicas on other machines compare leases with). Under
//! tokio's paused time (`#[tokio::test(start_paused = true)]`) it stands still until the
//! test advances tokio's clock, so expiry is tested without sleeping.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Now, as time since the Unix epoch.
pub fn since_epoch() -> Duration {
    let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    // How far tokio's clock is from the system's: nothing outside paused time (both
    // read the same monotonic clock), the advanced minus the real time within it.
    let (tokio_now, system_now) = (tokio::time::Instant::now().into_std(), std::time::Instant::now());
    match tokio_now.checked_duration_since(system_now) {
        Some(ahead) => wall.saturating_add(ahead),
        None => wall.saturating_sub(system_now.duration_since(tokio_now)),
    }
}

/// Unix milliseconds now.
pub fn now_ms() -> i64 {
    i64::try_from(since_epoch().as_millis()).unwrap_or(i64::MAX)
}

/// Unix seconds now.
pub fn now_secs() -> u64 {
    since_epoch().as_secs()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Outside paused time the clock is the system's.
    #[test]
    fn it_is_the_system_clock_outside_paused_time() {
        let system = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let drift = since_epoch().abs_diff(system);
        assert!(drift < Duration::from_millis(50), "{drift:?} off the system clock");
    }

    /// Under paused time it moves only when tokio's clock does, and by as much.
    #[tokio::test(start_paused = true)]
    async fn it_follows_tokio_paused_time() {
        let before = now_ms();
        std::thread::sleep(Duration::from_millis(30));
        assert!(now_ms() - before <= 1, "the paused clock moved with real time: {} ms", now_ms() - before);
        tokio::time::advance(Duration::from_secs(3600)).await;
        let moved = now_ms() - before;
        assert!((3_600_000..=3_600_002).contains(&moved), "advanced an hour, the clock moved {moved} ms");
    }
}
