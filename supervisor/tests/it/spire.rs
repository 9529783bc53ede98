//! The identity wait against the real SPIRE server and agent (built by
//! scripts/install test-peers): join-token node attestation, the unix workload
//! attestor, and the registration entry (`unix:uid:2000`) created only after the
//! supervisor started waiting. The job must start once the entry reaches the agent.

#![allow(clippy::unwrap_used)]

use std::{
    process::Stdio,
    time::{Duration, Instant},
};

use crate::common::*;
use testkit::{
    KillOnDrop,
    spire::{SpireAgent, SpireServer},
};

const TRUST_DOMAIN: &str = "example.org";
const EXPECTED: &str = "spiffe://example.org/ci/owner/repo/build";
const AGENT_ALIAS: &str = "spiffe://example.org/ci-node";

#[test]
fn supervisor_proceeds_once_the_entry_for_uid_2000_is_registered() {
    let dir = scratch();
    let d = dir.path();
    let server = SpireServer::start(TRUST_DOMAIN);
    let agent = SpireAgent::start(&server, AGENT_ALIAS);
    let agent_socket = agent.socket();

    let started = d.join("started");
    let log = d.join("supervisor.log");
    let mut supervisor = KillOnDrop(
        run_as_subreaper(
            &d.join("state"),
            &["--identity=true", &format!("--spiffe-id={EXPECTED}"), &format!("--spiffe-endpoint=unix://{}", agent_socket.display()), "--identity-timeout=90s"],
            &format!("touch {}", started.display()),
        )
        .stdin(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap(),
    );
    let logged = || std::fs::read_to_string(&log).unwrap_or_default();
    // The supervisor is waiting: SPIRE has no entry for uid 2000 yet, which the agent was
    // told (and logged) before the job could start.
    testkit::wait_until_blocking("the supervisor was refused an identity", Duration::from_secs(60), || {
        logged().contains("waiting for identity") || supervisor.try_wait().unwrap().is_some()
    });
    assert!(!started.exists(), "the job started before any entry existed");
    assert!(supervisor.try_wait().unwrap().is_none(), "the supervisor gave up early:\n{}", logged());

    let entry = server.cli(&["entry", "create", "-parentID", AGENT_ALIAS, "-spiffeID", EXPECTED, "-selector", "unix:uid:2000"]);
    assert!(entry.status.success(), "{}", String::from_utf8_lossy(&entry.stderr));
    let registered = Instant::now();
    let status = testkit::wait_for_exit(&mut supervisor, Duration::from_secs(90), "the supervisor exits");
    assert!(status.success(), "{status}\n{}", logged());
    assert!(started.exists());
    eprintln!("SPIRE: the job started {:?} after the entry was created", registered.elapsed());
}
