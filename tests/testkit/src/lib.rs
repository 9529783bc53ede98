//! Test-only helpers shared by the workspace's tests (a dev-dependency only).
//!
//! - [`workload`]: a fake SPIFFE Workload API server, scripted by the test.
//! - [`fake_gitea`]: a fake Gitea runner API that follows the protocol reference.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_debug_implementations)]

pub mod fake_gitea;
pub mod workload;
