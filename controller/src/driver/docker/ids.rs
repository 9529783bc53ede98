//! Host ids per environment: each container on a Docker host runs its job as a host uid
//! (and gid) of its own, and a rootless dockerd maps a subordinate range of its own, so that
//! no per-user kernel budget — inotify instances and watches, user and network namespaces,
//! pending signals, message queues — is one budget for every tenant of the host (the image's
//! uid 2000 for all would be). A uid is taken when the container is made, is recorded in its
//! label, and is free again once the container is gone: the containers on the host are the
//! only record, so a restarted controller, or another one on the same host, sees the same.

use std::collections::BTreeSet;

use contract::environment::runner_user::IMAGE_DOCKER_GID as DOCKER_GID;
use serde::Deserialize;

use crate::setting::Problems;

/// The ids a rootless dockerd maps: what `dockerd-rootless.sh` needs of /etc/subuid.
pub const SUBORDINATE_COUNT: u32 = 65_536;

/// `docker.runner_ids`: environment `i` runs as uid and gid `first_uid + i` and maps
/// `first_subordinate + i × 65536` … (65,536 ids). `count = 0` runs every environment as
/// the image's uid 2000 (one budget for all).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunnerIds {
    pub first_uid: u32,
    pub count: u32,
    pub first_subordinate: u32,
}

impl Default for RunnerIds {
    /// Far above the ids hosts give their users and those users' subordinate ranges
    /// (`useradd` starts those at 1000 and 100000).
    fn default() -> RunnerIds {
        RunnerIds { first_uid: 2_000_000, count: 256, first_subordinate: 3_000_000_000 }
    }
}

/// The ids of one environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub uid: u32,
    /// The first of its [`SUBORDINATE_COUNT`] subordinate ids.
    pub subordinate: u32,
}

impl RunnerIds {
    /// Every environment as the image's uid 2000.
    pub const SHARED: RunnerIds = RunnerIds { first_uid: 0, count: 0, first_subordinate: 0 };

    pub fn is_shared(&self) -> bool {
        self.count == 0
    }

    /// The slot whose uid is `uid`, if the range holds it.
    pub fn slot_of(&self, uid: u32) -> Option<Slot> {
        let index = uid.checked_sub(self.first_uid).filter(|index| *index < self.count)?;
        Some(Slot { uid, subordinate: self.first_subordinate + index * SUBORDINATE_COUNT })
    }

    /// The lowest slot whose uid is not in `used`.
    pub fn free(&self, used: &BTreeSet<u32>) -> Option<Slot> {
        (0..self.count).map(|index| self.first_uid + index).find(|uid| !used.contains(uid)).and_then(|uid| self.slot_of(uid))
    }

    /// The range fits in 32 bits, holds no root and not the docker group, its uids and
    /// subordinate ids do not meet, and it has a uid for every environment at once.
    pub fn validate(&self, capacity: Option<usize>, problems: &mut Problems) {
        if self.is_shared() {
            return;
        }
        let uids_end = u64::from(self.first_uid) + u64::from(self.count);
        let subordinate_end = u64::from(self.first_subordinate) + u64::from(self.count) * u64::from(SUBORDINATE_COUNT);
        let mut problem = |message: String| problems.add("docker.runner_ids", message);
        if self.first_uid == 0 || self.first_subordinate == 0 {
            problem("first_uid and first_subordinate must be above 0 (root)".to_owned());
        }
        if uids_end > u64::from(u32::MAX) || subordinate_end > u64::from(u32::MAX) {
            problem(format!(
                "{} environments from uid {} and subordinate id {} end beyond the largest id (4294967294)",
                self.count, self.first_uid, self.first_subordinate
            ));
        }
        if (u64::from(self.first_uid)..uids_end).contains(&u64::from(DOCKER_GID)) {
            problem(format!("the uids {}..{uids_end} hold {DOCKER_GID}, the image's docker group", self.first_uid));
        }
        if u64::from(self.first_uid) < subordinate_end && u64::from(self.first_subordinate) < uids_end {
            problem(format!(
                "the uids {}..{uids_end} and the subordinate ids {}..{subordinate_end} overlap: an environment's uid would be another's subordinate id",
                self.first_uid, self.first_subordinate
            ));
        }
        if let Some(capacity) = capacity.filter(|capacity| *capacity > self.count as usize) {
            problem(format!("count = {} is fewer than the container.docker pool's capacity ({capacity}): every environment at once needs a uid", self.count));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_the_lowest_free_and_never_share_ids() {
        let ids = RunnerIds { first_uid: 5000, count: 3, first_subordinate: 1_000_000 };
        let used = |uids: &[u32]| uids.iter().copied().collect::<BTreeSet<u32>>();
        let rows: Vec<(BTreeSet<u32>, Option<Slot>)> = vec![
            (used(&[]), Some(Slot { uid: 5000, subordinate: 1_000_000 })),
            (used(&[5000]), Some(Slot { uid: 5001, subordinate: 1_065_536 })),
            (used(&[5000, 5002, 2000, 9999]), Some(Slot { uid: 5001, subordinate: 1_065_536 })),
            (used(&[5001]), Some(Slot { uid: 5000, subordinate: 1_000_000 })),
            (used(&[5000, 5001]), Some(Slot { uid: 5002, subordinate: 1_131_072 })),
            (used(&[5000, 5001, 5002]), None),
        ];
        for (used, want) in rows {
            assert_eq!(ids.free(&used), want, "{used:?}");
        }
        assert_eq!(ids.slot_of(4999), None);
        assert_eq!(ids.slot_of(5003), None);
        assert_eq!(RunnerIds::SHARED.free(&BTreeSet::new()), None);
    }

    #[test]
    fn validate_table() {
        let d = RunnerIds::default();
        let rows: Vec<(RunnerIds, Option<usize>, Option<&str>)> = vec![
            (d, Some(256), None),
            (RunnerIds::SHARED, Some(10_000), None),
            (d, Some(257), Some("fewer than the container.docker pool's capacity (257)")),
            (RunnerIds { first_uid: 0, ..d }, None, Some("above 0")),
            (RunnerIds { first_uid: 1990, count: 20, ..d }, None, Some("the image's docker group")),
            (RunnerIds { first_uid: 3_000_000_100, ..d }, None, Some("overlap")),
            (RunnerIds { first_subordinate: 1_990_000, ..d }, None, Some("overlap")),
            (RunnerIds { first_subordinate: 4_290_000_000, ..d }, None, Some("beyond the largest id")),
            (RunnerIds { first_uid: u32::MAX - 10, ..d }, None, Some("beyond the largest id")),
        ];
        for (ids, capacity, want) in rows {
            let got = Problems::check(|problems| ids.validate(capacity, problems)).err().map(|p| p.to_string());
            match (want, &got) {
                (None, None) => {}
                (Some(want), Some(got)) if got.contains(want) && got.contains("docker.runner_ids") => {}
                _ => panic!("{ids:?} capacity {capacity:?}: want {want:?}, got {got:?}"),
            }
        }
    }
}
