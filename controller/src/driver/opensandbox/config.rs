//! `[opensandbox]`: where the Lifecycle API is and how sandboxes are made, and the
//! checks of those settings.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use reqwest::Url;
use serde::Deserialize;

use crate::setting::Problems;

/// How sandboxes are made.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenSandboxConfig {
    /// The Lifecycle API, e.g. `https://opensandbox.example.com` (with or without `/v1`).
    pub url: String,
    /// File holding the API key (`OPEN-SANDBOX-API-KEY`); read again after a 401/403.
    pub api_key_file: PathBuf,
    /// The runner image (as the sandbox runtime pulls it).
    pub image: String,
    /// The supervisor and the runner: OpenSandbox needs the entrypoint spelled out.
    #[serde(default = "crate::driver::default_command")]
    pub entrypoint: Vec<String>,
    /// `resourceLimits.cpu`, Kubernetes quantity syntax.
    #[serde(default = "default_cpu")]
    pub cpu: String,
    /// `resourceLimits.memory`, Kubernetes quantity syntax.
    #[serde(default = "default_memory")]
    pub memory: String,
    /// The sandbox's lifetime: the job's ceiling (the server removes it after that).
    #[serde(default = "default_timeout", with = "crate::setting::duration")]
    pub timeout: Duration,
    /// More environment for the supervisor (e.g. `SUPERVISOR_DOCKER = "false"` where the
    /// sandbox cannot run a nested dockerd). Never secrets, never contract variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// How long one API request may take.
    #[serde(default = "default_request_timeout", with = "crate::setting::duration")]
    pub request_timeout: Duration,
    /// `[opensandbox.spire]`: one SPIRE entry per sandbox, so that the supervisor inside
    /// gets exactly its job's SVID from the sandbox's own agent.
    #[serde(default)]
    pub spire: Option<crate::driver::spire::SpireConfig>,
}

impl std::fmt::Debug for OpenSandboxConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenSandboxConfig")
            .field("url", &self.url)
            .field("api_key_file", &self.api_key_file)
            .field("image", &self.image)
            .field("cpu", &self.cpu)
            .field("memory", &self.memory)
            .field("timeout", &self.timeout)
            .field("spire", &self.spire)
            .finish_non_exhaustive()
    }
}

fn default_cpu() -> String {
    "2".into()
}
fn default_memory() -> String {
    "4Gi".into()
}
fn default_timeout() -> Duration {
    // Gitea's own job timeout.
    Duration::from_secs(3 * 3600)
}
fn default_request_timeout() -> Duration {
    Duration::from_secs(60)
}

impl OpenSandboxConfig {
    pub fn validate(&self, problems: &mut Problems) {
        let mut invalid = |setting: &str, message: String| problems.add(format!("opensandbox.{setting}"), message);
        if !(self.url.starts_with("http://") || self.url.starts_with("https://")) || Url::parse(&self.url).is_err() {
            invalid("url", format!("{:?} must be the http(s) URL of the OpenSandbox Lifecycle API", self.url));
        }
        if self.image.trim().is_empty() {
            invalid("image", "the runner image is required".into());
        }
        if self.entrypoint.is_empty() {
            invalid("entrypoint", "must name the supervisor (the default does)".into());
        }
        if self.timeout < Duration::from_secs(60) {
            invalid("timeout", "must be at least 1m (OpenSandbox's minimum)".into());
        }
        if self.request_timeout.is_zero() {
            invalid("request_timeout", "must be positive".into());
        }
        if let Err(message) = crate::driver::check_extra_env(&self.env) {
            invalid("env", message);
        }
        if let Some(spire) = &self.spire {
            spire.validate("opensandbox.spire", problems);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> OpenSandboxConfig {
        toml::from_str(
            r#"
url = "http://127.0.0.1:8080"
api_key_file = "/etc/gdr/opensandbox.key"
image = "gitea-dynamic-runner/runner:latest"
"#,
        )
        .unwrap()
    }

    #[test]
    fn settings_are_validated_with_their_names() {
        let defaults = config();
        assert_eq!(Problems::check(|p| defaults.validate(p)), Ok(()));
        assert_eq!(defaults.entrypoint[..3], ["/usr/local/bin/supervisor", "run", "--"]);
        assert_eq!((defaults.cpu.as_str(), defaults.memory.as_str(), defaults.timeout), ("2", "4Gi", Duration::from_secs(10_800)));
        type Change = fn(&mut OpenSandboxConfig);
        let cases: &[(Change, &str)] = &[
            (|c| c.url = "opensandbox:8080".into(), "opensandbox.url"),
            (|c| c.image = " ".into(), "opensandbox.image"),
            (|c| c.entrypoint.clear(), "opensandbox.entrypoint"),
            (|c| c.timeout = Duration::from_secs(30), "opensandbox.timeout"),
            (|c| c.request_timeout = Duration::ZERO, "opensandbox.request_timeout"),
            (|c| _ = c.env.insert("CI_RUNNER_CAPABILITY".into(), "x".into()), "opensandbox.env"),
            (|c| _ = c.env.insert("GITEA_RUNNER_TOKEN".into(), "x".into()), "opensandbox.env"),
        ];
        for &(change, setting) in cases {
            let mut config = config();
            change(&mut config);
            let problems = Problems::check(|p| config.validate(p)).expect_err(setting);
            assert_eq!(problems.settings(), [setting], "{problems}");
        }
    }
}
