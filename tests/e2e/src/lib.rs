//! The end-to-end harness: everything real that can run here — the real Gitea
//! (`testkit::gitea`), the real runners inside the runner image, the supervisor as the
//! image's PID 1 on a real dockerd ([`docker`]) and in Pods of a real Kubernetes cluster
//! ([`kubernetes`]), the controller's components in this
//! process ([`stack`]) — and the paths to the binaries the tests need ([`paths`]).
//!
//! A missing peer is a failure with a message saying how to install it, never a skip.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_debug_implementations)]

pub mod actions;
pub mod docker;
pub mod images;
pub mod kubernetes;
pub mod paths;
pub mod stack;

/// Tests that run jobs on the shared Docker host take turns: two cores do not run
/// several environments' dockerd start-ups at once in reasonable time, and timings
/// measured under contention would say little.
pub async fn exclusive() -> tokio::sync::MutexGuard<'static, ()> {
    TURN.lock().await
}

/// [`exclusive`] for a test outside a runtime (the VM guest).
pub fn exclusive_blocking() -> tokio::sync::MutexGuard<'static, ()> {
    TURN.blocking_lock()
}

static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A peer that every test shares (the Docker host, the Kubernetes cluster):
/// started on first use, stopped when the test binary exits.
pub trait SharedPeer: Sync {
    fn stop(&self);
}

static AT_EXIT: std::sync::Mutex<Vec<&'static dyn SharedPeer>> = std::sync::Mutex::new(Vec::new());

/// A [`SharedPeer`] in a static, started by the first test that needs it.
pub struct Shared<T> {
    cell: std::sync::OnceLock<T>,
}

impl<T: SharedPeer + Send + 'static> Default for Shared<T> {
    fn default() -> Self {
        Shared::new()
    }
}

impl<T: SharedPeer + Send + 'static> Shared<T> {
    pub const fn new() -> Self {
        Shared { cell: std::sync::OnceLock::new() }
    }

    /// The peer, started with `start` on first use and stopped when the binary exits.
    pub fn get_or_start(&'static self, start: impl FnOnce() -> T) -> &'static T {
        self.cell.get_or_init(|| {
            let peer = start();
            stop_at_exit(self);
            peer
        })
    }
}

impl<T: SharedPeer + Send> SharedPeer for Shared<T> {
    fn stop(&self) {
        if let Some(peer) = self.cell.get() {
            peer.stop();
        }
    }
}

/// Stops `peer` when the test binary exits (peers stop in the reverse order they started).
pub fn stop_at_exit(peer: &'static dyn SharedPeer) {
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    // SAFETY: `stop_all` is an `extern "C" fn()` with no arguments that only takes the
    // registered peers out of a static; registering it has no other effect.
    REGISTERED.call_once(|| unsafe {
        libc::atexit(stop_all);
    });
    AT_EXIT.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(peer);
}

extern "C" fn stop_all() {
    let peers = std::mem::take(&mut *AT_EXIT.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
    for peer in peers.into_iter().rev() {
        peer.stop();
    }
}

/// Runs `program` to its end (no stdin); panics if it cannot start.
pub fn run(program: &str, args: &[&str]) -> std::process::Output {
    std::process::Command::new(program).args(args).stdin(std::process::Stdio::null()).output().unwrap_or_else(|e| panic!("{program} cannot run: {e}"))
}

/// Logs of the controller's components (RUST_LOG, default info) to the test's output.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_test_writer().try_init();
}
