//! What a job may reach, read from its task's context: its cache scope (its
//! repository, the ref it saves under, the refs it restores from) and the runtime
//! tokens its steps are given — derived here, beside its identity, so the facade
//! only asks.

use ::cache::Scope;
use proto::runner::v1::Task;

/// What the runner gives jobs as ACTIONS_RUNTIME_TOKEN: Gitea's runtime token of the
/// task, or the task's token where Gitea gives none (the runners' own fallback).
pub fn runtime_tokens(task: &Task) -> [String; 4] {
    let secret = |name: &str| task.secrets.get(name).cloned().unwrap_or_default();
    [context_str(task, "gitea_runtime_token"), context_str(task, "token"), secret("GITEA_TOKEN"), secret("GITHUB_TOKEN")]
}

/// The string field `name` of a task context, if it is one.
pub fn string<'a>(context: &'a prost_types::Struct, name: &str) -> Option<&'a str> {
    match context.fields.get(name).and_then(|value| value.kind.as_ref()) {
        Some(prost_types::value::Kind::StringValue(text)) => Some(text),
        _ => None,
    }
}

/// The string field `name` of the task's context; empty where it has none.
fn context_str(task: &Task, name: &str) -> String {
    task.context.as_ref().and_then(|context| string(context, name)).unwrap_or_default().to_owned()
}

/// GitHub's cache scope of a task: its repository; it saves under its own ref, and
/// restores from that ref, then its pull request's base branch, then the default branch.
pub fn cache_scope(task: &Task) -> Scope {
    let git_ref = context_str(task, "ref");
    let base = context_str(task, "base_ref");
    let default_branch = task
        .context
        .as_ref()
        .and_then(|context| context.fields.get("event"))
        .and_then(|event| match &event.kind {
            Some(prost_types::value::Kind::StructValue(event)) => event.fields.get("repository"),
            _ => None,
        })
        .and_then(|repository| match &repository.kind {
            Some(prost_types::value::Kind::StructValue(repository)) => repository.fields.get("default_branch"),
            _ => None,
        })
        .and_then(|branch| match &branch.kind {
            Some(prost_types::value::Kind::StringValue(branch)) => Some(branch.clone()),
            _ => None,
        })
        .unwrap_or_default();
    let branch = |name: &str| if name.is_empty() || name.starts_with("refs/") { name.to_owned() } else { format!("refs/heads/{name}") };
    Scope::new(context_str(task, "repository"), branch(&git_ref), [branch(&base), branch(&default_branch)])
}

#[cfg(test)]
mod tests {
    use prost_types::{Struct, Value, value::Kind};

    use super::*;

    fn string(text: &str) -> Value {
        Value { kind: Some(Kind::StringValue(text.to_owned())) }
    }

    fn task(fields: &[(&str, &str)], default_branch: Option<&str>) -> Task {
        let mut context: std::collections::BTreeMap<String, Value> = fields.iter().map(|(k, v)| ((*k).to_owned(), string(v))).collect();
        if let Some(branch) = default_branch {
            let repository = Struct { fields: [("default_branch".to_owned(), string(branch))].into() };
            let event = Struct { fields: [("repository".to_owned(), Value { kind: Some(Kind::StructValue(repository)) })].into() };
            context.insert("event".to_owned(), Value { kind: Some(Kind::StructValue(event)) });
        }
        Task { context: Some(Struct { fields: context }), ..Task::default() }
    }

    /// A task's context fields and default branch → the ref it saves under and the refs
    /// it restores from.
    type Case<'a> = (&'a [(&'a str, &'a str)], Option<&'a str>, &'a str, &'a [&'a str]);

    #[test]
    fn scopes_are_what_the_task_says() {
        let table: &[Case<'_>] = &[
            (&[("repository", "o/r"), ("ref", "refs/heads/main")], Some("main"), "refs/heads/main", &["refs/heads/main"]),
            (&[("repository", "o/r"), ("ref", "refs/heads/feature")], Some("main"), "refs/heads/feature", &["refs/heads/feature", "refs/heads/main"]),
            (
                &[("repository", "o/r"), ("ref", "refs/pull/7/head"), ("base_ref", "release")],
                Some("main"),
                "refs/pull/7/head",
                &["refs/pull/7/head", "refs/heads/release", "refs/heads/main"],
            ),
            (&[("repository", "o/r"), ("ref", "refs/tags/v1")], None, "refs/tags/v1", &["refs/tags/v1"]),
        ];
        for (fields, default_branch, write, read_expected) in table {
            let scope = cache_scope(&task(fields, *default_branch));
            let read: Vec<&str> = scope.read.iter().map(String::as_str).collect();
            assert_eq!((scope.repository.as_str(), scope.write.as_str(), read.as_slice()), ("o/r", *write, *read_expected), "{fields:?}");
        }
    }

    #[test]
    fn the_runtime_token_is_gitea_s_or_the_task_s() {
        let mut task = task(&[("gitea_runtime_token", "runtime")], None);
        task.secrets.insert("GITEA_TOKEN".into(), "task-token".into());
        assert_eq!(runtime_tokens(&task), ["runtime", "", "task-token", ""].map(str::to_owned));
    }
}
