//! Who asks, and how much the cache keeps: a job's [`Scope`] (GitHub's rule for where it
//! saves and what it restores) and the cache's [`Limits`].

use std::time::Duration;

use crate::budget::{Allowance, Usage};

/// Where a job's entries go and where its restores look: GitHub's rule. A job reads the
/// entries of its own ref, then those of its pull request's base branch, then those of
/// the default branch; it writes only to its own ref's. A pull request's job therefore
/// restores the default branch's entries, and what it saves stays in its own scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    /// `owner/name`: no entry is ever shared between repositories.
    pub repository: String,
    /// The ref the job saves under, e.g. `refs/pull/3/head`.
    pub write: String,
    /// The refs it restores from, in order, its own first.
    pub read: Vec<String>,
    /// The job asking (its assignment): what its uploads are charged to and how many of its
    /// requests run at once are counted by.
    pub job: String,
}

impl Scope {
    /// `write` first, then `others` in order, each once; for no job in particular (see
    /// [`Scope::for_job`]).
    pub fn new(repository: impl Into<String>, write: impl Into<String>, others: impl IntoIterator<Item = String>) -> Scope {
        let write = write.into();
        let mut read = vec![write.clone()];
        for other in others {
            if !other.is_empty() && !read.contains(&other) {
                read.push(other);
            }
        }
        Scope { repository: repository.into(), write, read, job: String::new() }
    }

    /// The same scope, asked by `job`.
    pub fn for_job(mut self, job: impl Into<String>) -> Scope {
        self.job = job.into();
        self
    }
}

/// How much the cache keeps, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// All repositories' committed entries together.
    pub max_total: u64,
    /// One repository's committed entries together; also the largest entry.
    pub max_repository: u64,
    /// An entry not used for this long goes.
    pub max_age: Duration,
    /// The bytes of uploads not committed yet (and of commits the sweep has not counted
    /// yet), all jobs together: what the storage may hold beyond `max_total`.
    pub max_uploading: u64,
}

/// An upload's parts (or blocks) at most: the toolkit sends 32 MiB chunks (64 MiB blocks
/// on v2), so 10 GiB takes 320.
pub const MAX_PARTS: u64 = 1024;
/// Uploads a job may have open at once (the toolkit saves one entry at a time).
pub const MAX_OPEN_UPLOADS: usize = 8;
/// Objects a job, a repository and all jobs may have in flight: one per part, block and
/// upload record (files use inodes, which run out before bytes do).
pub const MAX_OBJECTS_PER_JOB: u64 = 4 * MAX_PARTS;
pub const MAX_OBJECTS_PER_REPOSITORY: u64 = 8 * MAX_PARTS;
pub const MAX_OBJECTS: u64 = 64 * MAX_PARTS;

impl Limits {
    /// Limits with the default in-flight allowance (twice the largest entry).
    pub const fn new(max_total: u64, max_repository: u64, max_age: Duration) -> Limits {
        let mut limits = Limits { max_total, max_repository, max_age, max_uploading: 0 };
        limits.max_uploading = limits.max_entry().saturating_mul(2);
        limits
    }

    /// The largest archive a save may have.
    pub const fn max_entry(&self) -> u64 {
        if self.max_total < self.max_repository { self.max_total } else { self.max_repository }
    }

    /// What uploads may have in flight: a job and a repository one largest entry (so one
    /// repository never holds more than half of what all may), all of them `max_uploading`.
    pub fn allowance(&self) -> Allowance {
        let entry = self.max_entry().min(self.max_uploading / 2);
        Allowance {
            job: Usage::new(entry, MAX_OBJECTS_PER_JOB),
            repository: Usage::new(entry, MAX_OBJECTS_PER_REPOSITORY),
            total: Usage::new(self.max_uploading, MAX_OBJECTS),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scope_reads_its_own_ref_first_then_each_other_once() {
        let scope = Scope::new("o/r", "refs/pull/3/head", ["refs/heads/main".to_owned(), String::new(), "refs/heads/main".to_owned()]).for_job("a-1");
        assert_eq!(scope.read, ["refs/pull/3/head", "refs/heads/main"]);
        assert_eq!(scope.job, "a-1");
        let on_main = Scope::new("o/r", "refs/heads/main", ["refs/heads/main".to_owned()]);
        assert_eq!(on_main.read, ["refs/heads/main"]);
    }

    #[test]
    fn one_repository_never_holds_more_than_half_of_the_uploading_allowance() {
        let limits = Limits::new(1 << 30, 256 << 20, Duration::from_secs(3600));
        assert_eq!(limits.max_uploading, 512 << 20);
        assert_eq!(limits.allowance().repository.bytes, 256 << 20);
        let tight = Limits { max_uploading: 300 << 20, ..limits };
        assert_eq!(tight.allowance().repository.bytes, 150 << 20);
        assert_eq!(tight.allowance().total.bytes, 300 << 20);
    }
}
