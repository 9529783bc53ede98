//! One place that sets up logging: `RUST_LOG` filters (default `info`), text or JSON.

use tracing_subscriber::{EnvFilter, fmt};

pub fn init(json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}
