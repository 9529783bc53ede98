//! The controller: registers with Gitea as one runner, claims tasks, persists them
//! as assignments, creates one disposable environment per task, and is the only
//! path from environments back to Gitea (see docs/architecture.md).
//!
//! Layout (each folder's `//!` says what it owns and what it may touch), from the
//! ground up:
//! - [`assignment`]: the assignment model — pure derivations from a Gitea task: where
//!   it runs, who it is, how it is stored, how it authenticates.
//! - [`setting`]: what a setting is to its owner (an invalid one, durations).
//! - [`clock`]: the one wall clock of leases, records and sessions (tokio's, so tests
//!   pause it).
//! - [`metrics`]: the Prometheus registry, health and readiness.
//! - [`store`]: durable queue + records (JetStream or embedded redb).
//! - [`gitea`]: the Gitea client on the Connect layer (registrations, calls).
//! - [`driver`]: one per placement, creating and deleting environments (with the SPIRE
//!   entry of each environment that needs its own).
//! - [`placements`]: per placement its capacity, driver, pool and admission.
//! - [`lifecycle`]: the one place where an assignment ends.
//! - [`facade`]: the environments' only path back to Gitea (service and transports).
//! - [`worker`]: environments per placement within capacity; the reconciler.
//! - [`scheduler`]: the FetchTask loops that turn tasks into persisted assignments, and
//!   the keep-alive of assignments nobody reports on yet.
//! - [`pipeline`]: the one place the components are wired together, and the running
//!   handle that starts and drains them.
//! - [`config`], [`http`], [`app`], [`commands`], [`cli`], [`telemetry`], [`signal`],
//!   [`exit`], [`failpoint`]: the edges — configuration, the HTTP listener, `controller
//!   run`, the command dispatch.

#![forbid(unsafe_code)]

pub mod app;
pub mod assignment;
pub mod cli;
pub mod clock;
pub mod commands;
pub mod config;
pub mod driver;
pub mod exit;
pub mod facade;
pub mod failpoint;
pub mod gitea;
pub mod http;
pub mod lifecycle;
pub mod metrics;
pub mod pipeline;
pub mod placements;
pub mod scheduler;
pub mod setting;
pub mod signal;
pub mod store;
pub mod telemetry;
pub mod worker;

pub use contract::error_chain;
