//! The end-to-end harness: everything real that can run here — the real Gitea
//! (`testkit::gitea`), the real runners inside the runner image, the supervisor as the
//! image's PID 1 on a real dockerd ([`docker`]) and in Pods of a real Kubernetes cluster
//! ([`kubernetes`]), the controller's components in this
//! process ([`stack`]) — and the paths to the binaries the tests need ([`paths`]).
//!
//! A missing peer is a failure with a message saying how to install it, never a skip.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_debug_implementations)]

pub mod docker;
pub mod kubernetes;
pub mod paths;
pub mod stack;

/// Tests that run jobs on the shared Docker host take turns: two cores do not run
/// several environments' dockerd start-ups at once in reasonable time, and timings
/// measured under contention would say little.
pub async fn exclusive() -> tokio::sync::MutexGuard<'static, ()> {
    static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    TURN.lock().await
}

/// Logs of the controller's components (RUST_LOG, default info) to the test's output.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_test_writer().try_init();
}
