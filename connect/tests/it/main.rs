//! The Connect crate's integration tests, one binary: our client and server against
//! each other and against malformed requests ([`server`]), and against the official
//! connect-es in both directions ([`conformance`]); the conformance fixture in
//! [`common`]. Run one module with `cargo test -p connect --test it MODULE::`.

mod common;
mod conformance;
mod server;
