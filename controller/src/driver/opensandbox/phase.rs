//! What a sandbox's state means for its job: running, or ended with the server's reason.

use super::{LABEL_ENVIRONMENT, api::Sandbox};
use crate::driver::{Environment, LABEL_ASSIGNMENT, Phase};

/// The environment a sandbox is. Paused and transitional states count as running (the
/// sandbox still holds the job); `Unknown` too, so a server that cannot tell does not
/// fail a job that may be fine.
pub(super) fn environment_of(sandbox: Sandbox) -> Environment {
    let state = sandbox.status.state.as_str();
    let phase = match state {
        "Terminated" | "Failed" => Phase::Exited,
        "Stopping" => Phase::Terminal,
        _ => Phase::Running,
    };
    let detail = if phase == Phase::Running {
        String::new()
    } else {
        let mut detail = format!("the sandbox {} is {state}", sandbox.id);
        if let Some(reason) = sandbox.status.reason.as_deref().filter(|r| !r.is_empty()) {
            detail.push_str(&format!(" ({reason})"));
        }
        if let Some(message) = sandbox.status.message.as_deref().filter(|m| !m.is_empty()) {
            detail.push_str(": ");
            detail.push_str(message);
        }
        detail
    };
    let exit_code = if phase == Phase::Running { None } else { sandbox.status.message.as_deref().and_then(exit_code_in) };
    Environment {
        name: sandbox.metadata.get(LABEL_ENVIRONMENT).cloned().unwrap_or_else(|| sandbox.id.clone()),
        assignment_id: sandbox.metadata.get(LABEL_ASSIGNMENT).cloned().unwrap_or_default(),
        labels: sandbox.metadata,
        phase,
        detail,
        exit_code,
    }
}

/// The code in the server's "Sandbox container exited with code 75." (the Lifecycle API
/// has no field for it; another wording gives none, and only the explanation is lost).
fn exit_code_in(message: &str) -> Option<i64> {
    let (_, after) = message.split_once("exited with code ")?;
    after.trim_end_matches('.').split_whitespace().next()?.trim_end_matches('.').parse().ok()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::driver::opensandbox::api::Status;

    #[test]
    fn states_map_to_phases_with_the_servers_reason() {
        let sandbox = |state: &str, reason: &str, message: &str| Sandbox {
            id: "sb-1".into(),
            status: Status { state: state.into(), reason: Some(reason.into()), message: Some(message.into()) },
            metadata: BTreeMap::from([
                (LABEL_ENVIRONMENT.to_owned(), "gdr-x-gitea-task-1".to_owned()),
                (LABEL_ASSIGNMENT.to_owned(), "gitea-task-1".to_owned()),
            ]),
            created_at: String::new(),
        };
        for state in ["Pending", "Running", "Pausing", "Paused", "Resuming", "Unknown", ""] {
            let environment = environment_of(sandbox(state, "", ""));
            assert_eq!((environment.phase, environment.detail.as_str()), (Phase::Running, ""), "{state}");
        }
        let failed = environment_of(sandbox("Failed", "CONTAINER_EXITED_ERROR", "Sandbox container exited with code 3."));
        assert_eq!(failed.phase, Phase::Exited);
        assert_eq!(failed.detail, "the sandbox sb-1 is Failed (CONTAINER_EXITED_ERROR): Sandbox container exited with code 3.");
        assert_eq!((failed.name.as_str(), failed.assignment_id.as_str()), ("gdr-x-gitea-task-1", "gitea-task-1"));
        assert_eq!(failed.exit_code, Some(3));
        let unclaimed = environment_of(sandbox("Failed", "CONTAINER_EXITED_ERROR", "Sandbox container exited with code 75."));
        assert!(
            unclaimed
                .why_unclaimed()
                .ends_with("could not claim the job from the controller: the facade refused it, or is unreachable from the environment at facade.url"),
            "{}",
            unclaimed.why_unclaimed()
        );
        assert_eq!(environment_of(sandbox("Terminated", "CONTAINER_EXITED", "")).exit_code, None);
        assert_eq!(environment_of(sandbox("Terminated", "CONTAINER_EXITED", "")).phase, Phase::Exited);
        assert_eq!(environment_of(sandbox("Stopping", "", "")).phase, Phase::Terminal);
    }
}
