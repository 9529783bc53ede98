//! One Gitea runner registration per placement.
//!
//! Each enabled placement registers as its own runner (`<runner_name>-<placement>`,
//! credential in `<credential_dir>/<placement>.json`) and Declares only its own labels,
//! so its fetch loops can be bounded by its own pool: a full pool leaves its jobs
//! waiting in Gitea, where they belong, while other placements keep fetching. (With one
//! registration declaring every placement's labels, Gitea — not the controller — would
//! pick the placement of the next task, and a task for a full pool would wait in our
//! queue with Gitea's timers running.)
//!
//! Gitea accepts UpdateTask and UpdateLog on a task only from the runner that fetched
//! it, so every record names the runner uuid that fetched it, and every replica of the
//! controller must hold the same credential files (register once, then share them).

use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    sync::Arc,
};

use crate::{
    assignment::placement::{LabelPolicy, Placement, declared_labels},
    gitea::{Gitea, GiteaError, TaskReports},
};

/// What registering needs.
#[derive(Debug, Clone)]
pub struct RegistrationSettings {
    pub url: String,
    pub credential_dir: PathBuf,
    pub registration_token_file: Option<PathBuf>,
    pub runner_name: String,
    pub labels: LabelPolicy,
}

impl RegistrationSettings {
    pub fn credential_file(&self, placement: Placement) -> PathBuf {
        credential_file(&self.credential_dir, placement)
    }
}

/// `<dir>/<placement>.json`.
pub fn credential_file(dir: &Path, placement: Placement) -> PathBuf {
    dir.join(format!("{placement}.json"))
}

/// The registrations of this controller: a Gitea client per placement, and the report
/// channel of every runner uuid it holds.
#[derive(Debug, Clone, Default)]
pub struct Registrations {
    by_placement: BTreeMap<Placement, Gitea>,
    by_uuid: HashMap<String, Arc<dyn TaskReports>>,
}

impl Registrations {
    /// Loads (or registers) and Declares one runner per placement.
    ///
    /// # Errors
    /// The first registration that failed, with its credential file named.
    pub async fn open(settings: &RegistrationSettings, placements: &[Placement]) -> Result<Registrations, GiteaError> {
        let mut registrations = Registrations::default();
        for &placement in placements {
            let labels = declared_labels(placement, &settings.labels);
            let (gitea, credential) = super::connect(
                &settings.url,
                &settings.credential_file(placement),
                settings.registration_token_file.as_deref(),
                &format!("{}-{placement}", settings.runner_name),
                &labels,
            )
            .await?;
            tracing::info!(%placement, uuid = %credential.uuid, labels = ?labels, "registration declared");
            registrations.insert(placement, gitea);
        }
        Ok(registrations)
    }

    fn insert(&mut self, placement: Placement, gitea: Gitea) {
        self.by_uuid.insert(gitea.runner_uuid.clone(), Arc::new(gitea.clone()));
        self.by_placement.insert(placement, gitea);
    }

    /// Reports for tasks that are not Gitea's (`controller run-local`).
    pub fn local(reports: Arc<dyn TaskReports>) -> Registrations {
        Registrations { by_placement: BTreeMap::new(), by_uuid: HashMap::from([(reports.runner_uuid().to_owned(), reports)]) }
    }

    /// The client that fetches for `placement`.
    pub fn fetcher(&self, placement: Placement) -> Option<&Gitea> {
        self.by_placement.get(&placement)
    }

    /// Where reports on a task fetched by `runner_uuid` go.
    ///
    /// # Errors
    /// When this controller does not hold that runner's credential: the message says
    /// that every replica must share the credential files.
    pub fn reports_for(&self, runner_uuid: &str) -> Result<Arc<dyn TaskReports>, UnknownRunner> {
        self.by_uuid
            .get(runner_uuid)
            .cloned()
            .ok_or_else(|| UnknownRunner { runner_uuid: runner_uuid.to_owned(), held: self.by_uuid.keys().cloned().collect() })
    }
}

/// A task fetched by a runner whose credential this controller does not hold.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "the task was fetched by runner {runner_uuid}, but this controller holds the credentials of {held:?}: Gitea accepts \
     reports only from the runner that fetched a task, so every controller replica must use the same credential files \
     (gitea.credential_dir)"
)]
pub struct UnknownRunner {
    pub runner_uuid: String,
    pub held: Vec<String>,
}
