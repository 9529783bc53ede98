//! The identity wait against the real SPIRE server and agent (built by
//! scripts/install-test-peers): join-token node attestation, the unix workload
//! attestor, and the registration entry (`unix:uid:2000`) created only after the
//! supervisor started waiting. The job must start once the entry reaches the agent.

#![allow(clippy::unwrap_used)]

mod common;

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use common::*;

const TRUST_DOMAIN: &str = "example.org";
const EXPECTED: &str = "spiffe://example.org/ci/owner/repo/build";
const AGENT_ALIAS: &str = "spiffe://example.org/ci-node";

fn peer(name: &str) -> PathBuf {
    let cache = std::env::var_os("PEERS_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/gitea-dynamic-runner/peers"));
    let path = cache.join("bin").join(name);
    assert!(path.exists(), "{} is not installed: run scripts/install-test-peers", path.display());
    path
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn until_ok(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn spire_server(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(peer("spire-server")).args(args).arg("-socketPath").arg(dir.join("server.sock")).output().unwrap()
}

#[test]
fn supervisor_proceeds_once_the_entry_for_uid_2000_is_registered() {
    let dir = scratch();
    let d = dir.path();
    let port = free_port();
    fs::write(
        d.join("server.conf"),
        format!(
            r#"server {{
  bind_address = "127.0.0.1"
  bind_port = "{port}"
  socket_path = "{sock}"
  trust_domain = "{TRUST_DOMAIN}"
  data_dir = "{data}"
  log_level = "WARN"
  experimental {{
    cache_reload_interval = "1s"
  }}
}}
plugins {{
  DataStore "sql" {{
    plugin_data {{
      database_type = "sqlite3"
      connection_string = "{db}"
    }}
  }}
  NodeAttestor "join_token" {{
    plugin_data {{}}
  }}
  KeyManager "memory" {{
    plugin_data {{}}
  }}
}}
"#,
            sock = d.join("server.sock").display(),
            data = d.join("server-data").display(),
            db = d.join("datastore.sqlite3").display(),
        ),
    )
    .unwrap();
    let _server = Killed(Command::new(peer("spire-server")).args(["run", "-config"]).arg(d.join("server.conf")).stdout(Stdio::null()).spawn().unwrap());
    until_ok("spire-server to be healthy", Duration::from_secs(60), || spire_server(d, &["healthcheck"]).status.success());
    let token = spire_server(d, &["token", "generate", "-spiffeID", AGENT_ALIAS, "-ttl", "600"]);
    assert!(token.status.success(), "{}", String::from_utf8_lossy(&token.stderr));
    let token = String::from_utf8(token.stdout).unwrap();
    let token = token.trim().strip_prefix("Token: ").unwrap_or(token.trim()).to_owned();

    let agent_socket = d.join("agent.sock");
    fs::write(
        d.join("agent.conf"),
        format!(
            r#"agent {{
  data_dir = "{data}"
  log_level = "WARN"
  server_address = "127.0.0.1"
  server_port = "{port}"
  socket_path = "{sock}"
  trust_domain = "{TRUST_DOMAIN}"
  insecure_bootstrap = true
  experimental {{
    sync_interval = "1s"
  }}
}}
plugins {{
  NodeAttestor "join_token" {{
    plugin_data {{}}
  }}
  KeyManager "memory" {{
    plugin_data {{}}
  }}
  WorkloadAttestor "unix" {{
    plugin_data {{}}
  }}
}}
"#,
            data = d.join("agent-data").display(),
            sock = agent_socket.display(),
        ),
    )
    .unwrap();
    let _agent = Killed(
        Command::new(peer("spire-agent"))
            .args(["run", "-config"])
            .arg(d.join("agent.conf"))
            .args(["-joinToken", &token])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    until_ok("spire-agent to be healthy", Duration::from_secs(60), || {
        Command::new(peer("spire-agent")).args(["healthcheck", "-socketPath"]).arg(&agent_socket).output().unwrap().status.success()
    });

    let started = d.join("started");
    let mut supervisor = Killed(
        run_as_subreaper(
            &d.join("state"),
            &["--identity=true", &format!("--spiffe-id={EXPECTED}"), &format!("--spiffe-endpoint=unix://{}", agent_socket.display()), "--identity-timeout=90s"],
            &format!("touch {}", started.display()),
        )
        .stdin(Stdio::null())
        .spawn()
        .unwrap(),
    );
    // The supervisor is waiting: SPIRE has no entry for uid 2000 yet.
    std::thread::sleep(Duration::from_secs(2));
    assert!(!started.exists(), "the job started before any entry existed");
    assert!(supervisor.0.try_wait().unwrap().is_none(), "the supervisor gave up early");

    let entry = spire_server(d, &["entry", "create", "-parentID", AGENT_ALIAS, "-spiffeID", EXPECTED, "-selector", "unix:uid:2000"]);
    assert!(entry.status.success(), "{}", String::from_utf8_lossy(&entry.stderr));
    let registered = Instant::now();
    let status = wait_with_timeout(&mut supervisor.0, Duration::from_secs(90));
    assert!(status.success(), "{status}");
    assert!(started.exists());
    eprintln!("SPIRE: the job started {:?} after the entry was created", registered.elapsed());
}
