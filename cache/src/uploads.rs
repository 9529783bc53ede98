//! Saves, from reservation to commit, for both APIs: an upload is opened (`begin`), gets
//! its archive as parts at offsets (v1 chunks, the v2 single `PUT`) or as blocks put in
//! order by a block list (v2), and is committed (`finish`) or given up.
//!
//! Every upload is bounded as it goes, not only once committed: its parts never overlap
//! (a retry may rewrite the same range) and stay within its reservation or the largest
//! entry, it has at most [`MAX_PARTS`] pieces, a job has at most [`MAX_OPEN_UPLOADS`]
//! open, and its bytes and objects are charged to the job, its repository and all jobs
//! ([`crate::budget`]) until the sweep after its commit has counted them, or it was
//! given up. Below [`Uploads::keep_free`] of free space on the cache's filesystem nothing
//! more is written.
//!
//! What is open is remembered here; an upload this controller has not seen (opened before
//! a restart, or through another controller on the same bucket) is read back from the
//! storage on its first use. A v1 save names its upload by id at every call; a v2 save
//! names its key at the end, so its upload is found by a pending name of that key
//! ([`Uploads::begin_by_key`], [`Uploads::finish_by_key`]).

use std::{
    collections::{BTreeMap, HashMap},
    path::PathBuf,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
};

use bytes::Bytes;

use crate::{
    budget::{Budget, Usage},
    error::CacheError,
    http::{BoxError, write_object},
    lookup::{check_key, check_version},
    metrics::CacheMetrics,
    refusal::Refusal,
    scope::{Limits, MAX_OPEN_UPLOADS, MAX_PARTS, Scope},
    store::{EntryMeta, Storage, UploadMeta, check_parts, encoded, now_ms, part_offset},
};

/// The free space the cache leaves on its filesystem: bytes, or a share of the filesystem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeepFree {
    Bytes(u64),
    Percent(u8),
}

/// What a save's first call finds (or it is refused: [`CacheError::Refused`]).
#[derive(Debug)]
pub enum Begun {
    Started(UploadMeta),
    /// The key is committed already in the job's scope: it is never overwritten.
    Exists,
}

/// What a commit comes to (or it is refused: [`CacheError::Refused`]).
#[derive(Debug)]
pub enum Finished {
    Committed(EntryMeta),
    /// Another save of the key was committed first; this one is given up.
    Exists,
}

/// A new upload's id: random, unguessable enough for a name only its own job learns,
/// and below 2^53 because the v1 client keeps it in a JavaScript number.
pub(crate) fn new_id() -> Result<u64, CacheError> {
    use ring::rand::SecureRandom as _;
    let mut bytes = [0u8; 8];
    ring::rand::SystemRandom::new().fill(&mut bytes).map_err(|_| CacheError::Request("the system offers no randomness".to_owned()))?;
    Ok((u64::from_le_bytes(bytes) & ((1 << 53) - 1)).max(1))
}

/// Where a piece of an upload goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// A part at this offset of the archive.
    Part(u64),
    /// A v2 block, until the block list puts it in its place.
    Block(String),
}

/// The uploads of one cache.
#[derive(Debug)]
pub struct Uploads {
    storage: Arc<Storage>,
    limits: Limits,
    budget: Budget,
    metrics: Arc<CacheMetrics>,
    /// The directory whose filesystem keeps `keep_free` (none on a bucket).
    directory: Option<PathBuf>,
    keep_free: KeepFree,
    write_chunk: usize,
    open: Mutex<HashMap<(String, u64), Open>>,
    /// Commits whose charge the next complete sweep gives back, by generation.
    unswept: Mutex<Vec<(u64, String, String, Usage)>>,
    generation: AtomicU64,
    /// Set by a commit: the sweep loop enforces the limits soon after.
    committed: tokio::sync::Notify,
}

/// An upload, as far as its pieces go.
#[derive(Debug)]
struct Open {
    meta: UploadMeta,
    job: String,
    /// What it has been charged so far.
    charged: Usage,
    /// Offset → (length, being written).
    parts: BTreeMap<u64, (u64, bool)>,
    /// Block id → (length, being written).
    blocks: HashMap<String, (u64, bool)>,
}

impl Open {
    fn pieces(&self) -> u64 {
        (self.parts.len() + self.blocks.len()) as u64
    }

    fn bytes(&self) -> u64 {
        self.parts.values().chain(self.blocks.values()).map(|(length, _)| length).sum()
    }
}

/// The writes of one piece: taken when it starts, given back (with its charge) unless it
/// completes.
struct Writing<'a> {
    uploads: &'a Uploads,
    key: (String, u64),
    piece: Piece,
    /// What the piece replaces (a retried range or block): kept if the write fails.
    replaced: Option<u64>,
    charged: Usage,
    done: bool,
}

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut open = self.uploads.open();
        let Some(upload) = open.get_mut(&self.key) else { return };
        match &self.piece {
            Piece::Part(offset) => match self.replaced {
                Some(length) => drop(upload.parts.insert(*offset, (length, false))),
                None => drop(upload.parts.remove(offset)),
            },
            Piece::Block(id) => match self.replaced {
                Some(length) => drop(upload.blocks.insert(id.clone(), (length, false))),
                None => drop(upload.blocks.remove(id)),
            },
        }
        upload.charged = Usage::new(upload.charged.bytes.saturating_sub(self.charged.bytes), upload.charged.objects.saturating_sub(self.charged.objects));
        self.uploads.budget.release(&upload.job, &upload.meta.repository, self.charged);
    }
}

impl Uploads {
    pub fn new(storage: Arc<Storage>, limits: Limits, metrics: Arc<CacheMetrics>, directory: Option<PathBuf>, write_chunk: usize) -> Uploads {
        Uploads {
            storage,
            limits,
            budget: Budget::new(limits.allowance()),
            metrics,
            directory,
            keep_free: KeepFree::Bytes(2 << 30),
            write_chunk,
            open: Mutex::default(),
            unswept: Mutex::default(),
            generation: AtomicU64::new(0),
            committed: tokio::sync::Notify::new(),
        }
    }

    /// Keeps `keep_free` on the directory's filesystem.
    pub fn keep_free(mut self, keep_free: KeepFree) -> Uploads {
        self.keep_free = keep_free;
        self
    }

    fn open(&self) -> std::sync::MutexGuard<'_, HashMap<(String, u64), Open>> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What all uploads have in flight.
    pub fn in_flight(&self) -> Usage {
        self.budget.total()
    }

    /// Resolves when a commit may have taken a repository over its limit.
    pub async fn committed(&self) {
        self.committed.notified().await;
    }

    /// Refused while the cache's filesystem has less free space than it keeps.
    fn check_room(&self) -> Result<(), Refusal> {
        let Some(directory) = &self.directory else { return Ok(()) };
        let Ok(stat) = nix::sys::statvfs::statvfs(directory) else { return Ok(()) };
        let fragment = stat.fragment_size();
        let (free, size) = (stat.blocks_available() * fragment, stat.blocks() * fragment);
        let keep = match self.keep_free {
            KeepFree::Bytes(bytes) => bytes,
            KeepFree::Percent(percent) => size / 100 * u64::from(percent),
        };
        if free < keep {
            return Err(Refusal::new(
                507,
                "keep_free",
                format!("the cache's filesystem has {} MB free and keeps {} MB (cache.keep_free); not saving cache now", free >> 20, keep >> 20),
            ));
        }
        Ok(())
    }

    /// Checks a save and records its upload (not visible to restores until committed);
    /// `size` is what the client announces (0: unknown), `records` the objects it takes
    /// besides its pieces (its record; v2's pending name too).
    pub async fn begin(&self, scope: &Scope, key: &str, version: &str, size: u64, records: u64) -> Result<Begun, CacheError> {
        if let Some(problem) = check_key(key).err().or_else(|| check_version(version).err()) {
            return Err(Refusal::malformed(problem).into());
        }
        let max = self.limits.max_entry();
        if size > max {
            return Err(Refusal::new(
                400,
                "entry_size",
                format!(
                    "Cache size of ~{} MB ({size} B) is over this runner's limit of {} MB per entry (cache.max_repository_size), not saving cache.",
                    size >> 20,
                    max >> 20
                ),
            )
            .into());
        }
        if self.storage.committed(&scope.repository, &scope.write, version, key).await? {
            self.metrics.save_conflicts.inc();
            return Ok(Begun::Exists);
        }
        self.check_room()?;
        let meta = UploadMeta {
            id: new_id()?,
            key: key.to_owned(),
            version: version.to_owned(),
            repository: scope.repository.clone(),
            git_ref: scope.write.clone(),
            size,
            created_ms: now_ms(),
        };
        let charge = Usage::new(size, records);
        {
            let mut open = self.open();
            let open_now = open.values().filter(|upload| upload.job == scope.job).count();
            if open_now >= MAX_OPEN_UPLOADS {
                return Err(
                    Refusal::too_much("open_uploads", format!("this job has {open_now} saves open, the most it may have at once; commit them first")).into()
                );
            }
            self.budget.charge(&scope.job, &scope.repository, charge).map_err(Refusal::from)?;
            let upload = Open { meta: meta.clone(), job: scope.job.clone(), charged: charge, parts: BTreeMap::new(), blocks: HashMap::new() };
            open.insert((meta.repository.clone(), meta.id), upload);
        }
        if let Err(error) = self.storage.put_json(&Storage::upload_path(&scope.repository, meta.id), &meta).await {
            self.forget(&scope.repository, meta.id);
            return Err(error);
        }
        Ok(Begun::Started(meta))
    }

    /// Begins a save that will be finished by its key ([`Uploads::finish_by_key`]): its
    /// record, and the pending name of its key (the latest save of a key is the one).
    pub async fn begin_by_key(&self, scope: &Scope, key: &str, version: &str) -> Result<Begun, CacheError> {
        let begun = self.begin(scope, key, version, 0, 2).await?;
        if let Begun::Started(upload) = &begun {
            self.storage.put_json(&Storage::pending_path(&scope.repository, &scope.write, version, key), &upload.id).await?;
        }
        Ok(begun)
    }

    /// Commits the save of `key` begun by [`Uploads::begin_by_key`], as [`Uploads::finish`]
    /// does; `None` when the job has no such save open (never begun, finished already, or
    /// of another ref). Its pending name goes once the commit is done or refused.
    pub async fn finish_by_key(&self, scope: &Scope, key: &str, version: &str, size: u64) -> Result<Option<Finished>, CacheError> {
        let pending = Storage::pending_path(&scope.repository, &scope.write, version, key);
        let Some(id) = self.storage.get_json::<u64>(&pending).await? else { return Ok(None) };
        let upload = match self.own(scope, &id.to_string()).await {
            Ok(upload) => upload,
            Err(CacheError::Refused(_)) => return Ok(None),
            Err(error) => return Err(error),
        };
        let finished = self.finish(&upload, size).await;
        if matches!(finished, Ok(_) | Err(CacheError::Refused(_))) {
            self.storage.delete(&pending).await?;
        }
        finished.map(Some)
    }

    /// The job's own upload `id` (read back from the storage if this controller has not
    /// seen it), or why the job may not use it.
    pub async fn own(&self, scope: &Scope, id: &str) -> Result<UploadMeta, CacheError> {
        let Ok(id) = id.parse::<u64>() else { return Err(Refusal::malformed(format!("{id:?} is not an upload id")).into()) };
        let known = self.open().get(&(scope.repository.clone(), id)).map(|upload| upload.meta.clone());
        let meta = match known {
            Some(meta) => meta,
            None => self.read_back(scope, id).await?.ok_or_else(|| {
                Refusal::new(404, "unknown_upload", format!("no upload {id} of {} is open: reserve it first (or it was committed)", scope.repository))
            })?,
        };
        if meta.git_ref != scope.write {
            return Err(Refusal::new(403, "other_ref", format!("upload {id} saves for {}, this job saves for {}", meta.git_ref, scope.write)).into());
        }
        Ok(meta)
    }

    /// An upload this controller has not seen, from the storage: its record, parts and
    /// blocks, charged to `scope`'s job as they are (they are on the storage already).
    async fn read_back(&self, scope: &Scope, id: u64) -> Result<Option<UploadMeta>, CacheError> {
        let Some(meta) = self.storage.get_json::<UploadMeta>(&Storage::upload_path(&scope.repository, id)).await? else { return Ok(None) };
        let parts = self.storage.parts(&scope.repository, id).await?;
        let blocks = self.storage.list(&Storage::staging_dir(&scope.repository, id)).await?;
        let mut upload = Open { meta: meta.clone(), job: scope.job.clone(), charged: Usage::default(), parts: BTreeMap::new(), blocks: HashMap::new() };
        for part in parts {
            if let Some(offset) = part_offset(&part.path) {
                upload.parts.insert(offset, (part.size, false));
            }
        }
        for block in blocks {
            if let Some(name) = block.path.filename() {
                upload.blocks.insert(name.to_owned(), (block.size, false));
            }
        }
        upload.charged = Usage::new(meta.size.max(upload.bytes()), upload.pieces() + 1);
        self.budget.add(&upload.job, &meta.repository, upload.charged);
        let mut open = self.open();
        if let Some(existing) = open.get(&(meta.repository.clone(), id)) {
            // Read back by a concurrent request meanwhile: that one counts.
            self.budget.release(&upload.job, &meta.repository, upload.charged);
            return Ok(Some(existing.meta.clone()));
        }
        open.insert((meta.repository.clone(), id), upload);
        Ok(Some(meta))
    }

    /// Takes the place of `piece` of `upload` for `length` bytes (`None`: unknown until the
    /// body ends) and charges what is known of it.
    fn start_piece(&self, upload: &UploadMeta, piece: Piece, length: Option<u64>) -> Result<Writing<'_>, Refusal> {
        let key = (upload.repository.clone(), upload.id);
        let mut open = self.open();
        let Some(held) = open.get_mut(&key) else {
            return Err(Refusal::new(404, "unknown_upload", format!("upload {} was committed or given up meanwhile", upload.id)));
        };
        let reserved = held.meta.size;
        let limit = if reserved > 0 { reserved } else { self.limits.max_entry() };
        let existing = match &piece {
            Piece::Part(offset) => held.parts.get(offset).copied(),
            Piece::Block(id) => held.blocks.get(id).copied(),
        };
        if existing.is_some_and(|(_, writing)| writing) {
            return Err(Refusal::malformed("that piece of the upload is being written by another request"));
        }
        if let (Piece::Part(start), Some(length)) = (&piece, length) {
            let end = start.saturating_add(length);
            if end > limit {
                let what = if reserved > 0 { "its reservation" } else { "this runner's largest entry (cache.max_repository_size)" };
                return Err(Refusal::new(416, "outside_reservation", format!("bytes {start}-{} lie beyond {what}, {limit} bytes", end.saturating_sub(1))));
            }
            let overlapping = held.parts.range(..end).find(|(other, (other_length, _))| **other != *start && other.saturating_add(*other_length) > *start);
            if let Some((other, (other_length, _))) = overlapping {
                return Err(Refusal::new(
                    416,
                    "overlap",
                    format!("bytes {start}-{} overlap the part at {other} of {other_length} bytes already uploaded", end.saturating_sub(1)),
                ));
            }
        }
        if existing.is_none() && held.pieces() >= MAX_PARTS {
            return Err(Refusal::too_much("parts", format!("an upload has at most {MAX_PARTS} parts or blocks")));
        }
        // Bytes of a reserved upload were charged with its reservation.
        let new_bytes = if reserved > 0 { 0 } else { length.unwrap_or(0).saturating_sub(existing.map_or(0, |(length, _)| length)) };
        let charge = Usage::new(new_bytes, u64::from(existing.is_none()));
        self.budget.charge(&held.job, &held.meta.repository, charge)?;
        held.charged = Usage::new(held.charged.bytes + charge.bytes, held.charged.objects + charge.objects);
        let placed = (length.unwrap_or(0), true);
        match &piece {
            Piece::Part(offset) => held.parts.insert(*offset, placed),
            Piece::Block(id) => held.blocks.insert(id.clone(), placed),
        };
        Ok(Writing { uploads: self, key, piece, replaced: existing.map(|(length, _)| length), charged: charge, done: false })
    }

    /// Writes `body` as `piece` of `upload`: `length` bytes exactly when given, else
    /// whatever arrives within the upload's limits.
    pub async fn write<B>(&self, upload: &UploadMeta, piece: Piece, length: Option<u64>, body: B) -> Result<u64, CacheError>
    where
        B: http_body::Body<Data = Bytes> + Send + Unpin,
        B::Error: Into<BoxError>,
    {
        self.check_room()?;
        let mut writing = self.start_piece(upload, piece.clone(), length)?;
        let path = match &piece {
            Piece::Part(offset) => Storage::part_path(&upload.repository, upload.id, *offset),
            Piece::Block(id) => Storage::block_path(&upload.repository, upload.id, id),
        };
        let reserved = upload.size > 0;
        let max = if reserved { upload.size } else { self.limits.max_entry() };
        // What an unknown length costs is charged as it arrives.
        let (job, repository) = (self.job_of(upload), upload.repository.clone());
        let mut arrived = 0u64;
        let replaced = writing.replaced.unwrap_or(0);
        let admit = |bytes: u64| {
            if reserved || length.is_some() {
                return Ok(());
            }
            let before = arrived.saturating_sub(replaced);
            arrived += bytes;
            let more = arrived.saturating_sub(replaced) - before;
            self.budget.charge(&job, &repository, Usage::new(more, 0)).map_err(Refusal::from)
        };
        let outcome = write_object(self.storage.store().as_ref(), &path, body, (length, max), self.write_chunk, admit).await;
        let unknown_charged = if reserved || length.is_some() { 0 } else { arrived.saturating_sub(replaced) };
        writing.charged.bytes += unknown_charged;
        if let Some(held) = self.open().get_mut(&writing.key) {
            held.charged.bytes += unknown_charged;
        }
        let written = outcome?;
        self.finish_piece(&mut writing, written);
        self.metrics.bytes_uploaded.inc_by(written);
        Ok(written)
    }

    fn job_of(&self, upload: &UploadMeta) -> String {
        self.open().get(&(upload.repository.clone(), upload.id)).map(|held| held.job.clone()).unwrap_or_default()
    }

    fn finish_piece(&self, writing: &mut Writing<'_>, written: u64) {
        writing.done = true;
        if let Some(held) = self.open().get_mut(&writing.key) {
            let placed = (written, false);
            match &writing.piece {
                Piece::Part(offset) => held.parts.insert(*offset, placed),
                Piece::Block(id) => held.blocks.insert(id.clone(), placed),
            };
        }
    }

    /// Puts the staged blocks of `upload`, in the order of `blocks`, in place as the
    /// archive's parts; blocks the list leaves out are deleted.
    pub async fn order_blocks(&self, upload: &UploadMeta, blocks: &[String]) -> Result<(), CacheError> {
        let key = (upload.repository.clone(), upload.id);
        let staged = {
            let open = self.open();
            let Some(held) = open.get(&key) else {
                return Err(Refusal::new(404, "unknown_upload", format!("upload {} was committed or given up meanwhile", upload.id)).into());
            };
            if held.blocks.values().any(|(_, writing)| *writing) {
                return Err(Refusal::malformed("a block of this upload is still being written").into());
            }
            held.blocks.clone()
        };
        let mut layout = Vec::with_capacity(blocks.len());
        let mut offset = 0u64;
        for block in blocks {
            let Some((length, _)) = staged.get(block) else {
                return Err(Refusal::malformed(format!("the block list names {block:?}, which was not uploaded")).into());
            };
            layout.push((block.clone(), offset));
            offset += length;
        }
        if offset > self.limits.max_entry() {
            return Err(Refusal::new(
                400,
                "entry_size",
                format!(
                    "the blocks make {} MB, over this runner's limit of {} MB per entry (cache.max_repository_size)",
                    offset >> 20,
                    self.limits.max_entry() >> 20
                ),
            )
            .into());
        }
        for (block, offset) in &layout {
            self.storage
                .rename(&Storage::block_path(&upload.repository, upload.id, block), &Storage::part_path(&upload.repository, upload.id, *offset))
                .await?;
        }
        let listed: std::collections::HashSet<&String> = blocks.iter().collect();
        for (block, _) in staged.iter().filter(|(block, _)| !listed.contains(block)) {
            self.storage.delete(&Storage::block_path(&upload.repository, upload.id, block)).await?;
        }
        if let Some(held) = self.open().get_mut(&key) {
            let unlisted: Vec<String> = held.blocks.keys().filter(|block| !listed.contains(block)).cloned().collect();
            let freed: u64 = unlisted.iter().filter_map(|block| held.blocks.get(block)).map(|(length, _)| length).sum();
            let release = Usage::new(if held.meta.size > 0 { 0 } else { freed }, unlisted.len() as u64);
            held.blocks.clear();
            for (block, offset) in layout {
                held.parts.insert(offset, (staged.get(&block).map_or(0, |(length, _)| *length), false));
            }
            held.charged = Usage::new(held.charged.bytes.saturating_sub(release.bytes), held.charged.objects.saturating_sub(release.objects));
            self.budget.release(&held.job, &held.meta.repository, release);
        }
        Ok(())
    }

    /// Commits `upload` of `size` bytes: its parts must be exactly the archive; the entry
    /// is written only if its key is not committed yet. Either way the upload is closed.
    pub async fn finish(&self, upload: &UploadMeta, size: u64) -> Result<Finished, CacheError> {
        if upload.size > 0 && upload.size != size {
            return Err(Refusal::malformed(format!("the commit says {size} bytes, the reservation {}", upload.size)).into());
        }
        if size > self.limits.max_entry() {
            return Err(Refusal::new(
                400,
                "entry_size",
                format!("{} MB is over this runner's limit of {} MB per entry (cache.max_repository_size)", size >> 20, self.limits.max_entry() >> 20),
            )
            .into());
        }
        let key = (upload.repository.clone(), upload.id);
        if self.open().get(&key).is_some_and(|held| held.parts.values().chain(held.blocks.values()).any(|(_, writing)| *writing)) {
            return Err(Refusal::malformed("a part of this upload is still being written").into());
        }
        let parts = self.storage.parts(&upload.repository, upload.id).await?;
        check_parts(&parts, size).map_err(Refusal::malformed)?;
        let entry = EntryMeta { size, created_ms: now_ms(), ..upload.clone() };
        let committed = self.storage.commit_entry(&entry).await?;
        self.storage.delete(&Storage::upload_path(&upload.repository, upload.id)).await?;
        let closed = self.open().remove(&key);
        if !committed {
            self.storage.delete_all(&Storage::blob_dir(&upload.repository, upload.id)).await?;
            if let Some(closed) = closed {
                self.budget.release(&closed.job, &closed.meta.repository, closed.charged);
            }
            self.metrics.save_conflicts.inc();
            return Ok(Finished::Exists);
        }
        if let Some(closed) = closed {
            // Counted by the sweep that follows (on the storage, within the limits of
            // committed entries): until then, still this job's.
            let generation = self.generation.load(Ordering::SeqCst);
            self.unswept().push((generation, closed.job, closed.meta.repository, closed.charged));
        }
        tracing::info!(repository = %entry.repository, git_ref = %entry.git_ref, key = %entry.key, size, "cache entry saved");
        self.metrics.saved.inc();
        self.committed.notify_one();
        Ok(Finished::Committed(entry))
    }

    fn unswept(&self) -> std::sync::MutexGuard<'_, Vec<(u64, String, String, Usage)>> {
        self.unswept.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A sweep starts: what was committed before now, it sees.
    pub fn sweep_starts(&self) -> u64 {
        self.generation.fetch_add(1, Ordering::SeqCst)
    }

    /// The sweep that started at `mark` is done: the commits it saw are counted by the
    /// limits of committed entries now.
    pub fn swept(&self, mark: u64) {
        let done: Vec<_> = {
            let mut unswept = self.unswept();
            let (done, later) = std::mem::take(&mut *unswept).into_iter().partition(|(generation, ..)| *generation <= mark);
            *unswept = later;
            done
        };
        for (_, job, repository, usage) in done {
            self.budget.release(&job, &repository, usage);
        }
    }

    /// The sweep gave up `id` of `repository` (as stored: percent-encoded or not): its
    /// charge goes back.
    pub fn given_up(&self, repository: &str, id: u64) {
        self.forget(repository, id);
    }

    fn forget(&self, repository: &str, id: u64) {
        let forgotten = {
            let mut open = self.open();
            let key = open.keys().find(|(stored, stored_id)| *stored_id == id && (stored == repository || encoded(stored) == repository)).cloned();
            key.and_then(|key| open.remove(&key))
        };
        if let Some(upload) = forgotten {
            self.budget.release(&upload.job, &upload.meta.repository, upload.charged);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_fit_a_javascript_number() {
        for _ in 0..64 {
            let id = new_id().unwrap();
            assert!((1..1 << 53).contains(&id));
        }
    }
}
