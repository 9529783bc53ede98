//! What the cache lets go, each sweep: entries not used for `max_age`; then, per
//! repository over `max_repository` and over `max_total` for all, the least recently
//! used entries until it fits; uploads never committed and their parts after an hour
//! (their charge to the in-flight allowance goes back then), and use marks whose entry
//! went. A commit stays charged to its job until a sweep has counted it among the
//! committed entries.
//! Several controllers on one bucket may sweep at once: deleting twice is harmless.

use std::collections::{HashMap, HashSet};

use object_store::path::Path;

use contract::error_chain;

use crate::{
    error::CacheError,
    metrics::CacheMetrics,
    scope::Limits,
    store::{EntryMeta, Object, Storage, encoded, now_ms},
    uploads::Uploads,
};

/// An upload (its parts, its blocks) untouched this long is abandoned.
const ABANDONED_AFTER_MS: i64 = 60 * 60 * 1000;

/// One committed entry as the sweep sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub repository: String,
    pub size: u64,
    pub last_used_ms: i64,
}

/// Why an entry goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Age,
    RepositorySize,
    TotalSize,
}

impl Reason {
    pub fn label(self) -> &'static str {
        match self {
            Reason::Age => "age",
            Reason::RepositorySize => "repository_size",
            Reason::TotalSize => "total_size",
        }
    }
}

/// Which of `entries` go, and why: by age, then least recently used first until each
/// repository and then the whole cache fit their limits.
pub fn plan(entries: &[Stored], limits: &Limits, now_ms: i64) -> Vec<(usize, Reason)> {
    let max_age = i64::try_from(limits.max_age.as_millis()).unwrap_or(i64::MAX);
    let mut going: Vec<(usize, Reason)> =
        entries.iter().enumerate().filter(|(_, e)| now_ms - e.last_used_ms > max_age).map(|(i, _)| (i, Reason::Age)).collect();
    let mut gone: HashSet<usize> = going.iter().map(|(i, _)| *i).collect();
    let mut by_use: Vec<usize> = (0..entries.len()).filter(|i| !gone.contains(i)).collect();
    by_use.sort_by_key(|&i| (entries[i].last_used_ms, i));
    let mut per_repository: HashMap<&str, u64> = HashMap::new();
    for &i in &by_use {
        *per_repository.entry(&entries[i].repository).or_default() += entries[i].size;
    }
    for &i in &by_use {
        let used = per_repository.get_mut(entries[i].repository.as_str()).expect("counted above");
        if *used > limits.max_repository {
            *used -= entries[i].size;
            going.push((i, Reason::RepositorySize));
            gone.insert(i);
        }
    }
    let mut total: u64 = by_use.iter().filter(|i| !gone.contains(i)).map(|&i| entries[i].size).sum();
    for &i in &by_use {
        if total <= limits.max_total {
            break;
        }
        if gone.insert(i) {
            total -= entries[i].size;
            going.push((i, Reason::TotalSize));
        }
    }
    going
}

/// What one sweep did and left.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Swept {
    pub evicted: u64,
    pub abandoned: u64,
    pub entries: u64,
    pub bytes: u64,
}

/// The sweeper of one cache: what it reads, what it gives back, where it counts.
#[derive(Debug)]
pub struct Sweep<'a> {
    pub storage: &'a Storage,
    pub uploads: &'a Uploads,
    pub metrics: &'a CacheMetrics,
    pub limits: Limits,
}

impl Sweep<'_> {
    /// One sweep over the whole store.
    ///
    /// # Errors
    /// When the store cannot be listed (what was deleted before stays deleted).
    pub async fn once(&self) -> Result<Swept, CacheError> {
        let mark = self.uploads.sweep_starts();
        let storage = self.storage;
        let now = now_ms();
        let used = used_marks(&storage.list(&Path::from("used")).await?);
        let blobs = storage.list(&Path::from("blobs")).await?;
        let mut blob_sizes: HashMap<(String, String), (u64, i64)> = HashMap::new();
        for object in &blobs {
            if let Some(id) = blob_id(&object.path) {
                let size = blob_sizes.entry(id).or_default();
                size.0 += object.size;
                size.1 = size.1.max(object.modified_ms);
            }
        }
        let mut entries = Vec::new();
        let mut stored = Vec::new();
        let mut marked = HashSet::new();
        for object in storage.list(&Path::from("entries")).await? {
            let Some(entry) = storage.entry(&object.path).await? else { continue };
            let size = blob_sizes.get(&(encoded(&entry.repository), entry.id.to_string())).map_or(0, |(size, _)| *size);
            let suffix = below_first(&object.path);
            let last_used_ms = used.get(&suffix).map_or(object.modified_ms, |(_, used_ms)| object.modified_ms.max(*used_ms));
            marked.insert(suffix);
            stored.push(Stored { repository: entry.repository.clone(), size, last_used_ms });
            entries.push((object.path, entry));
        }
        // Marks of entries gone (a restore's mark racing an eviction).
        for (suffix, (path, _)) in &used {
            if !marked.contains(suffix) {
                storage.delete(path).await?;
            }
        }
        let mut swept = Swept::default();
        let going = plan(&stored, &self.limits, now);
        let mut gone = HashSet::new();
        for (index, reason) in &going {
            let (path, entry) = &entries[*index];
            storage.delete(path).await?;
            if let Some((mark, _)) = used.get(&below_first(path)) {
                storage.delete(mark).await?;
            }
            storage.delete_all(&Storage::blob_dir(&entry.repository, entry.id)).await?;
            tracing::info!(repository = %entry.repository, git_ref = %entry.git_ref, key = %entry.key, reason = reason.label(), "cache entry evicted");
            self.metrics.evicted(reason.label(), 1);
            gone.insert(*index);
            swept.evicted += 1;
        }
        swept.abandoned = self.sweep_abandoned(&entries, &blob_sizes, now).await?;
        for (_, entry) in stored.iter().enumerate().filter(|(i, _)| !gone.contains(i)) {
            swept.entries += 1;
            swept.bytes += entry.size;
        }
        self.metrics.stored_entries.set(i64::try_from(swept.entries).unwrap_or(i64::MAX));
        self.metrics.stored_bytes.set(i64::try_from(swept.bytes).unwrap_or(i64::MAX));
        self.uploads.swept(mark);
        self.metrics.uploading_bytes.set(i64::try_from(self.uploads.in_flight().bytes).unwrap_or(i64::MAX));
        Ok(swept)
    }

    /// Uploads never committed, their blocks, and parts no entry or upload owns, once
    /// untouched for an hour.
    async fn sweep_abandoned(&self, entries: &[(Path, EntryMeta)], blob_sizes: &HashMap<(String, String), (u64, i64)>, now: i64) -> Result<u64, CacheError> {
        let storage = self.storage;
        let old = |object: &Object| now - object.modified_ms > ABANDONED_AFTER_MS;
        let mut open: HashSet<(String, String)> = HashSet::new();
        let mut abandoned = 0;
        for object in storage.list(&Path::from("uploads")).await? {
            let parts: Vec<String> = object.path.parts().map(|p| p.as_ref().to_owned()).collect();
            let [_, repository, id] = parts.as_slice() else { continue };
            if old(&object) {
                storage.delete(&object.path).await?;
                if let Ok(id) = id.parse() {
                    self.uploads.given_up(repository, id);
                }
                abandoned += 1;
            } else {
                open.insert((repository.clone(), id.clone()));
            }
        }
        for prefix in ["pending", "staging"] {
            for object in storage.list(&Path::from(prefix)).await?.iter().filter(|object| old(object)) {
                storage.delete(&object.path).await?;
            }
        }
        let owned: HashSet<(String, String)> = entries.iter().map(|(_, entry)| (encoded(&entry.repository), entry.id.to_string())).collect();
        for ((repository, id), (_, modified_ms)) in blob_sizes {
            let key = (repository.clone(), id.clone());
            if !owned.contains(&key) && !open.contains(&key) && now - modified_ms > ABANDONED_AFTER_MS {
                storage.delete_all(&Path::from_iter(["blobs", repository.as_str(), id.as_str()].map(object_store::path::PathPart::from))).await?;
                self.metrics.evicted("abandoned", 1);
                abandoned += 1;
            }
        }
        Ok(abandoned)
    }

    /// Sweeps every `interval`, and soon after a commit, until `shutdown`.
    pub async fn every(&self, interval: std::time::Duration, shutdown: tokio_util::sync::CancellationToken) {
        loop {
            match self.once().await {
                Ok(swept) if swept.evicted > 0 || swept.abandoned > 0 => {
                    tracing::info!(evicted = swept.evicted, abandoned = swept.abandoned, entries = swept.entries, bytes = swept.bytes, "cache swept");
                }
                Ok(_) => {}
                Err(error) => tracing::warn!(error = %error_chain(&error), "the cache sweep failed; trying again at the next"),
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
                () = self.uploads.committed() => {
                    // Commits come in bursts (a matrix): one sweep after them.
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(std::time::Duration::from_secs(5)) => {}
                    }
                }
            }
        }
    }
}

/// `used/<repository>/<ref>/<version>/<hash>` by what follows `used/` → (path, mark time).
fn used_marks(marks: &[Object]) -> HashMap<String, (Path, i64)> {
    marks.iter().map(|mark| (below_first(&mark.path), (mark.path.clone(), mark.modified_ms))).collect()
}

/// A path without its first segment: an entry's and its use mark's are the same.
fn below_first(path: &Path) -> String {
    path.parts().skip(1).map(|part| part.as_ref().to_owned()).collect::<Vec<_>>().join("/")
}

/// `blobs/<repository>/<id>/<offset>` → (repository, id) as encoded in the path.
fn blob_id(path: &Path) -> Option<(String, String)> {
    let parts: Vec<String> = path.parts().map(|part| part.as_ref().to_owned()).collect();
    match parts.as_slice() {
        [blobs, repository, id, _] if blobs == "blobs" => Some((repository.clone(), id.clone())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(repository: &str, size: u64, last_used_ms: i64) -> Stored {
        Stored { repository: repository.to_owned(), size, last_used_ms }
    }

    #[test]
    fn age_then_repository_then_total_least_recently_used_first() {
        let limits = Limits::new(100, 60, std::time::Duration::from_secs(10));
        let now = 100_000;
        let entries = [
            stored("a", 30, now - 20_000), // 0: too old
            stored("a", 30, now - 5_000),  // 1
            stored("a", 30, now - 4_000),  // 2
            stored("a", 30, now - 1_000),  // 3: a is 90 > 60 without 0 → 1 goes
            stored("b", 40, now - 3_000),  // 4
            stored("c", 20, now - 2_000),  // 5: 60 (a) + 40 + 20 = 120 > 100 → 2 goes (the least recently used left)
        ];
        let plan = plan(&entries, &limits, now);
        assert_eq!(plan, [(0, Reason::Age), (1, Reason::RepositorySize), (2, Reason::TotalSize)]);
        let within = [stored("a", 10, now), stored("b", 10, now)];
        assert!(super::plan(&within, &limits, now).is_empty());
    }

    #[test]
    fn blob_paths_name_their_archive() {
        let path = crate::store::Storage::part_path("o/r", 42, 0);
        assert_eq!(blob_id(&path), Some((encoded("o/r"), "42".to_owned())));
        assert_eq!(blob_id(&Path::from("entries/x/y")), None);
    }
}
