//! `[gitea]` and `[identity]`: the Gitea instance this controller is a runner of, how
//! it polls, and the trust domain of the jobs' identities.

use std::{path::PathBuf, time::Duration};

use serde::Deserialize;

use crate::{
    assignment::placement::LabelPolicy,
    setting::{Problems, duration, http_url},
};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GiteaConfig {
    /// The instance URL, e.g. `https://gitea.example.com`.
    pub url: String,
    /// Gitea as environments reach it (CI_GITEA_URL), when it differs from `url`:
    /// jobs' checkout, artifacts and API calls go there through the supervisor.
    pub environment_url: Option<String>,
    /// File holding the registration token; only read when a placement has no stored
    /// credential yet.
    pub registration_token_file: Option<PathBuf>,
    /// Where the runner credentials are kept, one file per placement (mode 0600). Every
    /// replica of the controller must see the same files.
    pub credential_dir: PathBuf,
    /// Registrations are named `<runner_name>-<placement>`.
    #[serde(default = "default_runner_name")]
    pub runner_name: String,
    /// This installation's name (lower-case letters, digits and `-`, at most 20): every
    /// environment it makes carries it, and it removes and counts only its own. Default:
    /// derived from `url` and the store, so two installations — two Gitea instances, or
    /// one Gitea with two stores during a migration — never share it. Set it to keep it
    /// when the URL or the store's location changes.
    pub installation: Option<String>,
    /// The label every job of this runner must name (see README "Labels").
    #[serde(default = "default_required_label")]
    pub required_label: String,
    /// Also accept and declare the previous implementation's `pod` and `vm-dev`.
    #[serde(default)]
    pub legacy_labels: bool,
    /// The pause after an empty FetchTask right after work was seen (a task handed out,
    /// an assignment ended, a queued job's webhook); it doubles with each empty reply in
    /// a row up to `fetch_interval_max` (gitea-runner's two settings of the same names).
    #[serde(default = "default_fetch_interval", with = "duration")]
    pub fetch_interval: Duration,
    /// The longest pause while idle: what an idle controller costs Gitea, one FetchTask
    /// per fetch loop this often. Never below `fetch_interval`.
    #[serde(default = "default_fetch_interval_max", with = "duration")]
    pub fetch_interval_max: Duration,
    /// The secret of Gitea's `workflow_job` webhook (Gitea ≥ 1.24), in a file: with it,
    /// `POST /hooks/gitea` on `http.listen` takes signed deliveries and a queued job is
    /// fetched at once instead of at the next poll (which stays as the fallback).
    pub webhook_secret_file: Option<PathBuf>,
    /// How long one FetchTask may take (gitea-runner's `fetch_timeout`). A reply that
    /// comes later is lost with any task in it, so keep it well above Gitea's response
    /// time under load.
    #[serde(default = "default_fetch_timeout", with = "duration")]
    pub fetch_timeout: Duration,
    #[serde(default = "default_keepalive", with = "duration")]
    pub keepalive_interval: Duration,
    /// How often environments are compared with assignments (dead ones fail their task).
    #[serde(default = "default_reconcile", with = "duration")]
    pub reconcile_interval: Duration,
    /// How long a scheduler holds its registration after its last renewal: a standby
    /// replica takes over this long after the holder died (at once after a clean stop).
    #[serde(default = "default_lease_ttl", with = "duration")]
    pub lease_ttl: Duration,
}

fn default_runner_name() -> String {
    "gitea-dynamic-runner".into()
}
fn default_required_label() -> String {
    crate::assignment::placement::DISPOSABLE.into()
}
fn default_fetch_interval() -> Duration {
    Duration::from_millis(500)
}
/// An idle controller polls as it always has (every 2 s, gitea-runner's `fetch_interval`).
fn default_fetch_interval_max() -> Duration {
    Duration::from_secs(2)
}
fn default_fetch_timeout() -> Duration {
    Duration::from_secs(5)
}
fn default_keepalive() -> Duration {
    crate::scheduler::keepalive::DEFAULT_INTERVAL
}
fn default_reconcile() -> Duration {
    Duration::from_secs(10)
}
fn default_lease_ttl() -> Duration {
    crate::scheduler::LEASE_TTL
}

impl GiteaConfig {
    pub fn label_policy(&self) -> LabelPolicy {
        LabelPolicy { required: self.required_label.clone(), legacy: self.legacy_labels, host_platforms: Vec::new() }
    }

    pub fn validate(&self, problems: &mut Problems) {
        problems.take(http_url("gitea.url", &self.url, "of the Gitea instance"));
        if let Some(url) = &self.environment_url {
            problems.take(http_url("gitea.environment_url", url, "of the Gitea instance as environments reach it"));
        }
        if let Some(installation) = &self.installation
            && (installation.is_empty()
                || installation.len() > 20
                || !installation.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                || installation.starts_with('-')
                || installation.ends_with('-'))
        {
            problems.add(
                "gitea.installation",
                format!("{installation:?} must be 1 to 20 lower-case letters, digits and inner dashes (it is part of every environment's name)"),
            );
        }
        if let Err(message) = self.label_policy().validate() {
            problems.add("gitea.required_label", message);
        }
        if self.keepalive_interval >= Duration::from_secs(600) || self.keepalive_interval.is_zero() {
            problems.add("gitea.keepalive_interval", "must be between 1s and 10m (Gitea's zombie timeout)");
        }
        if !(Duration::from_secs(1)..=Duration::from_secs(60)).contains(&self.fetch_timeout) {
            problems.add("gitea.fetch_timeout", format!("{:?} must be between 1s and 60s", self.fetch_timeout));
        }
        if self.reconcile_interval < Duration::from_secs(1) {
            problems.add("gitea.reconcile_interval", "must be at least 1s");
        }
        if !(Duration::from_secs(1)..=Duration::from_secs(300)).contains(&self.lease_ttl) {
            problems.add("gitea.lease_ttl", format!("{:?} must be between 1s and 5m", self.lease_ttl));
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentityConfig {
    pub trust_domain: String,
}

impl IdentityConfig {
    pub fn validate(&self, problems: &mut Problems) {
        if let Err(error) = crate::assignment::identity::validate_trust_domain(&self.trust_domain) {
            problems.add("identity.trust_domain", error.to_string());
        }
    }
}
