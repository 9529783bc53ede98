//! Environment drivers: one per placement, each creating one disposable environment
//! per assignment (a Pod, an OpenSandbox sandbox, a Docker container).
//!
//! Environments are the truth for what runs: every one carries labels that name its
//! assignment, so pools are rebuilt from driver listings at start and a reconciler can
//! find what to delete.

use std::collections::BTreeMap;

use async_trait::async_trait;

use crate::placement::Placement;

pub mod docker;

/// Labels every environment carries (recovery metadata).
pub const LABEL_ASSIGNMENT: &str = "gitea-dynamic-runner/assignment-id";
pub const LABEL_PLACEMENT: &str = "gitea-dynamic-runner/placement";
pub const LABEL_MANAGED: &str = "gitea-dynamic-runner/managed";

/// What a driver is asked to create.
#[derive(Clone, PartialEq, Eq)]
pub struct EnvironmentSpec {
    pub assignment_id: String,
    /// Derived from the assignment id, so a retried create finds the first one.
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// The environment contract (architecture §3): CI_ASSIGNMENT_ID,
    /// CI_RUNNER_CAPABILITY, CI_RUNNER_FACADE_URL, … — never a Gitea credential.
    pub env: BTreeMap<String, String>,
}

impl std::fmt::Debug for EnvironmentSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The capability is a credential: keep it out of logs.
        f.debug_struct("EnvironmentSpec")
            .field("assignment_id", &self.assignment_id)
            .field("name", &self.name)
            .field("labels", &self.labels)
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .finish()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Running,
    /// Marked terminal by the controller; waiting for deletion.
    Terminal,
    /// Exited or failed on its own.
    Exited,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Environment {
    pub name: String,
    pub assignment_id: String,
    pub labels: BTreeMap<String, String>,
    pub phase: Phase,
}

#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("the {placement} driver cannot reach its backend: {detail}")]
    Unavailable { placement: String, detail: String },
    #[error("the {placement} driver refused {name}: {detail}")]
    Refused { placement: String, name: String, detail: String },
}

#[async_trait]
pub trait Driver: Send + Sync + std::fmt::Debug {
    fn placement(&self) -> Placement;
    /// Creates the environment; idempotent by `spec.name` (an existing one is returned).
    async fn create(&self, spec: &EnvironmentSpec) -> Result<Environment, DriverError>;
    async fn get(&self, name: &str) -> Result<Option<Environment>, DriverError>;
    /// Every managed environment whose labels include all of `selector`.
    async fn list(&self, selector: &BTreeMap<String, String>) -> Result<Vec<Environment>, DriverError>;
    async fn mark_terminal(&self, name: &str) -> Result<(), DriverError>;
    /// Deletes it with its storage; deleting a missing one is not an error.
    async fn delete(&self, name: &str) -> Result<(), DriverError>;
}

/// The environment name for an assignment: DNS-1123-safe, as Pods and containers need.
pub fn environment_name(assignment_id: &str) -> String {
    let name: String = assignment_id
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' })
        .collect();
    format!("gdr-{}", name.trim_matches('-'))
}

pub fn labels_for(assignment_id: &str, placement: Placement) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_MANAGED.to_owned(), "true".to_owned()),
        (LABEL_ASSIGNMENT.to_owned(), assignment_id.to_owned()),
        (LABEL_PLACEMENT.to_owned(), placement.to_string()),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_derived_from_the_assignment() {
        assert_eq!(environment_name("gitea-task-42"), "gdr-gitea-task-42");
        assert_eq!(environment_name("gitea-task-42"), environment_name("gitea-task-42"));
        assert_ne!(environment_name("gitea-task-42"), environment_name("gitea-task-43"));
    }
}
