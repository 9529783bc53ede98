//! Everything that runs as root, as PID 1 of the environment: signals and the only
//! reaper ([`reaper`]), spawning ([`spawn`]), the life of the environment ([`run`]:
//! cgroups, storage, the job-local dockerd, the agent, the ordered drain), loop-backed
//! storage ([`storage`]), cgroup v1/v2 handling ([`cgroup`]) and dockerd's start-up
//! ([`dockerd`]); what it was told, and the user it runs the agent as, in
//! [`settings`]; that user's ids in /etc and its home, as the driver chose them, in
//! [`user`].
//!
//! It may touch the whole machine; it never talks to the facade or to the runner —
//! that is the agent's job, as the runner uid.

pub mod cgroup;
pub mod dockerd;
pub mod reaper;
pub mod run;
pub mod settings;
pub mod spawn;
pub mod storage;
pub mod user;

pub use reaper::{Event, Pid1, block_signals, parse_stat};
pub use settings::{IdRange, RunnerUser, Settings};
