//! Where the cache keeps what it keeps, on one object store (a directory, or an
//! S3-compatible bucket several controllers share): the same layout on both, so that
//! the index is the storage and a restarted (or another) controller finds everything.
//!
//! ```text
//! entries/<repository>/<ref>/<version>/<sha256(key)>   committed entry (JSON, written once)
//! used/<repository>/<ref>/<version>/<sha256(key)>      empty, written on use: its modification
//!                                                       time is the entry's last use
//! blobs/<repository>/<id>/<offset, 20 digits>          the archive, in parts
//! uploads/<repository>/<id>                            an upload not committed yet (JSON)
//! pending/<repository>/<ref>/<version>/<sha256(key)>    the v2 upload of that key (its id)
//! staging/<repository>/<id>/<block id, hex>            v2 blocks before their block list
//! ```
//!
//! An entry is visible only once its JSON exists, which commit writes last and only if
//! absent: an entry being written is invisible, a committed one is never overwritten. A
//! restore marks its use beside the entry, never on it: a mark that races the sweep's
//! eviction leaves a stray mark (the next sweep removes it), never an entry without its
//! archive.
//! Path segments are percent-encoded by `object_store`, so a ref like `refs/heads/main`
//! is one segment.

use std::{collections::HashMap, sync::Arc};

use bytes::Bytes;
use futures_util::TryStreamExt as _;
use object_store::{ObjectStore, ObjectStoreExt as _, PutMode, PutOptions, PutPayload, path::Path};
use serde::{Deserialize, Serialize};

use crate::error::CacheError;

/// A committed entry, or an upload between reserve and commit (the same record: commit
/// writes the upload's, with the archive's size, as the entry).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryMeta {
    pub id: u64,
    pub key: String,
    pub version: String,
    pub repository: String,
    #[serde(rename = "ref")]
    pub git_ref: String,
    /// The archive's size; of an upload, what the client announced (0: unknown, v2).
    pub size: u64,
    pub created_ms: i64,
}

/// An upload between reserve and commit.
pub type UploadMeta = EntryMeta;

/// A stored object: where, how big, when last written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Object {
    pub path: Path,
    pub size: u64,
    pub modified_ms: i64,
}

/// The cache's objects on one store.
#[derive(Debug)]
pub struct Storage {
    store: Arc<dyn ObjectStore>,
    /// Entries are written once: what was read of one is what it holds until it goes.
    entries: std::sync::Mutex<Remembered>,
}

/// The entries read so far, by path and by archive id.
#[derive(Debug, Default)]
struct Remembered {
    by_path: HashMap<Path, EntryMeta>,
    /// (repository, archive id) → its entry: whose archive a download asks for.
    by_archive: HashMap<(String, u64), EntryMeta>,
}

impl Remembered {
    fn insert(&mut self, path: Path, entry: EntryMeta) {
        // A bound, not a policy: entries are read again after a flush.
        if self.by_path.len() > 100_000 {
            *self = Remembered::default();
        }
        self.by_archive.insert((entry.repository.clone(), entry.id), entry.clone());
        self.by_path.insert(path, entry);
    }

    fn remove(&mut self, path: &Path) {
        if let Some(entry) = self.by_path.remove(path) {
            self.by_archive.remove(&(entry.repository, entry.id));
        }
    }
}

/// The hex sha256 of `key`: a key may be longer than a path segment may be.
pub fn key_hash(key: &str) -> String {
    ring::digest::digest(&ring::digest::SHA256, key.as_bytes()).as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

fn path(parts: &[&str]) -> Path {
    Path::from_iter(parts.iter().copied())
}

impl Storage {
    pub fn new(store: Arc<dyn ObjectStore>) -> Self {
        Storage { store, entries: std::sync::Mutex::default() }
    }

    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    pub fn entry_dir(repository: &str, git_ref: &str, version: &str) -> Path {
        path(&["entries", repository, git_ref, version])
    }

    pub fn entry_path(repository: &str, git_ref: &str, version: &str, key: &str) -> Path {
        path(&["entries", repository, git_ref, version, &key_hash(key)])
    }

    pub fn used_dir(repository: &str, git_ref: &str, version: &str) -> Path {
        path(&["used", repository, git_ref, version])
    }

    pub fn used_path(repository: &str, git_ref: &str, version: &str, key: &str) -> Path {
        path(&["used", repository, git_ref, version, &key_hash(key)])
    }

    pub fn upload_path(repository: &str, id: u64) -> Path {
        path(&["uploads", repository, &id.to_string()])
    }

    pub fn pending_path(repository: &str, git_ref: &str, version: &str, key: &str) -> Path {
        path(&["pending", repository, git_ref, version, &key_hash(key)])
    }

    pub fn blob_dir(repository: &str, id: u64) -> Path {
        path(&["blobs", repository, &id.to_string()])
    }

    pub fn part_path(repository: &str, id: u64, offset: u64) -> Path {
        path(&["blobs", repository, &id.to_string(), &format!("{offset:020}")])
    }

    pub fn staging_dir(repository: &str, id: u64) -> Path {
        path(&["staging", repository, &id.to_string()])
    }

    pub fn block_path(repository: &str, id: u64, block: &str) -> Path {
        let hex: String = block.bytes().map(|b| format!("{b:02x}")).collect();
        path(&["staging", repository, &id.to_string(), &hex])
    }

    /// Every object under `prefix` (a directory of the layout), in path order.
    pub async fn list(&self, prefix: &Path) -> Result<Vec<Object>, CacheError> {
        let mut objects: Vec<Object> = self
            .store
            .list(Some(prefix))
            .map_ok(|meta| Object { path: meta.location, size: meta.size, modified_ms: meta.last_modified.timestamp_millis() })
            .try_collect()
            .await?;
        objects.sort_by(|a, b| a.path.as_ref().cmp(b.path.as_ref()));
        Ok(objects)
    }

    /// The committed entries of one scope and version, with when each was last used.
    pub async fn entries(&self, repository: &str, git_ref: &str, version: &str) -> Result<Vec<(EntryMeta, i64)>, CacheError> {
        let listed = self.list(&Self::entry_dir(repository, git_ref, version)).await?;
        let marks: HashMap<String, i64> = self
            .list(&Self::used_dir(repository, git_ref, version))
            .await?
            .into_iter()
            .filter_map(|mark| Some((mark.path.filename()?.to_owned(), mark.modified_ms)))
            .collect();
        let mut found = Vec::with_capacity(listed.len());
        for object in listed {
            let used = object.path.filename().and_then(|name| marks.get(name)).copied().unwrap_or(0).max(object.modified_ms);
            if let Some(entry) = self.entry(&object.path).await? {
                found.push((entry, used));
            }
        }
        Ok(found)
    }

    /// The entry at `path`, if it (still) exists.
    pub async fn entry(&self, path: &Path) -> Result<Option<EntryMeta>, CacheError> {
        if let Some(entry) = self.remembered().by_path.get(path) {
            return Ok(Some(entry.clone()));
        }
        let Some(bytes) = self.read(path).await? else { return Ok(None) };
        let entry: EntryMeta = serde_json::from_slice(&bytes).map_err(|source| CacheError::Corrupt { path: path.to_string(), source })?;
        self.remembered().insert(path.clone(), entry.clone());
        Ok(Some(entry))
    }

    /// The committed entry of `repository` whose archive is `id`, as far as this process
    /// has read (see [`Storage::read_ref`]).
    pub fn archive(&self, repository: &str, id: u64) -> Option<EntryMeta> {
        self.remembered().by_archive.get(&(repository.to_owned(), id)).cloned()
    }

    /// Reads every committed entry of one ref (every version), so that [`Storage::archive`]
    /// knows them.
    pub async fn read_ref(&self, repository: &str, git_ref: &str) -> Result<(), CacheError> {
        for object in self.list(&path(&["entries", repository, git_ref])).await? {
            self.entry(&object.path).await?;
        }
        Ok(())
    }

    fn remembered(&self) -> std::sync::MutexGuard<'_, Remembered> {
        self.entries.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Writes `entry` if no entry of its key exists in its scope and version: `false`
    /// when one does (committed entries are never overwritten).
    pub async fn commit_entry(&self, entry: &EntryMeta) -> Result<bool, CacheError> {
        let path = Self::entry_path(&entry.repository, &entry.git_ref, &entry.version, &entry.key);
        let json = serde_json::to_vec(entry).map_err(|source| CacheError::Corrupt { path: path.to_string(), source })?;
        let options = PutOptions { mode: PutMode::Create, ..PutOptions::default() };
        match self.store.put_opts(&path, PutPayload::from(json), options).await {
            Ok(_) => {
                self.remembered().insert(path, entry.clone());
                Ok(true)
            }
            Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
            Err(error) => Err(error.into()),
        }
    }

    /// Marks the entry used now, beside it (the entry itself is never written again).
    pub async fn touch(&self, entry: &EntryMeta) -> Result<(), CacheError> {
        let path = Self::used_path(&entry.repository, &entry.git_ref, &entry.version, &entry.key);
        self.store.put(&path, PutPayload::default()).await?;
        Ok(())
    }

    /// Whether a committed entry of this key exists in the scope.
    pub async fn committed(&self, repository: &str, git_ref: &str, version: &str, key: &str) -> Result<bool, CacheError> {
        Ok(self.read(&Self::entry_path(repository, git_ref, version, key)).await?.is_some())
    }

    pub async fn put_json<T: Serialize>(&self, path: &Path, value: &T) -> Result<(), CacheError> {
        let json = serde_json::to_vec(value).map_err(|source| CacheError::Corrupt { path: path.to_string(), source })?;
        self.store.put(path, PutPayload::from(json)).await?;
        Ok(())
    }

    pub async fn get_json<T: for<'de> Deserialize<'de>>(&self, path: &Path) -> Result<Option<T>, CacheError> {
        let Some(bytes) = self.read(path).await? else { return Ok(None) };
        serde_json::from_slice(&bytes).map(Some).map_err(|source| CacheError::Corrupt { path: path.to_string(), source })
    }

    async fn read(&self, path: &Path) -> Result<Option<Bytes>, CacheError> {
        match self.store.get(path).await {
            Ok(result) => Ok(Some(result.bytes().await?)),
            Err(object_store::Error::NotFound { .. }) => {
                self.remembered().remove(path);
                Ok(None)
            }
            Err(error) => Err(error.into()),
        }
    }

    /// Deletes `path`; gone already is fine.
    pub async fn delete(&self, path: &Path) -> Result<(), CacheError> {
        self.remembered().remove(path);
        match self.store.delete(path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(error) => Err(error.into()),
        }
    }

    /// Deletes every object under `prefix`.
    pub async fn delete_all(&self, prefix: &Path) -> Result<u64, CacheError> {
        let mut freed = 0;
        for object in self.list(prefix).await? {
            self.delete(&object.path).await?;
            freed += object.size;
        }
        Ok(freed)
    }

    /// Moves a staged v2 block into its place as a part of the archive (replacing what is
    /// there).
    pub async fn rename(&self, from: &Path, to: &Path) -> Result<(), CacheError> {
        self.store.rename(from, to).await?;
        Ok(())
    }

    /// The parts of an archive, in order, if they cover `0..size` without a gap.
    pub async fn parts(&self, repository: &str, id: u64) -> Result<Vec<Object>, CacheError> {
        self.list(&Self::blob_dir(repository, id)).await
    }
}

/// A repository as it stands (percent-encoded) in a path segment: what a listing of the
/// store gives back.
pub fn encoded(repository: &str) -> String {
    object_store::path::PathPart::from(repository).as_ref().to_owned()
}

/// Now, in the milliseconds since the epoch the records and the store's times are in.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// The offset a part's name holds.
pub fn part_offset(path: &Path) -> Option<u64> {
    path.filename()?.parse().ok()
}

/// Whether `parts` (in order) are exactly `0..size`.
///
/// # Errors
/// What does not fit, to tell the client.
pub fn check_parts(parts: &[Object], size: u64) -> Result<(), String> {
    let mut next = 0u64;
    for part in parts {
        let offset = part_offset(&part.path).ok_or_else(|| format!("{} is not a part of an archive", part.path))?;
        if offset != next {
            return Err(format!("the archive has {} at byte {next}", if offset > next { "a gap" } else { "overlapping chunks" }));
        }
        next = offset + part.size;
    }
    if next != size {
        return Err(format!("{next} bytes were uploaded, the commit says {size}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(offset: u64, size: u64) -> Object {
        Object { path: Storage::part_path("o/r", 7, offset), size, modified_ms: 0 }
    }

    /// (offset, size) of each part, the size committed, whether they fit.
    type Case<'a> = (&'a [(u64, u64)], u64, bool);

    #[test]
    fn parts_must_cover_the_archive_exactly() {
        let table: &[Case<'_>] = &[
            (&[(0, 10), (10, 5)], 15, true),
            (&[], 0, true),
            (&[(0, 10)], 15, false),
            (&[(0, 10), (12, 3)], 15, false),
            (&[(0, 10), (8, 7)], 15, false),
            (&[(5, 10)], 15, false),
        ];
        for (parts, size, ok) in table {
            let parts: Vec<Object> = parts.iter().map(|(o, s)| part(*o, *s)).collect();
            assert_eq!(check_parts(&parts, *size).is_ok(), *ok, "{parts:?} {size}");
        }
    }

    #[test]
    fn the_layout_keeps_a_ref_in_one_segment() {
        let entry = Storage::entry_path("owner/repo", "refs/heads/main", "abc", "key");
        assert_eq!(entry.parts().count(), 5, "{entry}");
        assert_eq!(part_offset(&Storage::part_path("o/r", 1, 33_554_432)), Some(33_554_432));
        assert_eq!(key_hash("k").len(), 64);
    }
}
