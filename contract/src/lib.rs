//! What the two binaries agree on without a wire protocol:
//! - [`environment`]: the environment contract — the variables a driver sets for an
//!   environment and the supervisor reads (names, meaning, "empty is unset");
//! - [`facade`]: the forms of the facade's URL and which addresses plain HTTP may use;
//! - [`units`]: how sizes and durations are written in settings, for both binaries;
//! - [`backoff`]: the one retry pause of every loop;
//! - [`REVISION`]: the source revision both are built from.

#![forbid(unsafe_code)]

pub mod backoff;
pub mod environment;
pub mod facade;
pub mod units;

/// The git revision (12 hex digits) the binaries were built from, or "unknown".
pub const REVISION: &str = env!("GDR_REVISION");
