//! The supervisor: PID 1 of every job environment. It prepares storage and a
//! job-local dockerd, waits for the job's exact SPIFFE identity, claims the task from
//! the controller's facade and serves a loopback RunnerService to an unmodified
//! `gitea-runner daemon --once`, which runs the job.
//!
//! Layout, by privilege:
//! - [`pid1`] (root): signals, the only reaper, spawning, the environment's life
//!   ([`pid1::run`]), loop-backed storage, cgroups, the job-local dockerd.
//! - [`agent`] (the runner uid): identity wait, facade client, loopback RunnerService
//!   and its pass-through to Gitea, readiness.
//! - [`tools`]: `supervisor job-started` and `supervisor doctor`.
//! - [`cli`]: every setting, parsed and validated before any side effect; [`exit`]:
//!   every exit code in one place; [`signals`]: the signals that reach the job.

pub mod agent;
pub mod cli;
pub mod exit;
pub mod http1;
pub mod pid1;
pub mod signals;
pub mod tools;

pub use contract::error_chain;

/// One place that sets up logging: `RUST_LOG` filters (default `info`), to stderr,
/// each line prefixed so it stands out in a job's log.
pub fn init_logging(component: &'static str) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env(contract::environment::supervisor::LOG).unwrap_or_else(|_| EnvFilter::new("info"));
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
        // The fields of the enclosing spans (e.g. `assignment.id`) first, so one job's
        // story can be followed through the logs.
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                if let Some(fields) = span.extensions().get::<tracing_subscriber::fmt::FormattedFields<N>>()
                    && !fields.is_empty()
                {
                    write!(writer, "{fields} ")?;
                }
            }
        }
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}
