//! Records the source revision (git's HEAD) the binaries are built from: both print it
//! with their version and log it in their first line, so an operator can tell which
//! build runs. Outside a git checkout (a source tarball) it is "unknown".

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git").args(args).output().ok().filter(|output| output.status.success())?;
    Some(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

fn main() {
    let revision = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=GDR_REVISION={revision}");
    // Built again when HEAD moves: a commit moves the branch HEAD names.
    for reference in ["HEAD", &git(&["symbolic-ref", "-q", "HEAD"]).unwrap_or_default(), "packed-refs"] {
        // Only files that exist: cargo runs a build script whose watched file is missing
        // on every build, which would rebuild both binaries each time.
        if let Some(path) = (!reference.is_empty()).then(|| git(&["rev-parse", "--git-path", reference])).flatten()
            && std::path::Path::new(&path).exists()
        {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
