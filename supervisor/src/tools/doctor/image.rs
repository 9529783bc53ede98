//! `supervisor doctor --image`: what a runner image must contain before any environment
//! runs it — every package of the image's package list present and running, the runner
//! and its job-started hook, and the runner user with the ids `supervisor run` switches
//! to. The image build runs it inside the image it just built (`--network none`, as root),
//! so the list the Dockerfile installs from is the list that is checked.

use std::{
    os::unix::fs::{MetadataExt, PermissionsExt},
    path::Path,
    process::Command,
};

use super::{Outcome, Settings};

/// One line of the package list: the Debian package and how to see it is there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Package {
    pub name: String,
    pub probe: Probe,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// A command on PATH and the arguments that make it print its version.
    Command { program: String, args: Vec<String> },
    /// A file the package provides, which must not be empty.
    File(String),
}

/// Parses the package list: `<package> <command> [args…]` or `<package> /absolute/file`
/// per line; `#` comments and blank lines are skipped.
///
/// # Errors
/// A line with a package and nothing to probe, with the line's number.
pub fn parse_packages(text: &str) -> Result<Vec<Package>, String> {
    let mut packages = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut words = line.split_whitespace().map(str::to_owned);
        let name = words.next().unwrap_or_default();
        let Some(program) = words.next() else {
            return Err(format!("line {}: {name:?} names no command or file to check it by", index + 1));
        };
        let probe = if program.starts_with('/') { Probe::File(program) } else { Probe::Command { program, args: words.collect() } };
        packages.push(Package { name, probe });
    }
    Ok(packages)
}

pub fn all(settings: &Settings) -> Vec<Outcome> {
    let mut outcomes = packages(&settings.packages);
    outcomes.push(node());
    outcomes.push(super::checks::runner(settings));
    outcomes.push(super::checks::cache(settings));
    outcomes.push(job_started(&settings.runner_config));
    outcomes.push(runner_user(settings));
    outcomes
}

fn packages(list: &Path) -> Vec<Outcome> {
    const ID: &str = "packages";
    let text = match std::fs::read_to_string(list) {
        Ok(text) => text,
        Err(error) => {
            return vec![Outcome::fail(
                ID,
                format!("cannot read the package list {}: {error}", list.display()),
                "the image carries it from rootfs/usr/local/lib/gitea-dynamic-runner/packages; or pass --packages",
            )];
        }
    };
    match parse_packages(&text) {
        Err(error) => vec![Outcome::fail(ID, format!("{}: {error}", list.display()), "each line is `<package> <command> [args…]` or `<package> /file`")],
        Ok(packages) if packages.is_empty() => vec![Outcome::fail(ID, format!("{} lists no package", list.display()), "restore the list from the repository")],
        Ok(packages) => packages.iter().map(probe).collect(),
    }
}

fn probe(package: &Package) -> Outcome {
    let hint = format!("install the Debian package {} (rootfs/Dockerfile installs what the list names)", package.name);
    match &package.probe {
        Probe::File(path) => match std::fs::metadata(path) {
            Ok(meta) if meta.len() > 0 => Outcome::pass(package.name.clone(), format!("{path} ({} bytes)", meta.len())),
            Ok(_) => Outcome::fail(package.name.clone(), format!("{path} is empty"), hint),
            Err(error) => Outcome::fail(package.name.clone(), format!("{path}: {error}"), hint),
        },
        Probe::Command { program, args } => {
            let id = program.clone();
            let Some(binary) = super::checks::which(Path::new(program)) else {
                return Outcome::fail(id, format!("{program} is not on PATH"), hint);
            };
            match Command::new(&binary).args(args).output() {
                Ok(output) if output.status.success() => {
                    // mkfs.ext4 -V prints to stderr, the others to stdout.
                    let text = if output.stdout.is_empty() { &output.stderr } else { &output.stdout };
                    let first = String::from_utf8_lossy(text).lines().next().unwrap_or_default().trim().to_owned();
                    Outcome::pass(id, format!("{first} ({})", package.name))
                }
                Ok(output) => Outcome::fail(
                    id,
                    format!(
                        "{} {} exited with {}: {}",
                        binary.display(),
                        args.join(" "),
                        output.status,
                        String::from_utf8_lossy(&output.stderr).lines().next().unwrap_or_default()
                    ),
                    format!("a missing library or a broken install of {}; reinstall it", package.name),
                ),
                Err(error) => Outcome::fail(id, format!("cannot run {}: {error}", binary.display()), hint),
            }
        }
    }
}

/// The oldest Node.js major that runs the actions people use today (`using: node20`); the
/// image carries 24, which runs node24 actions too.
const NODE_MAJOR_AT_LEAST: u32 = 20;

/// The `node` on PATH, which gitea-runner runs JavaScript actions with.
fn node() -> Outcome {
    const ID: &str = "node";
    let hint = "the image carries Node.js 24 as /usr/local/bin/node (scripts/build image); a derived image must keep a node on PATH";
    let Some(binary) = super::checks::which(Path::new("node")) else {
        return Outcome::fail(ID, "node is not on PATH: no JavaScript action (`uses:` of a node20/node24 action) can run", hint);
    };
    let version = match Command::new(&binary).arg("--version").output() {
        Ok(output) if output.status.success() => String::from_utf8_lossy(&output.stdout).trim().to_owned(),
        Ok(output) => return Outcome::fail(ID, format!("{} --version exited with {}", binary.display(), output.status), hint),
        Err(error) => return Outcome::fail(ID, format!("cannot run {}: {error}", binary.display()), hint),
    };
    match node_major(&version) {
        Some(major) if major >= NODE_MAJOR_AT_LEAST => Outcome::pass(ID, format!("{version} ({})", binary.display())),
        Some(_) => Outcome::fail(ID, format!("{} is Node.js {version}: node20 and node24 actions need {NODE_MAJOR_AT_LEAST} or later", binary.display()), hint),
        None => Outcome::fail(ID, format!("{} --version printed {version:?}, not a Node.js version", binary.display()), hint),
    }
}

/// `v24.22.3` → 24.
fn node_major(version: &str) -> Option<u32> {
    version.strip_prefix('v')?.split('.').next()?.parse().ok()
}

/// The hook the runner's config names must be there and executable by the runner user.
fn job_started(config: &Path) -> Outcome {
    const ID: &str = "job-started";
    let Ok(text) = std::fs::read_to_string(config) else {
        return Outcome::skip(ID, format!("{} is unreadable (see the runner check)", config.display()));
    };
    let Some(hook) = text.lines().find_map(|line| line.trim().strip_prefix("job_started:")).map(|value| value.trim().trim_matches('"').to_owned()) else {
        return Outcome::skip(ID, format!("{} sets no runner.hooks.job_started", config.display()));
    };
    match std::fs::metadata(&hook) {
        Ok(meta) if meta.is_file() && meta.permissions().mode() & 0o001 != 0 => {
            Outcome::pass(ID, format!("{hook} (mode {:o})", meta.permissions().mode() & 0o7777))
        }
        Ok(meta) => Outcome::fail(
            ID,
            format!("{hook} is not a file others may execute (mode {:o})", meta.permissions().mode() & 0o7777),
            "the runner runs it as uid 2000: chmod 0755 it in rootfs/",
        ),
        Err(error) => Outcome::fail(ID, format!("{hook}, named by {}: {error}", config.display()), "COPY rootfs/usr/ into the image"),
    }
}

fn runner_user(settings: &Settings) -> Outcome {
    const ID: &str = "runner-user";
    let user = &settings.runner_user;
    let (Ok(passwd), Ok(group)) = (std::fs::read_to_string("/etc/passwd"), std::fs::read_to_string("/etc/group")) else {
        return Outcome::fail(ID, "cannot read /etc/passwd or /etc/group", "the image needs both");
    };
    let mut problems = user_problems(&passwd, &group, user.uid, user.gid, user.docker_gid);
    match std::fs::metadata(&user.home) {
        Ok(meta) if (meta.uid(), meta.gid()) == (user.uid, user.gid) => {}
        Ok(meta) => problems.push(format!("{} is owned by {}:{}", user.home.display(), meta.uid(), meta.gid())),
        Err(error) => problems.push(format!("{}: {error}", user.home.display())),
    }
    if problems.is_empty() {
        Outcome::pass(ID, format!("uid {} gid {} in the docker group {}, home {}", user.uid, user.gid, user.docker_gid, user.home.display()))
    } else {
        Outcome::fail(
            ID,
            problems.join("; "),
            "rootfs/Dockerfile creates the runner user and the docker group with these ids; or pass the image's own ids to `supervisor run` (--runner-uid, --runner-gid, --docker-gid)",
        )
    }
}

/// What is wrong with the runner user and the docker group in `/etc/passwd` and
/// `/etc/group`: the job's files and the docker socket's group are created with these
/// ids, so names that resolve to other ids break `id`, `ls -l` and `docker` in a job.
fn user_problems(passwd: &str, group: &str, uid: u32, gid: u32, docker_gid: u32) -> Vec<String> {
    let field = |line: &str, index: usize| line.split(':').nth(index).map(str::to_owned);
    let mut problems = Vec::new();
    match passwd.lines().find(|line| field(line, 0).as_deref() == Some("runner")) {
        None => problems.push("no user runner in /etc/passwd".to_owned()),
        Some(line) => {
            let ids = (field(line, 2), field(line, 3));
            if ids != (Some(uid.to_string()), Some(gid.to_string())) {
                problems.push(format!("user runner is {}:{}, not {uid}:{gid}", ids.0.unwrap_or_default(), ids.1.unwrap_or_default()));
            }
        }
    }
    match group.lines().find(|line| field(line, 0).as_deref() == Some("docker")) {
        None => problems.push("no group docker in /etc/group".to_owned()),
        Some(line) => {
            if field(line, 2) != Some(docker_gid.to_string()) {
                problems.push(format!("group docker has gid {}, not {docker_gid}", field(line, 2).unwrap_or_default()));
            }
            if !field(line, 3).unwrap_or_default().split(',').any(|member| member == "runner") {
                problems.push("runner is not a member of the docker group".to_owned());
            }
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_package_list_parses_commands_files_and_comments() {
        let list = "# comment\n\ndocker.io  dockerd --version\nca-certificates /etc/ssl/certs/ca.crt\n  git git\n";
        let packages = parse_packages(list).unwrap();
        assert_eq!(
            packages,
            [
                Package { name: "docker.io".into(), probe: Probe::Command { program: "dockerd".into(), args: vec!["--version".into()] } },
                Package { name: "ca-certificates".into(), probe: Probe::File("/etc/ssl/certs/ca.crt".into()) },
                Package { name: "git".into(), probe: Probe::Command { program: "git".into(), args: vec![] } },
            ]
        );
        assert_eq!(parse_packages("ok ok\nlonely\n").unwrap_err(), "line 2: \"lonely\" names no command or file to check it by");
    }

    #[test]
    fn the_repositorys_package_list_parses() {
        let list = include_str!("../../../../rootfs/usr/local/lib/gitea-dynamic-runner/packages");
        let packages = parse_packages(list).unwrap();
        for needed in ["dockerd", "mkfs.ext4", "iptables", "git"] {
            assert!(
                packages.iter().any(|p| matches!(&p.probe, Probe::Command { program, .. } if program == needed)),
                "the image's package list lacks {needed}"
            );
        }
    }

    #[test]
    fn node_versions_read_as_their_major() {
        for (printed, major) in [("v24.22.3", Some(24)), ("v18.19.0", Some(18)), ("24.1.0", None), ("", None), ("vX", None)] {
            assert_eq!(node_major(printed), major, "{printed:?}");
        }
    }

    #[test]
    fn a_probe_passes_only_when_the_command_runs() {
        let pass = probe(&Package { name: "bash".into(), probe: Probe::Command { program: "bash".into(), args: vec!["--version".into()] } });
        assert_eq!(pass.status, super::super::Status::Pass, "{pass:?}");
        assert!(pass.reason.contains("GNU bash"), "{pass:?}");
        let missing = probe(&Package { name: "nope".into(), probe: Probe::Command { program: "gdr-no-such-tool".into(), args: vec![] } });
        assert_eq!((missing.status, missing.id.as_ref()), (super::super::Status::Fail, "gdr-no-such-tool"));
        assert!(missing.hint.contains("Debian package nope"), "{missing:?}");
        let failing = probe(&Package { name: "coreutils".into(), probe: Probe::Command { program: "false".into(), args: vec![] } });
        assert_eq!(failing.status, super::super::Status::Fail, "{failing:?}");
        let empty = probe(&Package { name: "empty".into(), probe: Probe::File("/dev/null".into()) });
        assert_eq!(empty.status, super::super::Status::Fail, "{empty:?}");
    }

    #[test]
    fn the_runner_user_and_docker_group_must_have_the_ids_run_uses() {
        let passwd = "root:x:0:0::/root:/bin/sh\nrunner:x:2000:2000::/home/runner:/bin/bash\n";
        let group = "root:x:0:\ndocker:x:2001:runner\nrunner:x:2000:\n";
        let cases: &[(&str, &str, &[&str])] = &[
            (passwd, group, &[]),
            ("root:x:0:0::/root:/bin/sh\n", group, &["no user runner in /etc/passwd"]),
            ("runner:x:1000:1000::/home/runner:/bin/bash\n", group, &["user runner is 1000:1000, not 2000:2000"]),
            (passwd, "docker:x:998:runner\n", &["group docker has gid 998, not 2001"]),
            (passwd, "docker:x:2001:\n", &["runner is not a member of the docker group"]),
            (passwd, "docker:x:2001:alice,runner\n", &[]),
            (passwd, "", &["no group docker in /etc/group"]),
        ];
        for (passwd, group, expected) in cases {
            assert_eq!(user_problems(passwd, group, 2000, 2000, 2001), *expected, "passwd {passwd:?} group {group:?}");
        }
    }
}
