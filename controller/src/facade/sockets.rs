//! One unix socket per environment (the docker placement):
//! `<facade.environment_socket_dir>/<environment>/facade.sock`.
//!
//! The environment's *directory* is mounted into that environment alone (at
//! `contract::facade::ENVIRONMENT_DIR`), never the socket file: a restarted controller
//! unlinks the old socket and binds a new inode, which a mounted file would never show —
//! every running job was cut off from the facade by a restart. A connection accepted on
//! an environment's socket comes from that environment, so the facade refuses any call
//! on it for another assignment ([`Peer::Environment`]): a job that read another job's
//! capability cannot use it.
//!
//! Which sockets exist follows the store ([`EnvironmentSockets::sync`]): one for every
//! live assignment of a placement with sockets, opened again after a restart, closed
//! (and its directory removed) a while after the assignment ended. The worker opens its
//! environment's socket before creating it, so a claim never waits for a sync.

use std::{
    collections::HashMap,
    os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use tokio::net::UnixStream;
use tokio_util::sync::CancellationToken;

use super::{Facade, FacadeError, Peer, transport::Authenticated};
use crate::{assignment::Placement, store::Store};

/// How long an environment's socket stays open after its assignment left the live
/// records: the runner flushes its last log rows after a cancel, and the environment is
/// retired (grace, then its supervisor's drain) before it is gone.
pub const CLOSE_AFTER: Duration = Duration::from_secs(120);

/// The placements whose environments get their own socket (those whose driver can mount
/// a host directory).
pub const PLACEMENTS: [Placement; 1] = [Placement::CONTAINER_DOCKER];

type Connection = std::io::Result<Authenticated<UnixStream>>;

/// The per-environment sockets of one facade process.
#[derive(Debug)]
pub struct EnvironmentSockets {
    dir: PathBuf,
    /// The installation: environment names derive from it and the assignment id.
    instance: String,
    /// Whose environments get a socket.
    placements: Vec<Placement>,
    connections: tokio::sync::mpsc::Sender<Connection>,
    receiver: Mutex<Option<tokio::sync::mpsc::Receiver<Connection>>>,
    open: Mutex<HashMap<String, Open>>,
}

#[derive(Debug)]
struct Open {
    accepting: tokio::task::AbortHandle,
    /// When its assignment was last seen live (or the socket opened).
    seen: Instant,
}

impl EnvironmentSockets {
    /// # Errors
    /// When `dir` cannot be created.
    pub fn new(dir: &Path, instance: &str, placements: &[Placement]) -> Result<Arc<Self>, FacadeError> {
        create_dir(dir).map_err(|source| FacadeError::Bind { address: dir.display().to_string(), source })?;
        let (connections, receiver) = tokio::sync::mpsc::channel(64);
        Ok(Arc::new(EnvironmentSockets {
            dir: dir.to_owned(),
            instance: instance.to_owned(),
            placements: placements.to_vec(),
            connections,
            receiver: Mutex::new(Some(receiver)),
            open: Mutex::new(HashMap::new()),
        }))
    }

    fn open_sockets(&self) -> std::sync::MutexGuard<'_, HashMap<String, Open>> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Binds the socket of `assignment_id`'s environment (again, if a previous process
    /// left it); does nothing when it is open. Connections on it are [`Peer::Environment`].
    ///
    /// # Errors
    /// When the directory or the socket cannot be made.
    pub fn open(&self, assignment_id: &str) -> Result<(), FacadeError> {
        let environment = crate::driver::environment_name(&self.instance, assignment_id);
        let mut open = self.open_sockets();
        if let Some(existing) = open.get_mut(&environment) {
            existing.seen = Instant::now();
            return Ok(());
        }
        let directory = environment_dir(&self.dir, &environment);
        let path = directory.join(contract::facade::SOCKET_NAME);
        let bind_error = |source| FacadeError::Bind { address: path.display().to_string(), source };
        create_dir(&directory).map_err(bind_error)?;
        let _ = std::fs::remove_file(&path);
        let listener = tokio::net::UnixListener::bind(&path).map_err(bind_error)?;
        // The runner uid connects; only this environment sees the directory.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).map_err(bind_error)?;
        let (connections, peer) = (self.connections.clone(), Peer::Environment { assignment_id: assignment_id.to_owned() });
        let accepting = tokio::spawn(async move {
            loop {
                let accepted = listener.accept().await.map(|(stream, _)| Authenticated::new(stream, peer.clone()));
                if connections.send(accepted).await.is_err() {
                    return;
                }
            }
        });
        tracing::debug!(%environment, "facade socket opened");
        open.insert(environment, Open { accepting: accepting.abort_handle(), seen: Instant::now() });
        Ok(())
    }

    /// Closes an environment's socket and removes its directory.
    fn close(&self, environment: &str) {
        if let Some(open) = self.open_sockets().remove(environment) {
            open.accepting.abort();
        }
        let _ = std::fs::remove_dir_all(environment_dir(&self.dir, environment));
        tracing::debug!(%environment, "facade socket closed");
    }

    /// Opens a socket for every live assignment of its placements, closes those whose
    /// assignment left the live records more than [`CLOSE_AFTER`] ago, and removes
    /// directories nobody serves (left by a process that was killed).
    ///
    /// # Errors
    /// When the store cannot be read.
    pub async fn sync(&self, store: &dyn Store) -> Result<(), crate::store::StoreError> {
        let live = store.list().await?;
        let mut wanted = std::collections::HashSet::new();
        for record in live.iter().map(|r| &r.value).filter(|r| !r.is_terminal() && self.placements.contains(&r.placement)) {
            wanted.insert(crate::driver::environment_name(&self.instance, &record.assignment_id));
            if let Err(error) = self.open(&record.assignment_id) {
                tracing::warn!(assignment.id = %record.assignment_id, error = %crate::error_chain(&error), "cannot open the environment's facade socket");
            }
        }
        let now = Instant::now();
        let stale: Vec<String> = self
            .open_sockets()
            .iter_mut()
            .filter_map(|(environment, open)| {
                if wanted.contains(environment) {
                    open.seen = now;
                    None
                } else {
                    (now.duration_since(open.seen) > CLOSE_AFTER).then(|| environment.clone())
                }
            })
            .collect();
        for environment in stale {
            self.close(&environment);
        }
        self.remove_unserved(&wanted);
        Ok(())
    }

    /// Directories of this installation that no socket serves and that are older than
    /// [`CLOSE_AFTER`] (a younger one may belong to an environment a worker of another
    /// process is making).
    fn remove_unserved(&self, wanted: &std::collections::HashSet<String>) {
        let prefix = format!("gdr-{}-", self.instance);
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with(&prefix) || wanted.contains(&name) || self.open_sockets().contains_key(&name) {
                continue;
            }
            let old = entry.metadata().and_then(|m| m.modified()).ok().and_then(|m| m.elapsed().ok()).is_some_and(|age| age > CLOSE_AFTER);
            if old {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }

    /// Serves the facade on every socket opened, until `shutdown`; then closes them
    /// (their directories stay: a restarted controller binds them again).
    ///
    /// # Errors
    /// When the server fails, or when called twice.
    pub async fn serve(self: Arc<Self>, facade: Arc<Facade>, store: Arc<dyn Store>, shutdown: CancellationToken) -> Result<(), FacadeError> {
        let receiver = self.receiver.lock().unwrap_or_else(PoisonError::into_inner).take().ok_or(FacadeError::AlreadyServing)?;
        let syncing = {
            let (sockets, shutdown) = (Arc::clone(&self), shutdown.clone());
            tokio::spawn(async move {
                loop {
                    if let Err(error) = sockets.sync(store.as_ref()).await {
                        tracing::warn!(error = %crate::error_chain(&error), "cannot read the live assignments for their facade sockets");
                    }
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_secs(2)) => {}
                    }
                }
            })
        };
        let served = super::transport::serve_connections(facade, tokio_stream::wrappers::ReceiverStream::new(receiver), shutdown).await;
        syncing.abort();
        let _ = syncing.await;
        for open in self.open_sockets().drain().map(|(_, open)| open) {
            open.accepting.abort();
        }
        served
    }
}

/// `<dir>/<environment>`: what the docker driver mounts.
pub fn environment_dir(dir: &Path, environment: &str) -> PathBuf {
    dir.join(environment)
}

/// Makes an environment's directory and writes its capability file (mode 0600: only
/// root in the environment — its PID 1, which removes it — may read it). Called by the
/// worker before the environment is created.
///
/// # Errors
/// When the directory or the file cannot be written.
pub fn prepare_environment_dir(dir: &Path, environment: &str, capability: &str) -> std::io::Result<PathBuf> {
    let directory = environment_dir(dir, environment);
    create_dir(&directory)?;
    let file = directory.join(contract::facade::CAPABILITY_NAME);
    let temporary = directory.join(".capability.tmp");
    let mut out = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&temporary)?;
    std::io::Write::write_all(&mut out, capability.as_bytes())?;
    std::fs::rename(&temporary, &file)?;
    Ok(directory)
}

/// A directory the environment may enter but not list beyond what it holds (0755).
fn create_dir(path: &Path) -> std::io::Result<()> {
    std::fs::DirBuilder::new().recursive(true).mode(0o755).create(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_capability_file_is_for_root_alone() {
        let dir = tempfile::tempdir().unwrap();
        let environment_dir = prepare_environment_dir(dir.path(), "gdr-x-gitea-task-1", "v1.cap").unwrap();
        let file = environment_dir.join(contract::facade::CAPABILITY_NAME);
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "v1.cap");
        assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::metadata(&environment_dir).unwrap().permissions().mode() & 0o777, 0o755);
        // Written again (a retried create): replaced, not appended.
        prepare_environment_dir(dir.path(), "gdr-x-gitea-task-1", "v1.other").unwrap();
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "v1.other");
    }
}
