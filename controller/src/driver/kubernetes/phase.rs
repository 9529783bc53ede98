//! What a Pod's status means for its job: running, ended (and why, in the kubelet's
//! words), or unable to start.

use std::time::Duration;

use k8s_openapi::api::core::v1::{ContainerState, ContainerStatus, Pod};

use super::CONTAINER;
use crate::driver::{Environment, LABEL_ASSIGNMENT, Phase};

/// Waiting reasons after which a container will not start without someone changing
/// something (the image, the Pod's configuration): the task fails with the kubelet's
/// message instead of waiting for the job's deadline.
const CANNOT_START: [&str; 7] =
    ["ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName", "CreateContainerConfigError", "CreateContainerError", "RunContainerError"];

/// Waiting reasons a registry causes for a while (a rate limit, a registry restarting):
/// the kubelet retries the pull with a back-off, so the Pod counts as starting until it
/// is older than [`PULL_PATIENCE`].
const PULLING: [&str; 2] = ["ErrImagePull", "ImagePullBackOff"];
/// How long a Pod may wait for its image before its task is failed.
pub const PULL_PATIENCE: Duration = Duration::from_secs(5 * 60);

/// The environment a Pod is, with the kubelet's reason once it ended or cannot start.
pub fn environment_of(pod: &Pod) -> Environment {
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    let (phase, detail) = phase_of(pod);
    Environment {
        name: pod.metadata.name.clone().unwrap_or_default(),
        assignment_id: labels.get(LABEL_ASSIGNMENT).cloned().unwrap_or_default(),
        labels,
        phase,
        detail,
        exit_code: job_container(pod).and_then(|c| c.state?.terminated).map(|t| i64::from(t.exit_code)),
    }
}

fn job_container(pod: &Pod) -> Option<ContainerStatus> {
    pod.status.as_ref()?.container_statuses.as_deref()?.iter().find(|c| c.name == CONTAINER).cloned()
}

fn phase_of(pod: &Pod) -> (Phase, String) {
    let (phase, mut detail) = phase_without_deletion(pod);
    // A Pod being deleted still runs its job until the supervisor has drained: the runner
    // reports its own end through the facade meanwhile. Failing the task at the same
    // moment would race that report (two final log uploads at once crash Gitea 1.23's
    // log transfer), so the Pod counts as running until its container has ended.
    if phase == Phase::Exited && pod.metadata.deletion_timestamp.is_some() {
        detail.push_str(DELETED);
    }
    (phase, detail)
}

/// What the end of a Pod that was deleted by someone adds to its reason.
pub(super) const DELETED: &str = " after the Pod was deleted (through the Kubernetes API, or its node is drained)";

fn phase_without_deletion(pod: &Pod) -> (Phase, String) {
    let status = pod.status.clone().unwrap_or_default();
    let container = job_container(pod);
    let pod_reason = || {
        let mut detail = String::new();
        if let Some(reason) = status.reason.as_deref().filter(|r| !r.is_empty()) {
            detail.push_str(reason);
        }
        if let Some(message) = status.message.as_deref().filter(|m| !m.is_empty()) {
            if !detail.is_empty() {
                detail.push_str(": ");
            }
            detail.push_str(message);
        }
        detail
    };
    match status.phase.as_deref() {
        Some("Succeeded" | "Failed") => {
            let mut parts = Vec::new();
            let reason = pod_reason();
            if !reason.is_empty() {
                parts.push(format!("the Pod {}", reason));
            }
            if let Some(terminated) = container.as_ref().and_then(terminated_detail) {
                parts.push(terminated);
            }
            if parts.is_empty() {
                parts.push(format!("the Pod {}", status.phase.as_deref().unwrap_or_default().to_ascii_lowercase()));
            }
            (Phase::Exited, parts.join("; "))
        }
        _ => {
            if let Some(waiting) = container.as_ref().and_then(|c| cannot_start(c, age_of(pod))) {
                return (Phase::Exited, waiting);
            }
            if let Some(terminated) = container.as_ref().and_then(terminated_detail) {
                return (Phase::Exited, terminated);
            }
            (Phase::Running, String::new())
        }
    }
}

/// How long ago the Pod was created (zero if it does not say).
fn age_of(pod: &Pod) -> Duration {
    let Some(created) = pod.metadata.creation_timestamp.as_ref() else { return Duration::ZERO };
    let now = k8s_openapi::jiff::Timestamp::now();
    Duration::try_from(now.duration_since(created.0)).unwrap_or(Duration::ZERO)
}

/// "the job container exited with code 137 (OOMKilled)".
fn terminated_detail(container: &ContainerStatus) -> Option<String> {
    let terminated = container.state.as_ref().and_then(|s: &ContainerState| s.terminated.clone())?;
    let mut detail = format!("the job container exited with code {}", terminated.exit_code);
    if let Some(reason) = terminated.reason.as_deref().filter(|r| !r.is_empty() && *r != "Completed" && *r != "Error") {
        let reason = if reason == "OOMKilled" { "OOMKilled: it used more memory than its limit" } else { reason };
        detail.push_str(&format!(" ({reason})"));
    }
    if let Some(message) = terminated.message.as_deref().filter(|m| !m.is_empty()) {
        detail.push_str(": ");
        detail.push_str(message.trim());
    }
    Some(detail)
}

/// "the job container cannot start: ErrImageNeverPull: Container image … is not present".
fn cannot_start(container: &ContainerStatus, age: Duration) -> Option<String> {
    let waiting = container.state.as_ref().and_then(|s| s.waiting.clone())?;
    let reason = waiting.reason.filter(|r| CANNOT_START.contains(&r.as_str()))?;
    if PULLING.contains(&reason.as_str()) && age < PULL_PATIENCE {
        return None;
    }
    let message = waiting.message.unwrap_or_default();
    Some(if message.is_empty() { format!("the job container cannot start: {reason}") } else { format!("the job container cannot start: {reason}: {message}") })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{ContainerStateTerminated, ContainerStateWaiting, PodStatus};
    use kube::api::ObjectMeta;

    use super::*;

    fn pod(phase: &str, reason: Option<&str>, state: Option<ContainerState>) -> Pod {
        Pod {
            metadata: ObjectMeta { name: Some("gdr-x-gitea-task-1".into()), ..Default::default() },
            spec: None,
            status: Some(PodStatus {
                phase: Some(phase.into()),
                reason: reason.map(str::to_owned),
                message: reason.map(|r| format!("message for {r}")),
                container_statuses: state.map(|state| vec![ContainerStatus { name: CONTAINER.into(), state: Some(state), ..Default::default() }]),
                ..Default::default()
            }),
        }
    }

    fn created_ago(mut pod: Pod, seconds: i64) -> Pod {
        let created = k8s_openapi::jiff::Timestamp::now().checked_sub(k8s_openapi::jiff::SignedDuration::from_secs(seconds)).unwrap();
        pod.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(created));
        pod
    }

    fn terminated(code: i32, reason: &str) -> ContainerState {
        ContainerState {
            terminated: Some(ContainerStateTerminated { exit_code: code, reason: Some(reason.into()), ..Default::default() }),
            ..Default::default()
        }
    }

    fn waiting(reason: &str) -> ContainerState {
        ContainerState {
            waiting: Some(ContainerStateWaiting { reason: Some(reason.into()), message: Some(format!("kubelet says {reason}")) }),
            ..Default::default()
        }
    }

    #[test]
    fn pod_states_map_to_phases_with_the_kubelets_reason() {
        let cases: Vec<(Pod, Phase, &str)> = vec![
            (pod("Pending", None, None), Phase::Running, ""),
            (pod("Pending", None, Some(waiting("ContainerCreating"))), Phase::Running, ""),
            (pod("Running", None, None), Phase::Running, ""),
            (
                pod("Pending", None, Some(waiting("ErrImageNeverPull"))),
                Phase::Exited,
                "the job container cannot start: ErrImageNeverPull: kubelet says ErrImageNeverPull",
            ),
            // A registry that refuses for a while: the kubelet retries the pull.
            (pod("Pending", None, Some(waiting("ImagePullBackOff"))), Phase::Running, ""),
            (pod("Pending", None, Some(waiting("ErrImagePull"))), Phase::Running, ""),
            (created_ago(pod("Pending", None, Some(waiting("ImagePullBackOff"))), 60), Phase::Running, ""),
            (created_ago(pod("Pending", None, Some(waiting("ImagePullBackOff"))), 6 * 60), Phase::Exited, "cannot start: ImagePullBackOff"),
            (created_ago(pod("Pending", None, Some(waiting("ErrImageNeverPull"))), 1), Phase::Exited, "cannot start: ErrImageNeverPull"),
            (pod("Failed", None, Some(terminated(137, "OOMKilled"))), Phase::Exited, "exited with code 137 (OOMKilled: it used more memory"),
            (pod("Failed", Some("Evicted"), None), Phase::Exited, "the Pod Evicted: message for Evicted"),
            (pod("Failed", Some("DeadlineExceeded"), None), Phase::Exited, "the Pod DeadlineExceeded"),
            (pod("Failed", None, Some(terminated(3, "Error"))), Phase::Exited, "the job container exited with code 3"),
            (pod("Succeeded", None, Some(terminated(0, "Completed"))), Phase::Exited, "exited with code 0"),
            (pod("Failed", None, None), Phase::Exited, "the Pod failed"),
            // Running with the container already ended (the kubelet updates the phase later).
            (pod("Running", None, Some(terminated(1, "Error"))), Phase::Exited, "exited with code 1"),
        ];
        for (pod, phase, detail) in cases {
            let environment = environment_of(&pod);
            assert_eq!(environment.phase, phase, "{pod:?}");
            assert!(environment.detail.contains(detail), "{:?} should contain {detail:?}", environment.detail);
        }
        // Being deleted, still draining: running until the container has ended.
        let deleted = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Default::default()));
        let mut deleting = pod("Running", None, None);
        deleting.metadata.deletion_timestamp = deleted.clone();
        assert_eq!(phase_of(&deleting), (Phase::Running, String::new()));
        let mut ended = pod("Running", None, Some(terminated(143, "Error")));
        ended.metadata.deletion_timestamp = deleted;
        let (phase, detail) = phase_of(&ended);
        assert_eq!(phase, Phase::Exited);
        assert!(
            detail.contains("exited with code 143") && detail.ends_with("after the Pod was deleted (through the Kubernetes API, or its node is drained)"),
            "{detail}"
        );
    }
}
