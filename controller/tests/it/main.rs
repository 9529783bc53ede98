//! The controller's integration tests against real peers (NATS, dockerd, SPIRE,
//! opensandbox-server) and the fake Gitea, in one binary: each module is one part of the
//! controller, driven through its public API.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../common/mod.rs"]
mod common;

mod cluster;
mod docker_driver;
mod facade;
mod facade_mtls;
mod opensandbox_driver;
mod reconciler;
mod scheduler;
mod store;
