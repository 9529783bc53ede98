//! cgroup v2 nesting on a real cgroup2 hierarchy. These hosts run a hybrid layout
//! with cgroup2 at /sys/fs/cgroup/unified, so the test makes its own v2 situation: a
//! child cgroup there with a process in it, nested the way PID 1 nests its root.

#![allow(clippy::unwrap_used)]

use std::{fs, path::PathBuf, process::Command};

use supervisor::pid1::cgroup;

fn cgroup2_root() -> PathBuf {
    for candidate in ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"] {
        let path = PathBuf::from(candidate);
        if cgroup::detect(&path) == cgroup::Mode::V2 {
            return path;
        }
    }
    panic!("no cgroup2 hierarchy mounted at /sys/fs/cgroup or /sys/fs/cgroup/unified");
}

#[test]
fn nesting_moves_every_process_into_init() {
    let root = cgroup2_root().join(format!("supervisor-test-{}", std::process::id()));
    fs::create_dir(&root).unwrap();
    let mut sleepers: Vec<_> = (0..3).map(|_| Command::new("sleep").arg("30").spawn().unwrap()).collect();
    for sleeper in &sleepers {
        fs::write(root.join("cgroup.procs"), sleeper.id().to_string()).unwrap();
    }
    assert_eq!(cgroup::detect(&root), cgroup::Mode::V2);

    let nested = cgroup::nest_v2(&root, std::time::Duration::from_secs(5));

    let in_root = fs::read_to_string(root.join("cgroup.procs")).unwrap();
    let in_init = fs::read_to_string(root.join("init/cgroup.procs")).unwrap_or_default();
    // Clean up before asserting, so a failure leaves no cgroup behind.
    let parent_procs = root.parent().unwrap().join("cgroup.procs");
    for sleeper in &mut sleepers {
        let _ = fs::write(&parent_procs, sleeper.id().to_string());
        let _ = sleeper.kill();
        let _ = sleeper.wait();
    }
    let _ = fs::remove_dir(root.join("init"));
    let _ = fs::remove_dir(&root);

    let nested = nested.unwrap();
    assert_eq!(nested.moved, 3);
    assert!(in_root.trim().is_empty(), "processes left in the root: {in_root:?}");
    for sleeper in &sleepers {
        assert!(in_init.split_whitespace().any(|p| p == sleeper.id().to_string()), "{} not in init: {in_init:?}", sleeper.id());
    }
}

#[test]
fn a_v1_root_is_detected_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(cgroup::detect(dir.path()), cgroup::Mode::V1);
}
