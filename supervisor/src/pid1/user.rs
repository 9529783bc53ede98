//! The runner user as this environment runs it. The image defines `runner` as uid and gid
//! 2000 with the subordinate ids 100000:65536; a driver that gives each environment a host
//! uid of its own (so that no per-user kernel budget — inotify instances, user namespaces,
//! processes — is shared between tenants) says which with `--runner-uid`, `--runner-gid`
//! and `--subordinate-ids`. PID 1 makes the image agree before anything runs as the
//! runner: the `runner` entries of /etc/passwd and /etc/group (tools look the user up by
//! uid: git, ssh, node's `os.userInfo()`), the owner of its home, and the runner's line in
//! /etc/subuid and /etc/subgid, which newuidmap and newgidmap check.

use std::{
    fs,
    io::Write as _,
    os::unix::fs::{MetadataExt as _, OpenOptionsExt as _},
    path::{Path, PathBuf},
};

use super::settings::{IdRange, RunnerUser};

/// The name the image gives the runner user and its group.
pub const RUNNER: &str = "runner";

#[derive(Debug, thiserror::Error)]
pub enum UserError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("{path} has no `{RUNNER}` entry: the runner image defines the user {RUNNER} (docs/runner-image.md)")]
    NoEntry { path: PathBuf },
    #[error("cannot give {path} to the runner uid: {source}")]
    Chown { path: PathBuf, source: std::io::Error },
}

/// What [`adopt`] changed, for the log.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Adopted {
    pub files: Vec<PathBuf>,
    pub home_entries: usize,
}

/// Makes `etc` (the environment's /etc) and the runner's home agree with `user`, when a
/// driver assigned its ids ([`RunnerUser::assigned`]). Nothing changes where they already
/// agree (the image's own ids).
///
/// # Errors
/// A file that cannot be read or written, an /etc/passwd or /etc/group without the
/// runner, or a home that cannot be handed over.
pub fn adopt(user: &RunnerUser, etc: &Path) -> Result<Adopted, UserError> {
    let mut adopted = Adopted::default();
    if !user.assigned {
        return Ok(adopted);
    }
    let passwd = [(2, user.uid), (3, user.gid)];
    let group = [(2, user.gid)];
    for (file, fields) in [("passwd", &passwd[..]), ("group", &group[..])] {
        let path = etc.join(file);
        let text = fs::read_to_string(&path).map_err(|source| UserError::Read { path: path.clone(), source })?;
        let edited = with_fields(&text, fields).ok_or_else(|| UserError::NoEntry { path: path.clone() })?;
        if edited != text {
            replace(&path, &edited, 0o644)?;
            adopted.files.push(path);
        }
    }
    if let Some(range) = user.subordinate {
        for file in ["subuid", "subgid"] {
            let path = etc.join(file);
            let text = fs::read_to_string(&path).unwrap_or_default();
            let edited = with_subordinate(&text, range);
            if edited != text {
                replace(&path, &edited, 0o644)?;
                adopted.files.push(path);
            }
        }
    }
    adopted.home_entries = give_home(&user.home, user.uid, user.gid)?;
    Ok(adopted)
}

/// `text` (passwd or group lines) with the given 0-based fields of the runner's line set;
/// `None` when there is no such line.
fn with_fields(text: &str, fields: &[(usize, u32)]) -> Option<String> {
    let mut found = false;
    let lines: Vec<String> = text
        .lines()
        .map(|line| {
            let mut parts: Vec<String> = line.split(':').map(str::to_owned).collect();
            if parts.first().map(String::as_str) != Some(RUNNER) {
                return line.to_owned();
            }
            found = true;
            for (index, value) in fields {
                if let Some(part) = parts.get_mut(*index) {
                    *part = value.to_string();
                }
            }
            parts.join(":")
        })
        .collect();
    found.then(|| lines.iter().map(|line| format!("{line}\n")).collect())
}

/// `text` (subuid or subgid) with the runner's line replaced by `range` (added when missing).
fn with_subordinate(text: &str, range: IdRange) -> String {
    let ours = format!("{RUNNER}:{}:{}\n", range.first, range.count);
    let others: String = text.lines().filter(|line| line.split(':').next() != Some(RUNNER)).map(|line| format!("{line}\n")).collect();
    others + &ours
}

/// Writes `path` anew beside itself and renames it into place (a half-written passwd
/// never shows).
fn replace(path: &Path, text: &str, mode: u32) -> Result<(), UserError> {
    let write = |source| UserError::Write { path: path.to_owned(), source };
    let temporary = path.with_extension("supervisor-new");
    let mut file = fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&temporary).map_err(write)?;
    file.write_all(text.as_bytes()).map_err(write)?;
    file.sync_all().map_err(write)?;
    fs::rename(&temporary, path).map_err(write)
}

/// Hands the runner's home (on the image's filesystem, not following links or crossing
/// into mounts) to `uid:gid`; returns how many entries changed owner.
fn give_home(home: &Path, uid: u32, gid: u32) -> Result<usize, UserError> {
    let Ok(top) = fs::symlink_metadata(home) else { return Ok(0) };
    if top.uid() == uid && top.gid() == gid {
        return Ok(0);
    }
    let mut changed = 0;
    let mut pending = vec![home.to_owned()];
    while let Some(path) = pending.pop() {
        let chown = |source| UserError::Chown { path: path.clone(), source };
        let meta = fs::symlink_metadata(&path).map_err(chown)?;
        if meta.dev() != top.dev() {
            continue;
        }
        if meta.uid() != uid || meta.gid() != gid {
            std::os::unix::fs::lchown(&path, Some(uid), Some(gid)).map_err(chown)?;
            changed += 1;
        }
        if meta.is_dir() {
            for entry in fs::read_dir(&path).map_err(chown)? {
                pending.push(entry.map_err(chown)?.path());
            }
        }
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\nrunner:x:2000:2000::/home/runner:/bin/bash\nrunnerish:x:3000:3000::/x:/bin/sh\n";
    const GROUP: &str = "root:x:0:\ndocker:x:2001:runner\nrunner:x:2000:\n";

    #[test]
    fn the_runner_entries_take_the_given_ids_and_nothing_else_changes() {
        /// (passwd or group text, the fields to set, the text wanted)
        type Row<'a> = (&'a str, &'a [(usize, u32)], Option<&'a str>);
        let rows: Vec<Row> = vec![
            (
                PASSWD,
                &[(2, 200_001), (3, 200_001)],
                Some("root:x:0:0:root:/root:/bin/bash\nrunner:x:200001:200001::/home/runner:/bin/bash\nrunnerish:x:3000:3000::/x:/bin/sh\n"),
            ),
            (PASSWD, &[(2, 2000), (3, 2000)], Some(PASSWD)),
            (GROUP, &[(2, 200_001)], Some("root:x:0:\ndocker:x:2001:runner\nrunner:x:200001:\n")),
            ("root:x:0:0:root:/root:/bin/bash\n", &[(2, 1)], None),
            ("", &[(2, 1)], None),
        ];
        for (text, fields, want) in rows {
            assert_eq!(with_fields(text, fields).as_deref(), want, "{text:?} {fields:?}");
        }
    }

    #[test]
    fn the_runner_gets_exactly_its_own_subordinate_range() {
        let range = IdRange { first: 3_000_065_536, count: 65_536 };
        let rows = [
            ("runner:100000:65536\n", "runner:3000065536:65536\n"),
            ("", "runner:3000065536:65536\n"),
            ("other:200000:65536\nrunner:100000:65536\nrunner:165536:65536\n", "other:200000:65536\nrunner:3000065536:65536\n"),
        ];
        for (text, want) in rows {
            assert_eq!(with_subordinate(text, range), want, "{text:?}");
        }
    }

    #[test]
    fn adopt_rewrites_etc_and_keeps_what_already_agrees() {
        let dir = tempfile::tempdir().unwrap();
        let etc = dir.path().join("etc");
        fs::create_dir(&etc).unwrap();
        fs::write(etc.join("passwd"), PASSWD).unwrap();
        fs::write(etc.join("group"), GROUP).unwrap();
        fs::write(etc.join("subuid"), "runner:100000:65536\n").unwrap();
        fs::write(etc.join("subgid"), "runner:100000:65536\n").unwrap();
        let home = dir.path().join("home");
        fs::create_dir(&home).unwrap();
        let own = fs::metadata(&home).unwrap();
        // The owner the test process has: adopting it is a no-op for the home.
        let user = RunnerUser {
            uid: own.uid(),
            gid: own.gid(),
            docker_gid: 2001,
            home: home.clone(),
            subordinate: Some(IdRange { first: 1_000_000, count: 65_536 }),
            assigned: true,
        };
        let adopted = adopt(&user, &etc).unwrap();
        let passwd = fs::read_to_string(etc.join("passwd")).unwrap();
        assert!(passwd.contains(&format!("runner:x:{}:{}::/home/runner:/bin/bash\n", own.uid(), own.gid())) || own.uid() == 2000, "{passwd}");
        assert_eq!(fs::read_to_string(etc.join("subuid")).unwrap(), "runner:1000000:65536\n");
        assert_eq!(fs::read_to_string(etc.join("subgid")).unwrap(), "runner:1000000:65536\n");
        assert_eq!(adopted.home_entries, 0);
        assert!(adopted.files.contains(&etc.join("subuid")), "{adopted:?}");
        // Again: everything already agrees.
        assert_eq!(adopt(&user, &etc).unwrap(), Adopted::default());
        // Ids nobody assigned (the image's defaults, or a supervisor run on some host): /etc
        // is left alone, whatever it says.
        let before = fs::read_to_string(etc.join("subuid")).unwrap();
        let unassigned = RunnerUser { subordinate: Some(IdRange { first: 7_000_000, count: 65_536 }), assigned: false, ..user.clone() };
        assert_eq!(adopt(&unassigned, &etc).unwrap(), Adopted::default());
        assert_eq!(fs::read_to_string(etc.join("subuid")).unwrap(), before);
        // No runner in passwd: said, not guessed.
        fs::write(etc.join("passwd"), "root:x:0:0::/root:/bin/sh\n").unwrap();
        let error = adopt(&user, &etc).unwrap_err();
        assert!(error.to_string().contains("has no `runner` entry"), "{error}");
    }
}
