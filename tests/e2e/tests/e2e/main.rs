//! The end-to-end tests, in one binary so that the peers every module shares — the
//! Docker host, the Kubernetes cluster — start once: the real Gitea (1.23 and 1.27), the
//! real runners in the runner image, the controller's components, attacks from inside
//! jobs, restarts, the chart, the images, run-local, a VM guest.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod attacks;
mod cache;
mod campaign;
mod container_jobs;
mod contract;
mod controller_image;
mod fake_agrees;
mod first_week;
mod gitea_fixture;
mod guest;
mod helm;
mod jobs;
mod kubernetes;
mod neighbours;
mod observability;
mod public_actions;
mod replicas;
mod rootless;
mod run_local;
mod vm;
