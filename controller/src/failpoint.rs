//! Crash points for the crash-safety tests: with the `test-driver` feature, setting
//! `GDR_TEST_CRASH_AT=<point>` makes the process SIGKILL itself (as `kill -9` would)
//! when it reaches that point. Without the feature this compiles to nothing.

/// Kills the process here if the tests asked for it.
#[inline]
pub fn hit(point: &str) {
    #[cfg(feature = "test-driver")]
    if std::env::var("GDR_TEST_CRASH_AT").is_ok_and(|wanted| wanted == point) {
        tracing::warn!(point, "test crash point reached: SIGKILL");
        let _ = kill_self();
    }
    #[cfg(not(feature = "test-driver"))]
    let _ = point;
}

#[cfg(feature = "test-driver")]
fn kill_self() -> std::io::Result<()> {
    // `kill -9 $$`: no destructors, no flushing, exactly like an operator's kill.
    std::process::Command::new("kill").arg("-9").arg(std::process::id().to_string()).status()?;
    std::thread::sleep(std::time::Duration::from_secs(60));
    Ok(())
}
