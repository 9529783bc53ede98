//! The supervisor: PID 1 of every job environment. It prepares storage and a
//! job-local dockerd, waits for the job's exact SPIFFE identity, and runs the job as
//! the runner uid (later: claims the task from the controller's facade and serves a
//! loopback RunnerService to an unmodified `gitea-runner daemon --once`).
//!
//! Layout:
//! - [`cli`]: every setting, parsed and validated before any side effect.
//! - [`pid1`]: signals (blocked first, read from a signalfd), the only reaper, spawning.
//! - [`run`]: PID 1's life: cgroups, agent, storage, dockerd, forwarding, ordered drain.
//! - [`storage`]: loop-backed ext4 for /var/lib/docker (hand-written loop ioctls).
//! - [`cgroup`]: v1/v2 detection and v2 nesting into `init`.
//! - [`dockerd`]: dockerd's arguments, `/_ping` readiness, its log.
//! - [`agent`]: the runner-uid process: identity wait, readiness socket, the job.
//! - [`identity`]: waiting for the exact X.509 SVID through the Workload API.
//! - [`ready`] and [`hook`]: the readiness protocol and `supervisor job-started`.
//! - [`loopback`]: the RunnerService an unmodified gitea-runner talks to, on 127.0.0.1.
//! - [`doctor`]: independent PASS/FAIL/SKIP checks.
//! - [`exit`]: every exit code in one place; [`units`]: size and duration parsing.

pub mod agent;
pub mod cgroup;
pub mod cli;
pub mod dockerd;
pub mod doctor;
pub mod exit;
pub mod facade_client;
pub mod hook;
pub mod identity;
pub mod loopback;
pub mod pid1;
pub mod ready;
pub mod run;
pub mod storage;
pub mod units;

pub use connect::error_chain;

/// One place that sets up logging: `RUST_LOG` filters (default `info`), to stderr,
/// each line prefixed so it stands out in a job's log.
pub fn init_logging(component: &'static str) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("SUPERVISOR_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(false)
        .with_thread_names(false)
        .event_format(Prefixed(component))
        .try_init();
}

struct Prefixed(&'static str);

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for Prefixed
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        write!(writer, "[{}] {} ", self.0, event.metadata().level())?;
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}
