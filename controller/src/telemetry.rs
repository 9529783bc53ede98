//! One place that sets up logging: `RUST_LOG` filters (default `info`), text or JSON.

use tracing_subscriber::{EnvFilter, fmt};

/// `default` applies when `RUST_LOG` is unset (run-local keeps the terminal for the
/// job's log and shows only warnings of its own).
pub fn init(json: bool, default: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}
