//! What the two binaries agree on without a wire protocol:
//! - [`environment`]: the environment contract — the variables a driver sets for an
//!   environment and the supervisor reads (names, meaning, "empty is unset");
//! - [`facade`]: the forms of the facade's URL and which addresses plain HTTP may use;
//! - [`units`]: how sizes and durations are written in settings, for both binaries;
//! - [`backoff`]: the one retry pause of every loop;
//! - [`cache`]: where the jobs' cache is served in an environment, which requests are its
//!   ([`cache::Call`], the route table of its protocol), and how the supervisor
//!   forwards it to the facade;
//! - [`exit`]: the supervisor's own exit codes, and what each means to the controller
//!   that sees an environment end with one;
//! - [`error_chain`]: how an error is printed, with every cause, on one line.

#![forbid(unsafe_code)]

pub mod backoff;
pub mod cache;
pub mod environment;
pub mod exit;
pub mod facade;
pub mod units;

/// "outer: inner: innermost": every layer of an error in one line, printed once.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
