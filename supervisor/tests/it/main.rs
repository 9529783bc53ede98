//! The supervisor's integration tests, one binary (one link, one process): each module
//! is what was a test binary of its own, run with `cargo test -p supervisor --test it
//! MODULE::`. They run as root against the real binary, loop devices, dockerd and the
//! test peers. What they share inside this one process is locked in [`common`].

mod cgroup;
mod common;
mod docker;
mod doctor;
mod hostile;
mod identity;
mod loopback;
mod pid1;
mod spire;
mod storage;
