//! Where the binaries and images the tests need are: built by `scripts/build static`,
//! `scripts/install test-peers` and `scripts/build image` (which `scripts/test` runs
//! first). A missing one panics with the command that makes it.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

/// The repository's root.
pub fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// A runner binary (`gitea-runner` or `act_runner`) built from upstream.
pub fn runner(name: &str) -> PathBuf {
    testkit::peer(name)
}

/// The static supervisor the image carries (`scripts/build static`).
pub fn supervisor() -> PathBuf {
    let path = std::env::var_os("SUPERVISOR_BIN").map_or_else(|| repository().join("target/x86_64-unknown-linux-musl/release/supervisor"), PathBuf::from);
    assert!(path.exists(), "{} is missing: run scripts/build static", path.display());
    path
}

/// The static musl controller of `scripts/build static` (what the controller image uses).
pub fn static_controller() -> PathBuf {
    static_binary("controller")
}

/// The static musl run-local of `scripts/build static` (what `scripts/run-local` and the
/// controller image use).
pub fn static_run_local() -> PathBuf {
    static_binary("run-local")
}

fn static_binary(name: &str) -> PathBuf {
    let path = repository().join("target/x86_64-unknown-linux-musl/release").join(name);
    assert!(path.exists(), "{} is missing: run scripts/build static", path.display());
    path
}

/// Names a `docker save` tar of a runner image built elsewhere — a published one
/// (`scripts/check smoke-image`): the tests that ask for the gitea-runner variant then run
/// exactly that image instead of building one.
pub const RUNNER_IMAGE_TAR_ENV: &str = "GDR_RUNNER_IMAGE_TAR";

/// The runner image of `variant` (`gitea-runner` or `act_runner`): its tag and the
/// `docker save` tar, from `scripts/build image` (cached by content, so this is quick
/// when nothing changed), or the one [`RUNNER_IMAGE_TAR_ENV`] names.
pub fn image(variant: &str) -> (String, PathBuf) {
    if let Some(tar) = std::env::var_os(RUNNER_IMAGE_TAR_ENV).filter(|_| variant == "gitea-runner") {
        return saved_image(PathBuf::from(tar));
    }
    let output = Command::new(repository().join("scripts/build"))
        .args(["image", "--variant", variant])
        .env("SUPERVISOR_BIN", supervisor())
        .env_remove("DOCKER_HOST")
        .output()
        .expect("scripts/build image cannot run");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "scripts/build image --variant {variant} failed:\n{}\n{}", stdout, String::from_utf8_lossy(&output.stderr));
    let line = stdout.lines().rev().find(|l| l.starts_with("image ")).expect("scripts/build image printed no `image` line");
    let mut words = line.split_whitespace().skip(1);
    let tag = words.next().unwrap().to_owned();
    let tar = PathBuf::from(words.next().unwrap());
    (tag, tar)
}

/// The tag a `docker save` tar was saved under (its manifest's first `RepoTags`), and the tar.
fn saved_image(tar: PathBuf) -> (String, PathBuf) {
    let output = Command::new("tar").arg("-xOf").arg(&tar).arg("manifest.json").output().expect("tar cannot run");
    assert!(
        output.status.success(),
        "{RUNNER_IMAGE_TAR_ENV}={}: no manifest.json in it — is it a `docker save` tar? {}",
        tar.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    let manifest: serde_json::Value =
        serde_json::from_slice(&output.stdout).unwrap_or_else(|e| panic!("{RUNNER_IMAGE_TAR_ENV}={}: manifest.json: {e}", tar.display()));
    let tag = manifest[0]["RepoTags"][0]
        .as_str()
        .unwrap_or_else(|| panic!("{RUNNER_IMAGE_TAR_ENV}={}: the image has no tag: save it by name (docker save IMAGE:TAG)", tar.display()))
        .to_owned();
    (tag, tar)
}

/// The `controller` binary of this build (`cargo test` builds the workspace's binaries
/// beside the test executables): `$CONTROLLER_BIN`, else `<target>/<profile>/controller`.
pub fn controller() -> PathBuf {
    let path = std::env::var_os("CONTROLLER_BIN").map_or_else(
        || {
            let test = std::env::current_exe().unwrap();
            // <target>/<profile>/deps/<test>-<hash>
            test.parent().and_then(Path::parent).unwrap().join("controller")
        },
        PathBuf::from,
    );
    assert!(path.exists(), "{} is missing: build it with cargo build -p controller (cargo test --workspace --bins does)", path.display());
    path
}

/// The controller image of `scripts/build controller-image` from the static controller:
/// its tag and archive. `cache`: where the script keeps its output (default: the peers'
/// cache).
pub fn controller_image(cache: Option<&std::path::Path>) -> (String, PathBuf) {
    controller_image_with(cache, None)
}

/// As [`controller_image`], and with `context` also the `docker build` context the script
/// lays out there (`--context`).
pub fn controller_image_with(cache: Option<&std::path::Path>, context: Option<&std::path::Path>) -> (String, PathBuf) {
    let mut command = Command::new(repository().join("scripts/build"));
    command.arg("controller-image");
    if let Some(context) = context {
        command.arg("--context").arg(context);
    }
    command.env("CONTROLLER_BIN", static_controller()).env("RUN_LOCAL_BIN", static_run_local());
    if let Some(cache) = cache {
        command.env("PEERS_CACHE", cache);
    }
    let output = command.output().expect("scripts/build controller-image cannot run");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "scripts/build controller-image failed:\n{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    let line = stdout.lines().rev().find(|l| l.starts_with("image ")).expect("no `image` line");
    let mut words = line.split_whitespace().skip(1);
    (words.next().unwrap().to_owned(), PathBuf::from(words.next().unwrap()))
}

/// A folder of the shared test peers (`shared/<path>`): beside the repository, or beside the
/// one it was cloned from (a clone elsewhere, as CI makes), as scripts/lib/common.sh's
/// `beside_repository` finds them; `override_env` names a variable that points at it
/// directly. `marker` is a file the folder must hold.
pub fn shared(path: &str, marker: &str, override_env: &str) -> PathBuf {
    let repository = repository();
    let origin = Command::new("git")
        .args(["-C", &repository.to_string_lossy(), "config", "--get", "remote.origin.url"])
        .output()
        .ok()
        .map(|output| PathBuf::from(String::from_utf8_lossy(&output.stdout).trim()))
        .filter(|origin| origin.is_absolute());
    let candidates = std::env::var_os(override_env)
        .map(PathBuf::from)
        .into_iter()
        .chain(std::iter::once(repository.join("..")).chain(origin.map(|origin| origin.join(".."))).map(|top| top.join("shared").join(path)));
    for candidate in candidates {
        if candidate.join(marker).exists() {
            return candidate;
        }
    }
    panic!("shared/{path}/{marker} is neither beside the repository nor beside its origin: set {override_env}")
}
