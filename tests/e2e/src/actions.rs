//! The real public actions the tests use — `actions/checkout` (v4, v6), `actions/cache`
//! (v4, v5) and the artifact actions (v3, v4) — as pinned archives of their tags
//! (`shared/peers/actions`, each the unmodified tree of the tag), served by a test Gitea
//! whose `DEFAULT_ACTIONS_URL = self` resolves `uses: actions/NAME@TAG` to itself, or
//! unpacked for run-local's `--action`.

use std::path::{Path, PathBuf};

use testkit::gitea::{Gitea, GiteaOptions};

/// Every action and tag the archives hold, as `uses:` names them.
pub const ALL: [(&str, &str); 8] = [
    ("checkout", "v4"),
    ("checkout", "v6"),
    ("cache", "v4"),
    ("cache", "v5"),
    ("upload-artifact", "v3"),
    ("upload-artifact", "v4"),
    ("download-artifact", "v3"),
    ("download-artifact", "v4"),
];

/// The folder of the pinned archives (`GDR_ACTIONS_ARCHIVES` overrides).
pub fn archives() -> PathBuf {
    crate::paths::shared("peers/actions", "actions-checkout-v4.tar.gz", "GDR_ACTIONS_ARCHIVES")
}

/// The tree of `actions/NAME@TAG`, unpacked into `into` (which must not exist yet): the
/// tag's files without its `.github/` (the action's own CI workflows, which a Gitea would
/// otherwise start on the push).
pub fn unpack(name: &str, tag: &str, into: &Path) {
    let archive = archives().join(format!("actions-{name}-{tag}.tar.gz"));
    assert!(archive.is_file(), "{} is missing: the pinned actions are in shared/peers/actions", archive.display());
    std::fs::create_dir_all(into).unwrap();
    let status = std::process::Command::new("tar")
        .arg("-xzf")
        .arg(&archive)
        .arg("-C")
        .arg(into)
        .args(["--strip-components=1", "--exclude=*/.github"])
        .status()
        .expect("tar cannot run");
    assert!(status.success(), "cannot unpack {}", archive.display());
    assert!(into.join("action.yml").is_file(), "{} holds no action.yml", archive.display());
}

/// Gitea on `bind` (where environments reach it) where `uses: OWNER/NAME` resolves to
/// itself, with every action of [`ALL`] mirrored as `actions/NAME`, tagged.
pub async fn gitea_with_actions(bind: std::net::IpAddr) -> Gitea {
    let gitea = Gitea::start(GiteaOptions { bind, actions_settings: vec![("DEFAULT_ACTIONS_URL".into(), "self".into())], ..GiteaOptions::default() }).await;
    let work = tempfile::tempdir().unwrap();
    for name in ["checkout", "cache", "upload-artifact", "download-artifact"] {
        let repo = gitea.create_org_repo("actions", name).await;
        for (_, tag) in ALL.iter().filter(|(action, _)| *action == name) {
            let tree = work.path().join(format!("{name}-{tag}"));
            unpack(name, tag, &tree);
            gitea.push_tree_as_tag(&repo, &tree, tag);
        }
    }
    gitea
}

/// The `key=[value]` lines of a job's log: what its steps said (the runner's echo of a
/// step's script, whose keys hold spaces or quotes, is left out).
pub fn said(log: &str) -> std::collections::BTreeMap<String, String> {
    log.lines()
        .filter_map(|line| line.trim().split_once("=["))
        .filter(|(key, _)| !key.contains(' ') && !key.contains('"'))
        .filter_map(|(key, rest)| rest.strip_suffix(']').map(|value| (key.to_owned(), value.to_owned())))
        .collect()
}
