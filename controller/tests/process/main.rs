//! The real controller process killed and restarted (the `test-driver` build: crash
//! points and a directory-backed driver): at every crash point, the OpenSandbox driver
//! between create and record, and the random kill campaign on a NATS cluster.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../common/mod.rs"]
mod common;

mod chaos;
mod crash;
mod opensandbox_crash;
