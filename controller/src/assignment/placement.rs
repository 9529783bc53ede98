//! Where a task runs, derived only from its single job's `runs-on`.
//!
//! A placement is `<class>.<driver>`; three exist: `container.kubernetes`,
//! `vm.opensandbox` and `container.docker`. The rules (docs/architecture.md, "Labels") are
//! strict, because Gitea has already handed the task over when we read them: a task
//! that breaks them is failed in Gitea at once with the error's text as the log line.
//!
//! `R` is the required label of the [`LabelPolicy`]: `disposable` by default,
//! `self-hosted` in the seed-compatible policy (which also accepts the legacy labels).
//!
//! | runs-on | placement |
//! |---|---|
//! | `[R, container]`, `[R, container, kubernetes]` | container.kubernetes |
//! | `[R, container, docker]` | container.docker |
//! | `[R, vm]`, `[R, vm, opensandbox]` | vm.opensandbox |
//! | legacy `[self-hosted, pod]` | container.kubernetes |
//! | legacy `[self-hosted, vm-dev]` (and `[self-hosted, vm]`) | vm.opensandbox |
//!
//! Decisions beyond the architecture's rules:
//! - **Unknown labels are an error** that lists the known labels, so a typo never lands a
//!   job somewhere unintended. (Gitea only hands us jobs whose labels are a subset of
//!   the ones we declare, so in practice this only guards direct callers.)
//! - **Matching is case-sensitive**, like Gitea's own label matching (a set of exact
//!   strings): `Container` would never be matched to this runner by Gitea. A label that
//!   differs from a known one only in case gets its own error saying how to write it.
//! - **A driver without a class is an error** ("add `container`"): `[R, docker]`
//!   is not silently widened to `container.docker`, so every placement is spelled out.
//! - Duplicates are harmless; order does not matter.
//! - `vm` is both a class label and a legacy alias; alone it means vm.opensandbox either
//!   way. With a legacy label (`pod`, `vm-dev`) it counts as a class label, so
//!   `[self-hosted, vm-dev, vm]` mixes legacy and canonical labels and is refused.
//! - A legacy label cannot be combined with another legacy label naming a different
//!   placement (`[self-hosted, pod, vm-dev]`).

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_yaml_ng::Value;

/// The label of the previous implementation's runners, required in the seed-compatible policy.
pub const SELF_HOSTED: &str = "self-hosted";
/// The required label of the default policy.
pub const DISPOSABLE: &str = "disposable";
/// Legacy alias of container.kubernetes.
pub const LEGACY_POD: &str = "pod";
/// Legacy alias of vm.opensandbox (as is `vm` alone).
pub const LEGACY_VM_DEV: &str = "vm-dev";
/// The class and driver labels, whatever the policy.
const PLACEMENT_LABELS: [&str; 5] = ["container", "vm", "kubernetes", "opensandbox", "docker"];

/// Which labels this runner answers to.
///
/// Gitea offers a job to every runner whose labels are a superset of the job's
/// `runs-on`, and a fetched task cannot be handed back. So every label declared alone
/// attracts the jobs that name only it: declaring `self-hosted` takes (and, by the
/// rules, fails) every `runs-on: self-hosted` job in the runner's scope, including jobs
/// meant for other runners. The default policy therefore requires a label of its own
/// (`disposable`) instead; the seed-compatible policy (`required = "self-hosted"`,
/// legacy labels on) is right only where no other runner serves `self-hosted`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelPolicy {
    /// Every job of this runner must carry it.
    pub required: String,
    /// Accept and declare the legacy labels `pod` and `vm-dev`.
    pub legacy: bool,
    /// Labels that stand for "this host", as act's `-P ubuntu-latest=-self-hosted`: a job
    /// whose runs-on has only these runs in a docker container. run-local's, for
    /// workflows written for GitHub; empty for a runner registered with Gitea, where a
    /// label must be declared to be offered a job.
    pub host_platforms: Vec<String>,
}

impl Default for LabelPolicy {
    fn default() -> Self {
        LabelPolicy { required: DISPOSABLE.to_owned(), legacy: false, host_platforms: Vec::new() }
    }
}

impl LabelPolicy {
    /// The previous implementation's labels: `self-hosted` plus the legacy aliases.
    pub fn seed_compatible() -> Self {
        LabelPolicy { required: SELF_HOSTED.to_owned(), legacy: true, host_platforms: Vec::new() }
    }

    /// Every label [`from_labels`] understands under this policy.
    pub fn known(&self) -> Vec<&str> {
        let mut known = vec![self.required.as_str()];
        known.extend(PLACEMENT_LABELS.iter().copied().filter(|l| *l != self.required));
        if self.legacy {
            known.extend([LEGACY_POD, LEGACY_VM_DEV]);
        }
        known
    }

    /// A label usable as the required one: a plain Gitea label name, not a class,
    /// driver or legacy label.
    ///
    /// # Errors
    /// Says what is wrong with it.
    pub fn validate(&self) -> Result<(), String> {
        let label = self.required.as_str();
        if label.is_empty() || label.len() > 64 || !label.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) {
            return Err(format!("{label:?} must be 1 to 64 characters of [A-Za-z0-9._-]"));
        }
        if PLACEMENT_LABELS.contains(&label) || [LEGACY_POD, LEGACY_VM_DEV].contains(&label) {
            return Err(format!("{label:?} is a class, driver or legacy label; choose a label of its own, e.g. {DISPOSABLE:?}"));
        }
        Ok(())
    }
}

/// The kind of environment a job gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    Container,
    Vm,
}

impl Class {
    pub const ALL: [Class; 2] = [Class::Container, Class::Vm];

    /// The `runs-on` label (and first half of the placement name).
    pub fn label(self) -> &'static str {
        match self {
            Class::Container => "container",
            Class::Vm => "vm",
        }
    }

    /// The driver used when runs-on names this class and no driver.
    pub fn default_driver(self) -> DriverKind {
        match self {
            Class::Container => DriverKind::Kubernetes,
            Class::Vm => DriverKind::Opensandbox,
        }
    }

    fn from_label(label: &str) -> Option<Class> {
        Class::ALL.into_iter().find(|c| c.label() == label)
    }
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// What creates and destroys the environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DriverKind {
    Kubernetes,
    Opensandbox,
    Docker,
}

impl DriverKind {
    pub const ALL: [DriverKind; 3] = [DriverKind::Kubernetes, DriverKind::Opensandbox, DriverKind::Docker];

    /// The `runs-on` label (and second half of the placement name).
    pub fn label(self) -> &'static str {
        match self {
            DriverKind::Kubernetes => "kubernetes",
            DriverKind::Opensandbox => "opensandbox",
            DriverKind::Docker => "docker",
        }
    }

    /// The only class this driver can run.
    pub fn class(self) -> Class {
        match self {
            DriverKind::Kubernetes | DriverKind::Docker => Class::Container,
            DriverKind::Opensandbox => Class::Vm,
        }
    }

    fn from_label(label: &str) -> Option<DriverKind> {
        DriverKind::ALL.into_iter().find(|d| d.label() == label)
    }
}

impl fmt::Display for DriverKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// Where a task runs: `<class>.<driver>`. Only the combinations in [`Placement::ALL`]
/// are valid; [`Placement::new`], [`FromStr`] and deserialisation refuse the others.
/// (The fields are public for matching; a hand-built unsupported value is reported by
/// [`Placement::is_supported`].) Serialised as its name, e.g. `"container.docker"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct Placement {
    pub class: Class,
    pub driver: DriverKind,
}

impl Placement {
    pub const CONTAINER_KUBERNETES: Placement = Placement { class: Class::Container, driver: DriverKind::Kubernetes };
    pub const VM_OPENSANDBOX: Placement = Placement { class: Class::Vm, driver: DriverKind::Opensandbox };
    pub const CONTAINER_DOCKER: Placement = Placement { class: Class::Container, driver: DriverKind::Docker };
    /// Every supported placement.
    pub const ALL: [Placement; 3] = [Placement::CONTAINER_KUBERNETES, Placement::VM_OPENSANDBOX, Placement::CONTAINER_DOCKER];

    /// # Errors
    /// [`PlacementError::UnsupportedCombination`] for e.g. `vm` + `docker`.
    pub fn new(class: Class, driver: DriverKind) -> Result<Placement, PlacementError> {
        let placement = Placement { class, driver };
        if placement.is_supported() { Ok(placement) } else { Err(PlacementError::UnsupportedCombination { class, driver }) }
    }

    pub fn is_supported(self) -> bool {
        self.driver.class() == self.class
    }

    /// The legacy runs-on labels that select this placement (besides `self-hosted`).
    pub fn legacy_aliases(self) -> &'static [&'static str] {
        match (self.class, self.driver) {
            (Class::Container, DriverKind::Kubernetes) => &[LEGACY_POD],
            (Class::Vm, DriverKind::Opensandbox) => &["vm", LEGACY_VM_DEV],
            _ => &[],
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.class, self.driver)
    }
}

impl FromStr for Placement {
    type Err = PlacementError;

    fn from_str(s: &str) -> Result<Placement, PlacementError> {
        Placement::ALL.into_iter().find(|p| p.to_string() == s).ok_or_else(|| PlacementError::UnknownPlacement { input: s.to_owned() })
    }
}

impl From<Placement> for String {
    fn from(placement: Placement) -> String {
        placement.to_string()
    }
}

impl TryFrom<String> for Placement {
    type Error = PlacementError;

    fn try_from(s: String) -> Result<Placement, PlacementError> {
        s.parse()
    }
}

/// Why a task cannot be placed. The text is written for the workflow's author: it is
/// the log line of the failed task in Gitea.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("runs-on label(s) {} are not known to this runner: the known labels are {} (case-sensitive); fix the spelling in runs-on", list(.labels), list(.known))]
    UnknownLabels { labels: Vec<String>, known: Vec<String> },

    #[error("runs-on label `{label}` has the wrong case: labels are case-sensitive, write `{expected}`")]
    WrongCase { label: String, expected: String },

    #[error("runs-on {} lacks `{required}`: add `{required}` to the job's runs-on", list(.labels))]
    MissingRequired { required: String, labels: Vec<String> },

    #[error("legacy runs-on label `{legacy}` cannot be combined with {}: write either `[{required}, {legacy}]` or the canonical `{}`", list(.with), canonical_runs_on(.required, .legacy))]
    LegacyMixed { required: String, legacy: &'static str, with: Vec<String> },

    #[error("runs-on mixes the legacy labels `pod` and `vm-dev`, which name different placements: keep one of them")]
    ConflictingLegacy,

    #[error("runs-on names no workload class: add `container` or `vm` (e.g. `[{required}, container, docker]`)")]
    NoClass { required: String },

    #[error("runs-on names both `container` and `vm`: keep exactly one workload class")]
    MultipleClasses,

    #[error("runs-on names driver `{driver}` without a workload class: add `{}` (`[{required}, {}, {driver}]`)", .driver.class(), .driver.class())]
    DriverWithoutClass { required: String, driver: DriverKind },

    #[error("runs-on names several drivers {}: keep exactly one (an explicit driver never falls back to another)", list(.drivers))]
    MultipleDrivers { drivers: Vec<DriverKind> },

    #[error("`{class}` with driver `{driver}` is not a supported placement: use one of {}", list(&Placement::ALL))]
    UnsupportedCombination { class: Class, driver: DriverKind },

    #[error("`{input}` is not a placement: use one of {}", list(&Placement::ALL))]
    UnknownPlacement { input: String },

    #[error("the task's workflow payload is not a readable workflow ({reason}); Gitea should only send valid YAML, so check the Gitea version")]
    InvalidWorkflow { reason: String },

    #[error("the task's workflow has {count} jobs under `jobs:` but a task must carry exactly one; this payload did not come from a compatible Gitea")]
    JobCount { count: usize },

    #[error("the task's job key is not a string ({found}); job keys must be names like `build`")]
    InvalidJobKey { found: String },

    #[error("job `{job}` has no runs-on: add e.g. `runs-on: [disposable, container, docker]` to the job")]
    MissingRunsOn { job: String },

    #[error("job `{job}` has an invalid runs-on ({reason}): write a label, a list of labels, or a map with `labels`")]
    InvalidRunsOn { job: String, reason: String },
}

fn list<T: fmt::Display>(items: &[T]) -> String {
    let items: Vec<String> = items.iter().map(ToString::to_string).collect();
    format!("[{}]", items.join(", "))
}

fn canonical_runs_on(required: &str, legacy: &str) -> String {
    let placement = if legacy == LEGACY_POD { Placement::CONTAINER_KUBERNETES } else { Placement::VM_OPENSANDBOX };
    format!("[{required}, {}, {}]", placement.class, placement.driver)
}

/// Derives the placement from a job's `runs-on` labels under the strict rules in the
/// module documentation.
///
/// # Errors
/// A [`PlacementError`] that says which rule was broken and how to fix runs-on.
pub fn from_labels(runs_on: &[String], policy: &LabelPolicy) -> Result<Placement, PlacementError> {
    // Deduplicated, in order of first appearance (for error messages).
    let mut labels: Vec<&str> = Vec::new();
    for label in runs_on {
        if !labels.contains(&label.as_str()) {
            labels.push(label);
        }
    }

    if !labels.is_empty() && labels.iter().all(|label| policy.host_platforms.iter().any(|platform| platform == label)) {
        return Ok(Placement::CONTAINER_DOCKER);
    }
    let known = policy.known();
    let required = policy.required.as_str();
    let unknown: Vec<&str> = labels.iter().copied().filter(|l| !known.contains(l)).collect();
    for label in &unknown {
        if let Some(expected) = known.iter().find(|k| k.eq_ignore_ascii_case(label)) {
            return Err(PlacementError::WrongCase { label: (*label).to_owned(), expected: (*expected).to_owned() });
        }
    }
    if !unknown.is_empty() {
        return Err(PlacementError::UnknownLabels {
            labels: unknown.into_iter().map(str::to_owned).collect(),
            known: known.iter().map(|l| (*l).to_owned()).collect(),
        });
    }
    if !labels.contains(&required) {
        return Err(PlacementError::MissingRequired { required: required.to_owned(), labels: labels.into_iter().map(str::to_owned).collect() });
    }

    let classes: Vec<Class> = labels.iter().filter_map(|l| Class::from_label(l)).collect();
    let drivers: Vec<DriverKind> = labels.iter().filter_map(|l| DriverKind::from_label(l)).collect();
    let legacy: Vec<&'static str> = [LEGACY_POD, LEGACY_VM_DEV].into_iter().filter(|l| labels.contains(l)).collect();

    match legacy.as_slice() {
        [] => {}
        [legacy] => {
            let with: Vec<String> =
                labels.iter().filter(|l| Class::from_label(l).is_some() || DriverKind::from_label(l).is_some()).map(|l| (*l).to_owned()).collect();
            if !with.is_empty() {
                return Err(PlacementError::LegacyMixed { required: required.to_owned(), legacy, with });
            }
            return Ok(if *legacy == LEGACY_POD { Placement::CONTAINER_KUBERNETES } else { Placement::VM_OPENSANDBOX });
        }
        _ => return Err(PlacementError::ConflictingLegacy),
    }

    if classes.len() > 1 {
        return Err(PlacementError::MultipleClasses);
    }
    if drivers.len() > 1 {
        return Err(PlacementError::MultipleDrivers { drivers });
    }
    match (classes.first(), drivers.first()) {
        (None, None) => Err(PlacementError::NoClass { required: required.to_owned() }),
        (None, Some(&driver)) => Err(PlacementError::DriverWithoutClass { required: required.to_owned(), driver }),
        (Some(&class), None) => Ok(Placement { class, driver: class.default_driver() }),
        (Some(&class), Some(&driver)) => Placement::new(class, driver),
    }
}

/// Reads the job key and its `runs-on` labels from a task's workflow payload, which
/// must hold exactly one job under `jobs:`.
///
/// `runs-on` may be a string, a list of strings, or a map with `labels` (a string or a
/// list) and optionally `group`. Runner groups are a GitHub feature Gitea does not have,
/// so `group` is accepted and ignored; any other key in the map is an error. YAML merge
/// keys (`<<`) are applied first. Job keys must be strings.
///
/// # Errors
/// [`PlacementError::InvalidWorkflow`], [`PlacementError::JobCount`],
/// [`PlacementError::InvalidJobKey`], [`PlacementError::MissingRunsOn`] or
/// [`PlacementError::InvalidRunsOn`].
pub fn runs_on(workflow_payload: &[u8]) -> Result<(String, Vec<String>), PlacementError> {
    let invalid = |reason: String| PlacementError::InvalidWorkflow { reason };
    let mut workflow: Value = serde_yaml_ng::from_slice(workflow_payload).map_err(|e| invalid(e.to_string()))?;
    workflow.apply_merge().map_err(|e| invalid(e.to_string()))?;
    let Value::Mapping(workflow) = workflow else {
        return Err(invalid("the document is not a mapping".to_owned()));
    };
    let jobs = match workflow.get("jobs") {
        Some(Value::Mapping(jobs)) => jobs,
        Some(Value::Null) | None => return Err(PlacementError::JobCount { count: 0 }),
        Some(_) => return Err(invalid("`jobs` is not a mapping".to_owned())),
    };
    let mut entries = jobs.iter();
    let (key, job) = match (entries.next(), entries.next()) {
        (Some(entry), None) => entry,
        _ => return Err(PlacementError::JobCount { count: jobs.len() }),
    };
    let Value::String(key) = key else {
        return Err(PlacementError::InvalidJobKey { found: describe(key) });
    };
    let job_key = key.clone();
    let runs_on = match job {
        Value::Mapping(job) => job.get("runs-on"),
        Value::Null => None,
        _ => return Err(invalid(format!("job `{job_key}` is not a mapping"))),
    };
    let bad = |reason: String| PlacementError::InvalidRunsOn { job: job_key.clone(), reason };
    let labels = match runs_on {
        None | Some(Value::Null) => return Err(PlacementError::MissingRunsOn { job: job_key }),
        Some(Value::Mapping(map)) => {
            for key in map.keys() {
                if key.as_str() != Some("labels") && key.as_str() != Some("group") {
                    return Err(bad(format!("unexpected key {} in the runs-on map; only `labels` and `group` are allowed", describe(key))));
                }
            }
            match map.get("labels") {
                None | Some(Value::Null) => {
                    return Err(bad("the runs-on map has no `labels`; runner groups alone cannot place a job".to_owned()));
                }
                Some(labels) => label_list(labels).map_err(bad)?,
            }
        }
        Some(labels) => label_list(labels).map_err(bad)?,
    };
    if labels.is_empty() {
        return Err(PlacementError::MissingRunsOn { job: job_key });
    }
    Ok((job_key, labels))
}

fn label_list(value: &Value) -> Result<Vec<String>, String> {
    match value {
        Value::String(label) => Ok(vec![label.clone()]),
        Value::Sequence(items) => items
            .iter()
            .map(|item| match item {
                Value::String(label) => Ok(label.clone()),
                other => Err(format!("label {} is not a string", describe(other))),
            })
            .collect(),
        other => Err(format!("{} is neither a label nor a list of labels", describe(other))),
    }
}

/// A short description of a YAML value for error messages (never the whole value).
fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".to_owned(),
        Value::Bool(b) => format!("boolean {b}"),
        Value::Number(n) => format!("number {n}"),
        Value::String(s) => format!("{:?}", s.chars().take(64).collect::<String>()),
        Value::Sequence(_) => "a list".to_owned(),
        Value::Mapping(_) => "a map".to_owned(),
        Value::Tagged(t) => format!("a value tagged {}", t.tag),
    }
}

/// The label names one placement's registration Declares to Gitea: the required
/// label, the placement's class and driver, and (with legacy labels on) its legacy
/// aliases. Sorted and deduplicated.
///
/// Gitea hands a job to a runner whose labels ⊇ the job's runs-on. Superset matching
/// cannot express "`container` alone means kubernetes", so the container.docker
/// registration may still be handed `[<required>, container]` (→ container.kubernetes);
/// the scheduler places such a task by its own labels, or fails it with a clear message
/// when that placement is not enabled here.
pub fn declared_labels(placement: Placement, policy: &LabelPolicy) -> Vec<String> {
    let mut labels = BTreeSet::from([policy.required.as_str()]);
    if placement.is_supported() {
        labels.insert(placement.class.label());
        labels.insert(placement.driver.label());
        if policy.legacy {
            labels.extend(placement.legacy_aliases());
        }
    }
    labels.into_iter().map(str::to_owned).collect()
}

/// The labels an environment's own (unmodified) runner gets: exactly the job's
/// runs-on, deduplicated in order. The runner runs a job on the host only when one of
/// its labels matches runs-on; anything else would send it to a default container image
/// an environment does not have.
pub fn runner_labels(runs_on: &[String]) -> Vec<String> {
    let mut labels: Vec<String> = Vec::new();
    for label in runs_on {
        if !labels.contains(label) {
            labels.push(label.clone());
        }
    }
    labels
}

#[cfg(test)]
mod tests {
    use super::*;

    use PlacementError as E;

    const CK: Placement = Placement::CONTAINER_KUBERNETES;
    const VO: Placement = Placement::VM_OPENSANDBOX;
    const CD: Placement = Placement::CONTAINER_DOCKER;

    fn s(labels: &[&str]) -> Vec<String> {
        labels.iter().map(|l| (*l).to_owned()).collect()
    }

    fn seed() -> LabelPolicy {
        LabelPolicy::seed_compatible()
    }

    fn seed_known() -> Vec<String> {
        seed().known().into_iter().map(str::to_owned).collect()
    }

    #[test]
    fn from_labels_table() {
        let rows: Vec<(&[&str], Result<Placement, PlacementError>)> = vec![
            // Canonical.
            (&["self-hosted", "container", "kubernetes"], Ok(CK)),
            (&["self-hosted", "container", "docker"], Ok(CD)),
            (&["self-hosted", "vm", "opensandbox"], Ok(VO)),
            (&["kubernetes", "container", "self-hosted"], Ok(CK)),
            (&["docker", "self-hosted", "container"], Ok(CD)),
            // Defaults.
            (&["self-hosted", "container"], Ok(CK)),
            (&["self-hosted", "vm"], Ok(VO)),
            // Legacy.
            (&["self-hosted", "pod"], Ok(CK)),
            (&["self-hosted", "vm-dev"], Ok(VO)),
            (&["pod", "self-hosted"], Ok(CK)),
            // Duplicates are harmless.
            (&["self-hosted", "self-hosted", "pod", "pod"], Ok(CK)),
            (&["self-hosted", "container", "docker", "docker", "container"], Ok(CD)),
            (&["self-hosted", "vm", "vm"], Ok(VO)),
            // self-hosted required.
            (&[], Err(E::MissingRequired { required: "self-hosted".into(), labels: vec![] })),
            (&["container", "docker"], Err(E::MissingRequired { required: "self-hosted".into(), labels: s(&["container", "docker"]) })),
            (&["pod"], Err(E::MissingRequired { required: "self-hosted".into(), labels: s(&["pod"]) })),
            (&["vm"], Err(E::MissingRequired { required: "self-hosted".into(), labels: s(&["vm"]) })),
            // Legacy mixed with class/driver labels.
            (&["self-hosted", "pod", "container"], Err(E::LegacyMixed { required: "self-hosted".into(), legacy: "pod", with: s(&["container"]) })),
            (&["self-hosted", "pod", "docker"], Err(E::LegacyMixed { required: "self-hosted".into(), legacy: "pod", with: s(&["docker"]) })),
            (&["self-hosted", "pod", "kubernetes"], Err(E::LegacyMixed { required: "self-hosted".into(), legacy: "pod", with: s(&["kubernetes"]) })),
            (&["self-hosted", "pod", "vm"], Err(E::LegacyMixed { required: "self-hosted".into(), legacy: "pod", with: s(&["vm"]) })),
            (&["self-hosted", "vm-dev", "opensandbox"], Err(E::LegacyMixed { required: "self-hosted".into(), legacy: "vm-dev", with: s(&["opensandbox"]) })),
            (&["self-hosted", "vm-dev", "vm"], Err(E::LegacyMixed { required: "self-hosted".into(), legacy: "vm-dev", with: s(&["vm"]) })),
            (
                &["self-hosted", "vm-dev", "container", "docker"],
                Err(E::LegacyMixed { required: "self-hosted".into(), legacy: "vm-dev", with: s(&["container", "docker"]) }),
            ),
            (&["self-hosted", "pod", "vm-dev"], Err(E::ConflictingLegacy)),
            // Classes.
            (&["self-hosted"], Err(E::NoClass { required: "self-hosted".into() })),
            (&["self-hosted", "container", "vm"], Err(E::MultipleClasses)),
            (&["self-hosted", "container", "vm", "docker"], Err(E::MultipleClasses)),
            // Drivers.
            (&["self-hosted", "docker"], Err(E::DriverWithoutClass { required: "self-hosted".into(), driver: DriverKind::Docker })),
            (&["self-hosted", "kubernetes"], Err(E::DriverWithoutClass { required: "self-hosted".into(), driver: DriverKind::Kubernetes })),
            (&["self-hosted", "opensandbox"], Err(E::DriverWithoutClass { required: "self-hosted".into(), driver: DriverKind::Opensandbox })),
            (&["self-hosted", "container", "kubernetes", "docker"], Err(E::MultipleDrivers { drivers: vec![DriverKind::Kubernetes, DriverKind::Docker] })),
            (&["self-hosted", "vm", "opensandbox", "docker"], Err(E::MultipleDrivers { drivers: vec![DriverKind::Opensandbox, DriverKind::Docker] })),
            (&["self-hosted", "docker", "kubernetes"], Err(E::MultipleDrivers { drivers: vec![DriverKind::Docker, DriverKind::Kubernetes] })),
            // Unsupported combinations: an explicit driver never falls back.
            (&["self-hosted", "vm", "docker"], Err(E::UnsupportedCombination { class: Class::Vm, driver: DriverKind::Docker })),
            (&["self-hosted", "vm", "kubernetes"], Err(E::UnsupportedCombination { class: Class::Vm, driver: DriverKind::Kubernetes })),
            (&["self-hosted", "container", "opensandbox"], Err(E::UnsupportedCombination { class: Class::Container, driver: DriverKind::Opensandbox })),
            // Unknown labels and case.
            (&["self-hosted", "container", "dokcer"], Err(E::UnknownLabels { labels: s(&["dokcer"]), known: seed_known() })),
            (&["self-hosted", "ubuntu-latest"], Err(E::UnknownLabels { labels: s(&["ubuntu-latest"]), known: seed_known() })),
            (&["ubuntu-latest", "x", "x"], Err(E::UnknownLabels { labels: s(&["ubuntu-latest", "x"]), known: seed_known() })),
            (&["self-hosted", ""], Err(E::UnknownLabels { labels: s(&[""]), known: seed_known() })),
            (&["self-hosted", " container"], Err(E::UnknownLabels { labels: s(&[" container"]), known: seed_known() })),
            (&["self-hosted", "container.docker"], Err(E::UnknownLabels { labels: s(&["container.docker"]), known: seed_known() })),
            (&["Self-Hosted", "container"], Err(E::WrongCase { label: "Self-Hosted".into(), expected: "self-hosted".into() })),
            (&["self-hosted", "Container"], Err(E::WrongCase { label: "Container".into(), expected: "container".into() })),
            (&["self-hosted", "POD"], Err(E::WrongCase { label: "POD".into(), expected: "pod".into() })),
            (&["self-hosted", "container", "Docker"], Err(E::WrongCase { label: "Docker".into(), expected: "docker".into() })),
        ];
        assert!(rows.len() >= 30);
        for (labels, want) in rows {
            assert_eq!(from_labels(&s(labels), &seed()), want, "runs-on {labels:?}");
        }
    }

    #[test]
    fn placement_names_round_trip() {
        let rows = [
            ("container.kubernetes", Some(CK)),
            ("vm.opensandbox", Some(VO)),
            ("container.docker", Some(CD)),
            ("vm.docker", None),
            ("vm.kubernetes", None),
            ("container.opensandbox", None),
            ("Container.Docker", None),
            ("container", None),
            ("", None),
            ("container.docker ", None),
        ];
        for (name, want) in rows {
            let parsed = name.parse::<Placement>();
            assert_eq!(parsed.clone().ok(), want, "{name}");
            if let Some(p) = want {
                assert_eq!(p.to_string(), name);
                assert_eq!(serde_json::to_string(&p).unwrap(), format!("\"{name}\""));
                assert_eq!(serde_json::from_str::<Placement>(&format!("\"{name}\"")).unwrap(), p);
            } else {
                assert_eq!(parsed, Err(E::UnknownPlacement { input: name.to_owned() }));
                assert!(serde_json::from_str::<Placement>(&format!("\"{name}\"")).is_err());
            }
        }
        assert!(Placement::new(Class::Vm, DriverKind::Docker).is_err());
        assert!(!Placement { class: Class::Vm, driver: DriverKind::Docker }.is_supported());
        assert!(Placement::ALL.iter().all(|p| p.is_supported()));
    }

    #[test]
    fn canonical_form_of_every_placement_maps_back() {
        for p in Placement::ALL {
            assert_eq!(from_labels(&s(&["self-hosted", p.class.label(), p.driver.label()]), &seed()), Ok(p));
            assert_eq!(from_labels(&s(&["disposable", p.class.label(), p.driver.label()]), &LabelPolicy::default()), Ok(p));
            for alias in p.legacy_aliases() {
                assert_eq!(from_labels(&s(&["self-hosted", alias]), &seed()), Ok(p));
            }
        }
    }

    #[test]
    fn error_messages_say_what_to_do() {
        let rows: Vec<(PlacementError, &str)> = vec![
            (
                E::UnknownLabels { labels: s(&["dokcer"]), known: seed_known() },
                "known labels are [self-hosted, container, vm, kubernetes, opensandbox, docker, pod, vm-dev]",
            ),
            (E::WrongCase { label: "Pod".into(), expected: "pod".into() }, "write `pod`"),
            (E::MissingRequired { required: "self-hosted".into(), labels: s(&["pod"]) }, "add `self-hosted`"),
            (
                E::LegacyMixed { required: "self-hosted".into(), legacy: "pod", with: s(&["docker"]) },
                "`[self-hosted, pod]` or the canonical `[self-hosted, container, kubernetes]`",
            ),
            (E::LegacyMixed { required: "self-hosted".into(), legacy: "vm-dev", with: s(&["vm"]) }, "`[self-hosted, vm, opensandbox]`"),
            (E::NoClass { required: "self-hosted".into() }, "add `container` or `vm`"),
            (E::DriverWithoutClass { required: "self-hosted".into(), driver: DriverKind::Docker }, "add `container` (`[self-hosted, container, docker]`)"),
            (E::DriverWithoutClass { required: "self-hosted".into(), driver: DriverKind::Opensandbox }, "add `vm`"),
            (E::UnsupportedCombination { class: Class::Vm, driver: DriverKind::Docker }, "use one of [container.kubernetes, vm.opensandbox, container.docker]"),
            (E::MultipleDrivers { drivers: vec![DriverKind::Docker, DriverKind::Kubernetes] }, "[docker, kubernetes]: keep exactly one"),
        ];
        for (error, needle) in rows {
            let text = error.to_string();
            assert!(text.contains(needle), "{text:?} lacks {needle:?}");
        }
    }

    #[test]
    fn runs_on_table() {
        type Want = Result<(String, Vec<String>), PlacementError>;
        let ok = |job: &str, labels: &[&str]| -> Want { Ok((job.to_owned(), s(labels))) };
        let rows: Vec<(&str, Want)> = vec![
            ("jobs:\n  build:\n    runs-on: self-hosted\n", ok("build", &["self-hosted"])),
            ("jobs:\n  build:\n    runs-on: [self-hosted, container, docker]\n", ok("build", &["self-hosted", "container", "docker"])),
            ("jobs:\n  b:\n    runs-on:\n      - self-hosted\n      - pod\n", ok("b", &["self-hosted", "pod"])),
            ("jobs:\n  b:\n    runs-on:\n      labels: [self-hosted, vm]\n", ok("b", &["self-hosted", "vm"])),
            ("jobs:\n  b:\n    runs-on:\n      labels: self-hosted\n      group: big\n", ok("b", &["self-hosted"])),
            (
                "name: ci\non: push\njobs:\n  'my job/1':\n    name: x\n    runs-on: [self-hosted, vm-dev]\n    steps: [{run: echo}]\n",
                ok("my job/1", &["self-hosted", "vm-dev"]),
            ),
            ("{\"jobs\": {\"j\": {\"runs-on\": [\"self-hosted\", \"container\"]}}}", ok("j", &["self-hosted", "container"])),
            ("x: &l [self-hosted, container]\njobs:\n  j:\n    runs-on: *l\n", ok("j", &["self-hosted", "container"])),
            ("base: &b {runs-on: [self-hosted, pod]}\njobs:\n  j:\n    <<: *b\n", ok("j", &["self-hosted", "pod"])),
            ("jobs:\n  日本:\n    runs-on: [self-hosted, container]\n", ok("日本", &["self-hosted", "container"])),
            // Job count.
            ("jobs: {}\n", Err(E::JobCount { count: 0 })),
            ("jobs:\n", Err(E::JobCount { count: 0 })),
            ("name: x\n", Err(E::JobCount { count: 0 })),
            ("jobs:\n  a: {runs-on: self-hosted}\n  b: {runs-on: self-hosted}\n", Err(E::JobCount { count: 2 })),
            // Job key.
            ("jobs:\n  1: {runs-on: self-hosted}\n", Err(E::InvalidJobKey { found: "number 1".into() })),
            ("jobs:\n  true: {runs-on: self-hosted}\n", Err(E::InvalidJobKey { found: "boolean true".into() })),
            // Missing runs-on.
            ("jobs:\n  j: {steps: []}\n", Err(E::MissingRunsOn { job: "j".into() })),
            ("jobs:\n  j:\n", Err(E::MissingRunsOn { job: "j".into() })),
            ("jobs:\n  j: {runs-on: null}\n", Err(E::MissingRunsOn { job: "j".into() })),
            ("jobs:\n  j: {runs-on: []}\n", Err(E::MissingRunsOn { job: "j".into() })),
            ("jobs:\n  j: {runs-on: {labels: []}}\n", Err(E::MissingRunsOn { job: "j".into() })),
        ];
        for (yaml, want) in rows {
            assert_eq!(runs_on(yaml.as_bytes()), want, "{yaml}");
        }
    }

    #[test]
    fn runs_on_invalid_forms() {
        let invalid_runs_on = [
            "jobs:\n  j: {runs-on: 5}\n",
            "jobs:\n  j: {runs-on: [self-hosted, 5]}\n",
            "jobs:\n  j: {runs-on: [self-hosted, [container]]}\n",
            "jobs:\n  j: {runs-on: {group: big}}\n",
            "jobs:\n  j: {runs-on: {label: [self-hosted]}}\n",
            "jobs:\n  j: {runs-on: {labels: [self-hosted], extra: 1}}\n",
            "jobs:\n  j: {runs-on: {labels: {a: b}}}\n",
            "jobs:\n  j: {runs-on: !tag self-hosted}\n",
            "jobs:\n  j: {runs-on: true}\n",
        ];
        for yaml in invalid_runs_on {
            assert!(matches!(runs_on(yaml.as_bytes()), Err(E::InvalidRunsOn { ref job, .. }) if job == "j"), "{yaml}: {:?}", runs_on(yaml.as_bytes()));
        }
        let invalid_workflow: [&[u8]; 9] = [
            b"",
            b"- a\n- b\n",
            b"just a string",
            b"jobs: [a, b]\n",
            b"jobs:\n  j: [runs-on]\n",
            b"jobs: {j: {runs-on: self-hosted}}\n---\njobs: {}\n",
            b"\xff\xfe\x00garbage",
            b"jobs: {j: {runs-on: *missing}}\n",
            b"jobs: {j: {runs-on: [unterminated\n",
        ];
        for yaml in invalid_workflow {
            assert!(matches!(runs_on(yaml), Err(E::InvalidWorkflow { .. })), "{:?}: {:?}", String::from_utf8_lossy(yaml), runs_on(yaml));
        }
        // Deep nesting and alias bombs are refused, never a panic or a hang.
        let deep = format!("jobs: {{j: {{runs-on: {}x{}}}}}\n", "[".repeat(10_000), "]".repeat(10_000));
        assert!(runs_on(deep.as_bytes()).is_err());
        let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..12 {
            bomb.push_str(&format!(
                "{}: &{} [*{}, *{}, *{}, *{}, *{}, *{}, *{}, *{}, *{}, *{}]\n",
                c(i),
                c(i),
                c(i - 1),
                c(i - 1),
                c(i - 1),
                c(i - 1),
                c(i - 1),
                c(i - 1),
                c(i - 1),
                c(i - 1),
                c(i - 1),
                c(i - 1)
            ));
        }
        bomb.push_str("jobs: {j: {runs-on: self-hosted}}\n");
        assert!(runs_on(bomb.as_bytes()).is_err());
    }

    fn c(i: usize) -> String {
        format!("n{i}")
    }

    #[test]
    fn declared_labels_table() {
        let safe = LabelPolicy::default();
        let rows: Vec<(Placement, &LabelPolicy, &[&str])> = vec![
            (CK, &safe, &["container", "disposable", "kubernetes"]),
            (VO, &safe, &["disposable", "opensandbox", "vm"]),
            (CD, &safe, &["container", "disposable", "docker"]),
            (Placement { class: Class::Vm, driver: DriverKind::Docker }, &safe, &["disposable"]),
        ];
        let seed = seed();
        let seed_rows: Vec<(Placement, &LabelPolicy, &[&str])> = vec![
            (CK, &seed, &["container", "kubernetes", "pod", "self-hosted"]),
            (VO, &seed, &["opensandbox", "self-hosted", "vm", "vm-dev"]),
            (CD, &seed, &["container", "docker", "self-hosted"]),
        ];
        for (placement, policy, want) in rows.into_iter().chain(seed_rows) {
            assert_eq!(declared_labels(placement, policy), s(want), "{placement} {policy:?}");
        }
    }

    #[test]
    fn runner_labels_are_the_jobs_runs_on() {
        assert_eq!(runner_labels(&s(&["disposable", "container", "docker", "container"])), s(&["disposable", "container", "docker"]));
        assert_eq!(runner_labels(&s(&["self-hosted", "pod"])), s(&["self-hosted", "pod"]));
    }

    #[test]
    fn the_default_policy_ignores_self_hosted_and_legacy_labels() {
        let safe = LabelPolicy::default();
        assert_eq!(from_labels(&s(&["disposable", "container", "docker"]), &safe), Ok(CD));
        assert_eq!(from_labels(&s(&["disposable", "vm"]), &safe), Ok(VO));
        assert!(matches!(from_labels(&s(&["self-hosted", "container", "docker"]), &safe), Err(E::UnknownLabels { .. })));
        assert!(matches!(from_labels(&s(&["disposable", "pod"]), &safe), Err(E::UnknownLabels { .. })));
        let error = from_labels(&s(&["container", "docker"]), &safe).unwrap_err().to_string();
        assert!(error.contains("add `disposable`"), "{error}");
        let custom = LabelPolicy { required: "ci-gdr".into(), legacy: false, host_platforms: Vec::new() };
        assert_eq!(from_labels(&s(&["ci-gdr", "container", "kubernetes"]), &custom), Ok(CK));
        for bad in ["", "docker", "pod", "has space", "a:b"] {
            assert!(LabelPolicy { required: bad.into(), legacy: false, host_platforms: Vec::new() }.validate().is_err(), "{bad:?}");
        }
        assert!(safe.validate().is_ok() && seed().validate().is_ok());
    }

    /// run-local's act-like platforms: runs-on made only of them is this host (a docker
    /// container); mixed with anything else, the usual rules apply.
    #[test]
    fn host_platform_labels_run_in_a_docker_container() {
        let local = LabelPolicy { host_platforms: s(&["ubuntu-latest", "ubuntu-22.04"]), ..LabelPolicy::default() };
        assert_eq!(from_labels(&s(&["ubuntu-latest"]), &local), Ok(CD));
        assert_eq!(from_labels(&s(&["ubuntu-22.04", "ubuntu-latest"]), &local), Ok(CD));
        assert_eq!(from_labels(&s(&["disposable", "vm"]), &local), Ok(VO));
        assert!(matches!(from_labels(&s(&["ubuntu-latest", "gpu"]), &local), Err(E::UnknownLabels { .. })));
        assert!(matches!(from_labels(&s(&["ubuntu-latest"]), &LabelPolicy::default()), Err(E::UnknownLabels { .. })), "a registered runner has none");
    }

    /// Every runs-on that Gitea would hand to one placement's registration (every subset
    /// of its declared labels) derives that placement or is refused — except the
    /// documented limit of superset matching: the container.docker registration may be
    /// handed `[R, container]`, which derives container.kubernetes.
    #[test]
    fn declared_labels_and_superset_matching() {
        for policy in [LabelPolicy::default(), seed()] {
            for p in Placement::ALL {
                let declared = declared_labels(p, &policy);
                for mask in 0u32..(1 << declared.len()) {
                    let subset: Vec<String> = declared.iter().enumerate().filter(|(i, _)| mask & (1 << i) != 0).map(|(_, l)| l.clone()).collect();
                    let mut expected_exception = s(&["container", policy.required.as_str()]);
                    expected_exception.sort();
                    match from_labels(&subset, &policy) {
                        Ok(got) if got == p => {}
                        Ok(got) => assert_eq!((p, got, subset), (CD, CK, expected_exception)),
                        Err(_) => {}
                    }
                }
            }
        }
    }
}
