//! The job's dockerd as the agent sees it: PID 1's reports on starting it ([`report`]),
//! for a rootless dockerd, the socket the agent serves in front of it until it
//! answers ([`proxy`]), and a host-mode job's `services:`, which the agent starts on it
//! ([`services`]). PID 1 starts and stops dockerd (`pid1::run`); the readiness the
//! job-started hook waits for is `super::ready`'s.

pub mod proxy;
pub mod report;
pub mod services;
