//! The real supervisor binary as PID 1 of a new PID namespace (and as a subreaper):
//! orphans reaped, forwarded signals arrive, exit codes, the drain deadline, and
//! cleanup after SIGTERM. Runs as root (the job runs as uid 2000).

#![allow(clippy::unwrap_used)]

use std::{
    fs,
    time::{Duration, Instant},
};

use crate::common::*;
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};
use testkit::{wait_for_exit, wait_until_blocking};

#[test]
fn exit_code_is_the_jobs() {
    let dir = scratch();
    for (job, code) in [("exit 0", 0), ("exit 42", 42), ("exit 255", 255)] {
        let status = run_as_pid1(&dir.path().join("state"), &[], job).status().unwrap();
        assert_eq!(status.code(), Some(code), "{job}");
    }
}

#[test]
fn death_by_signal_is_128_plus_n() {
    let dir = scratch();
    for (signal, code) in [("KILL", 137), ("TERM", 143), ("SEGV", 139)] {
        let job = format!("kill -{signal} $$");
        let status = run_as_pid1(&dir.path().join("state"), &[], &job).status().unwrap();
        assert_eq!(status.code(), Some(code), "{job}");
    }
}

#[test]
fn job_runs_as_the_runner_uid_with_the_docker_group() {
    let dir = scratch();
    let out = dir.path().join("id");
    let job = format!("id -u > {0}; id -g >> {0}; id -G >> {0}", out.display());
    let status = run_as_pid1(&dir.path().join("state"), &[], &job).status().unwrap();
    assert!(status.success());
    let lines: Vec<String> = fs::read_to_string(&out).unwrap().lines().map(str::to_owned).collect();
    assert_eq!(lines[0], "2000");
    assert_eq!(lines[1], "2000");
    let groups: Vec<&str> = lines[2].split_whitespace().collect();
    assert!(groups.contains(&"2001"), "supplementary groups {groups:?}");
    assert!(!groups.contains(&"0"), "root group kept: {groups:?}");
}

#[test]
fn orphaned_grandchildren_are_reaped() {
    let dir = scratch();
    let out = dir.path().join("orphans");
    // Each `sh -c '… &'` exits at once, so its sleep is re-parented to PID 1 and exits
    // 50 ms later. Its /proc entry disappears only once it is reaped (a zombie keeps it),
    // so waiting for every entry to go proves each one both ended and was reaped.
    let job = format!(
        "for i in 1 2 3 4 5 6 7 8; do sh -c 'sleep 0.05 & echo $!' >> {out}.pids; done; \
         for p in $(cat {out}.pids); do n=0; \
           while [ -e /proc/$p ]; do n=$((n+1)); if [ $n -gt 200 ]; then echo \"$p left: $(cat /proc/$p/stat)\" >> {out}; break; fi; sleep 0.025; done; \
         done; echo \"$(wc -l < {out}.pids) gone\" >> {out}",
        out = out.display()
    );
    let status = run_as_pid1(&dir.path().join("state"), &[], &job).status().unwrap();
    assert!(status.success(), "{status}");
    assert_eq!(fs::read_to_string(&out).unwrap().trim(), "8 gone", "orphans were not reaped");
}

#[test]
fn every_forwarded_signal_reaches_the_job() {
    let dir = scratch();
    let log = dir.path().join("signals");
    let ready = dir.path().join("ready");
    let job = format!(
        "for s in INT HUP QUIT USR1 USR2 WINCH; do trap \"echo $s >> {log}\" $s; done; \
         trap 'echo TERM >> {log}; exit 7' TERM; touch {ready}; \
         while :; do sleep 0.02; done",
        log = log.display(),
        ready = ready.display()
    );
    let mut child = quiet(&mut run_as_pid1(&dir.path().join("state"), &[], &job)).spawn().unwrap();
    wait_until_blocking("the job to start", Duration::from_secs(20), || ready.exists());
    let supervisor = child_of(child.id()).expect("unshare has no child");
    for (signal, name) in [
        (Signal::SIGINT, "INT"),
        (Signal::SIGHUP, "HUP"),
        (Signal::SIGQUIT, "QUIT"),
        (Signal::SIGUSR1, "USR1"),
        (Signal::SIGUSR2, "USR2"),
        (Signal::SIGWINCH, "WINCH"),
        (Signal::SIGTERM, "TERM"),
    ] {
        kill(Pid::from_raw(supervisor as i32), signal).unwrap();
        wait_until_blocking(&format!("{name} to arrive"), Duration::from_secs(10), || fs::read_to_string(&log).unwrap_or_default().lines().any(|l| l == name));
    }
    let status = wait_for_exit(&mut child, Duration::from_secs(20), "the supervisor exits");
    // The job exits 7 from its TERM trap; the supervisor passes that on.
    assert_eq!(status.code(), Some(7));
    let seen = fs::read_to_string(&log).unwrap();
    assert_eq!(seen.lines().collect::<Vec<_>>(), ["INT", "HUP", "QUIT", "USR1", "USR2", "WINCH", "TERM"]);
}

#[test]
fn drain_deadline_is_honoured_when_the_job_ignores_sigterm() {
    let dir = scratch();
    let ready = dir.path().join("ready");
    let job = format!("trap '' TERM; touch {}; while :; do sleep 0.05; done", ready.display());
    let mut child = quiet(&mut run_as_pid1(&dir.path().join("state"), &["--drain-timeout=2s"], &job)).spawn().unwrap();
    wait_until_blocking("the job to start", Duration::from_secs(20), || ready.exists());
    let supervisor = child_of(child.id()).unwrap();
    let sent = Instant::now();
    kill(Pid::from_raw(supervisor as i32), Signal::SIGTERM).unwrap();
    let status = wait_for_exit(&mut child, Duration::from_secs(20), "the supervisor exits");
    let took = sent.elapsed();
    // Half of the drain goes to the job, then SIGKILL: the agent dies of signal 9.
    assert_eq!(status.code(), Some(137), "{status}");
    assert!(took >= Duration::from_millis(900), "killed too early: {took:?}");
    assert!(took < Duration::from_secs(3), "drain overran its 2 s deadline: {took:?}");
}

#[test]
fn sigterm_cleans_up_escaped_descendants_as_a_subreaper() {
    let dir = scratch();
    let pidfile = dir.path().join("escaped");
    // setsid: the daemon leaves the job's process group, so only a tree kill finds it.
    let job = format!("setsid sleep 1000 & echo $! > {0}.tmp; mv {0}.tmp {0}; while :; do sleep 0.05; done", pidfile.display());
    let mut child = quiet(&mut run_as_subreaper(&dir.path().join("state"), &["--drain-timeout=3s"], &job)).spawn().unwrap();
    wait_until_blocking("the daemon to start", Duration::from_secs(20), || pidfile.exists());
    let escaped: u32 = fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
    assert!(alive(escaped));
    kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).unwrap();
    let status = wait_for_exit(&mut child, Duration::from_secs(20), "the supervisor exits");
    assert_eq!(status.code(), Some(143), "{status}");
    assert!(!alive(escaped), "the escaped daemon {escaped} outlived the supervisor");
}

#[test]
fn a_missing_job_command_exits_127() {
    let dir = scratch();
    let status = std::process::Command::new(SUPERVISOR)
        .args(["run", "--identity=false", "--docker=false"])
        .arg(format!("--state-dir={}", dir.path().join("state").display()))
        .args(["--", "/nonexistent/job"])
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(127));
}
