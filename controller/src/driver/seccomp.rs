//! The seccomp profile of a rootless environment: the operator's profile (by default
//! the one `containers-common` installs, which allows `unshare`, `mount` and `pivot_root`)
//! with the few namespace calls a rootless dockerd and its runc make — `setns`,
//! `sethostname`, `chroot` — allowed without the capabilities the profile ties them to.
//! Docker decides such conditions by the container's capability list, and the environment
//! must not hold `SYS_ADMIN` or `SYS_CHROOT`: the kernel still checks each call against
//! the caller's capabilities in its own user namespace. The kernel keyring, which user
//! namespaces do not separate (every environment's uid 2000 would share one), answers
//! ENOSYS, as Docker's own profile has it: runc carries on without a session keyring.

use serde_json::Value;

/// What a rootless dockerd needs beyond the profile's unconditional allowances.
pub const ROOTLESS_SYSCALLS: [&str; 3] = ["chroot", "sethostname", "setns"];
/// The keyring's calls, refused with ENOSYS whatever the profile says.
pub const KEYRING_SYSCALLS: [&str; 3] = ["add_key", "keyctl", "request_key"];
const ENOSYS: u32 = 38;

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error(
        "cannot read the seccomp profile {path}: {source}; install it (Debian and Ubuntu: golang-github-containers-common, Fedora: containers-common) or set docker.seccomp_profile"
    )]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the seccomp profile {path} is not a Docker seccomp profile: {reason}")]
    Invalid { path: String, reason: String },
}

/// The profile at `path`, made fit for a rootless dockerd ([`rootless_profile`]), as the
/// JSON text Docker takes in `seccomp=`.
///
/// # Errors
/// When the file cannot be read or is not a profile.
pub fn read_rootless_profile(path: &str) -> Result<String, SeccompError> {
    let text = std::fs::read_to_string(path).map_err(|source| SeccompError::Read { path: path.to_owned(), source })?;
    let profile: Value = serde_json::from_str(&text).map_err(|e| SeccompError::Invalid { path: path.to_owned(), reason: e.to_string() })?;
    let profile = rootless_profile(profile).map_err(|reason| SeccompError::Invalid { path: path.to_owned(), reason })?;
    Ok(profile.to_string())
}

/// `profile` with [`ROOTLESS_SYSCALLS`] taken out of every rule that depends on
/// capabilities and allowed by one rule of their own, and [`KEYRING_SYSCALLS`] taken out
/// of every rule and refused by one of their own; everything else as it was.
///
/// # Errors
/// When `profile` has no `syscalls` list or no default action.
pub fn rootless_profile(mut profile: Value) -> Result<Value, String> {
    if profile.get("defaultAction").and_then(Value::as_str).is_none() {
        return Err("it has no defaultAction".into());
    }
    let Some(rules) = profile.get_mut("syscalls").and_then(Value::as_array_mut) else {
        return Err("it has no syscalls list".into());
    };
    let conditional = |rule: &Value| {
        ["includes", "excludes"].iter().any(|key| rule.pointer(&format!("/{key}/caps")).and_then(Value::as_array).is_some_and(|caps| !caps.is_empty()))
    };
    rules.retain_mut(|rule| {
        let conditional = conditional(rule);
        let Some(names) = rule.get_mut("names").and_then(Value::as_array_mut) else { return true };
        names.retain(|name| {
            let name = name.as_str().unwrap_or_default();
            let replaced = KEYRING_SYSCALLS.contains(&name) || (conditional && ROOTLESS_SYSCALLS.contains(&name));
            !replaced
        });
        !names.is_empty()
    });
    rules.push(serde_json::json!({
        "names": ROOTLESS_SYSCALLS,
        "action": "SCMP_ACT_ALLOW",
        "comment": "gitea-dynamic-runner: a rootless dockerd's namespace calls, checked by the kernel in its own user namespace",
    }));
    rules.push(serde_json::json!({
        "names": KEYRING_SYSCALLS,
        "action": "SCMP_ACT_ERRNO",
        "errnoRet": ENOSYS,
        "comment": "gitea-dynamic-runner: the kernel keyring is not per user namespace",
    }));
    Ok(profile)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn names_of(profile: &Value) -> Vec<(String, Vec<String>)> {
        profile["syscalls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|rule| {
                let names = rule["names"].as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_owned()).collect();
                (rule["action"].as_str().unwrap().to_owned(), names)
            })
            .collect()
    }

    #[test]
    fn namespace_calls_lose_their_capability_conditions_and_nothing_else_changes() {
        let profile = json!({
            "defaultAction": "SCMP_ACT_ERRNO",
            "syscalls": [
                {"names": ["read", "mount", "unshare", "keyctl"], "action": "SCMP_ACT_ALLOW"},
                {"names": ["bpf", "sethostname", "setns"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_SYS_ADMIN"]}},
                {"names": ["bpf", "sethostname", "setns"], "action": "SCMP_ACT_ERRNO", "excludes": {"caps": ["CAP_SYS_ADMIN"]}},
                {"names": ["chroot"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_SYS_CHROOT"]}},
                {"names": ["chroot"], "action": "SCMP_ACT_ERRNO", "excludes": {"caps": ["CAP_SYS_CHROOT"]}},
                {"names": ["setns"], "action": "SCMP_ACT_ALLOW", "includes": {"arches": ["amd64"]}},
            ],
        });
        let rootless = rootless_profile(profile).unwrap();
        let want: Vec<(String, Vec<String>)> = [
            ("SCMP_ACT_ALLOW", vec!["read", "mount", "unshare"]),
            ("SCMP_ACT_ALLOW", vec!["bpf"]),
            ("SCMP_ACT_ERRNO", vec!["bpf"]),
            // A rule without a capability condition stays as it is.
            ("SCMP_ACT_ALLOW", vec!["setns"]),
            ("SCMP_ACT_ALLOW", vec!["chroot", "sethostname", "setns"]),
            ("SCMP_ACT_ERRNO", vec!["add_key", "keyctl", "request_key"]),
        ]
        .into_iter()
        .map(|(action, names)| (action.to_owned(), names.into_iter().map(str::to_owned).collect()))
        .collect();
        assert_eq!(names_of(&rootless), want);
        assert_eq!(rootless["defaultAction"], "SCMP_ACT_ERRNO");
        assert_eq!(rootless["syscalls"].as_array().unwrap().last().unwrap()["errnoRet"], 38);
    }

    #[test]
    fn what_is_not_a_profile_is_refused() {
        for (profile, reason) in [
            (json!({"syscalls": []}), "it has no defaultAction"),
            (json!({"defaultAction": "SCMP_ACT_ERRNO"}), "it has no syscalls list"),
            (json!({"defaultAction": "SCMP_ACT_ERRNO", "syscalls": {}}), "it has no syscalls list"),
        ] {
            assert_eq!(rootless_profile(profile).unwrap_err(), reason);
        }
    }

    #[test]
    fn a_missing_file_says_which_package_has_it() {
        let error = read_rootless_profile("/nonexistent/seccomp.json").unwrap_err().to_string();
        assert!(error.contains("golang-github-containers-common") && error.contains("docker.seccomp_profile"), "{error}");
    }
}
