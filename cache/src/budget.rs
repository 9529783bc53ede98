//! What uploads may cost before the sweep has counted them: the bytes and objects of
//! uploads not committed yet, and of commits the sweep has not seen yet, charged to the
//! job that sent them, its repository and the whole cache. The limits on committed
//! entries (`max_repository`, `max_total`) are the sweep's; these bound what the disk holds
//! beyond them, so that one job cannot fill the disk the cache shares, nor take the
//! allowance every other repository's saves need.
//!
//! The ledger is this controller's own (in memory): several controllers on one bucket each
//! hold their own allowance.

use std::{
    collections::HashMap,
    sync::{Mutex, PoisonError},
};

/// Bytes and objects (files of a directory, objects of a bucket).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub bytes: u64,
    pub objects: u64,
}

impl Usage {
    pub const fn new(bytes: u64, objects: u64) -> Usage {
        Usage { bytes, objects }
    }

    fn fits_within(self, limit: Usage) -> bool {
        self.bytes <= limit.bytes && self.objects <= limit.objects
    }

    fn plus(self, other: Usage) -> Usage {
        Usage { bytes: self.bytes.saturating_add(other.bytes), objects: self.objects.saturating_add(other.objects) }
    }

    fn minus(self, other: Usage) -> Usage {
        Usage { bytes: self.bytes.saturating_sub(other.bytes), objects: self.objects.saturating_sub(other.objects) }
    }
}

/// The most each may have in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allowance {
    pub job: Usage,
    pub repository: Usage,
    pub total: Usage,
}

/// Which allowance a charge would exceed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exceeded {
    Job(Usage),
    Repository(Usage),
    Total(Usage),
}

impl Exceeded {
    /// The metric's reason.
    pub fn reason(self) -> &'static str {
        match self {
            Exceeded::Job(_) => "job_uploading",
            Exceeded::Repository(_) => "repository_uploading",
            Exceeded::Total(_) => "total_uploading",
        }
    }

    /// What the client is told.
    pub fn explain(self) -> String {
        let (whose, limit, setting) = match self {
            Exceeded::Job(limit) => ("this job's uploads", limit, "cache.max_repository_size"),
            Exceeded::Repository(limit) => ("this repository's uploads", limit, "cache.max_repository_size"),
            Exceeded::Total(limit) => ("the uploads of all jobs", limit, "cache.max_uploading"),
        };
        format!(
            "{whose} not committed yet (or not yet counted by the cache's sweep) would exceed {} MB or {} files ({setting}); \
             not saving cache now",
            limit.bytes >> 20,
            limit.objects
        )
    }
}

/// The ledger.
#[derive(Debug)]
pub struct Budget {
    allowance: Allowance,
    charged: Mutex<Charged>,
}

#[derive(Debug, Default)]
struct Charged {
    jobs: HashMap<String, Usage>,
    repositories: HashMap<String, Usage>,
    total: Usage,
}

impl Budget {
    pub fn new(allowance: Allowance) -> Budget {
        Budget { allowance, charged: Mutex::default() }
    }

    fn charged(&self) -> std::sync::MutexGuard<'_, Charged> {
        self.charged.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Charges `usage` to `job` of `repository` if it fits every allowance; else nothing is
    /// charged.
    ///
    /// # Errors
    /// The first allowance it would exceed.
    pub fn charge(&self, job: &str, repository: &str, usage: Usage) -> Result<(), Exceeded> {
        self.charge_within(job, repository, usage, true)
    }

    /// Charges what is on the storage already, whatever the allowances say (an upload read
    /// back after a restart).
    pub fn add(&self, job: &str, repository: &str, usage: Usage) {
        let _ = self.charge_within(job, repository, usage, false);
    }

    fn charge_within(&self, job: &str, repository: &str, usage: Usage, bounded: bool) -> Result<(), Exceeded> {
        let mut charged = self.charged();
        let job_now = charged.jobs.get(job).copied().unwrap_or_default().plus(usage);
        let repository_now = charged.repositories.get(repository).copied().unwrap_or_default().plus(usage);
        let total_now = charged.total.plus(usage);
        if bounded {
            if !job_now.fits_within(self.allowance.job) {
                return Err(Exceeded::Job(self.allowance.job));
            }
            if !repository_now.fits_within(self.allowance.repository) {
                return Err(Exceeded::Repository(self.allowance.repository));
            }
            if !total_now.fits_within(self.allowance.total) {
                return Err(Exceeded::Total(self.allowance.total));
            }
        }
        charged.jobs.insert(job.to_owned(), job_now);
        charged.repositories.insert(repository.to_owned(), repository_now);
        charged.total = total_now;
        Ok(())
    }

    /// Gives back what a charge took (what was deleted, or counted by the sweep).
    pub fn release(&self, job: &str, repository: &str, usage: Usage) {
        fn release_from(map: &mut HashMap<String, Usage>, key: &str, usage: Usage) {
            if let Some(now) = map.get_mut(key) {
                *now = now.minus(usage);
                if *now == Usage::default() {
                    map.remove(key);
                }
            }
        }
        let mut charged = self.charged();
        release_from(&mut charged.jobs, job, usage);
        release_from(&mut charged.repositories, repository, usage);
        charged.total = charged.total.minus(usage);
    }

    /// What all jobs have in flight now.
    pub fn total(&self) -> Usage {
        self.charged().total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget() -> Budget {
        Budget::new(Allowance { job: Usage::new(100, 10), repository: Usage::new(150, 15), total: Usage::new(200, 20) })
    }

    /// (job, repository, usage to charge, what happens).
    type Step<'a> = (&'a str, &'a str, Usage, Result<(), Exceeded>);

    #[test]
    fn each_allowance_holds_and_a_refused_charge_takes_nothing() {
        let budget = budget();
        let table: &[Step<'_>] = &[
            ("a", "r", Usage::new(90, 1), Ok(())),
            ("a", "r", Usage::new(11, 1), Err(Exceeded::Job(Usage::new(100, 10)))),
            ("a", "r", Usage::new(10, 1), Ok(())),
            ("a", "r", Usage::new(0, 9), Err(Exceeded::Job(Usage::new(100, 10)))),
            ("b", "r", Usage::new(51, 1), Err(Exceeded::Repository(Usage::new(150, 15)))),
            ("b", "r", Usage::new(50, 1), Ok(())),
            ("c", "s", Usage::new(51, 1), Err(Exceeded::Total(Usage::new(200, 20)))),
            ("c", "s", Usage::new(50, 1), Ok(())),
        ];
        for (step, (job, repository, usage, expected)) in table.iter().enumerate() {
            assert_eq!(budget.charge(job, repository, *usage), *expected, "step {step}");
        }
        assert_eq!(budget.total(), Usage::new(200, 4));
        budget.release("a", "r", Usage::new(100, 2));
        assert_eq!(budget.total(), Usage::new(100, 2));
        assert_eq!(budget.charge("d", "r", Usage::new(100, 1)), Ok(()), "the repository has room again");
        assert!(!budget.charged().jobs.contains_key("a"), "a job that owes nothing is forgotten");
        budget.release("nobody", "nowhere", Usage::new(5, 5));
        assert_eq!(budget.total(), Usage::new(195, 0), "releasing more than was charged saturates");
    }
}
