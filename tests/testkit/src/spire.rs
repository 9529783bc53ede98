//! A REAL SPIRE server and agent (built from pinned sources by `scripts/install test-peers`
//! as `$PEERS_CACHE/bin/spire-server` and `spire-agent`): SQLite datastore, join-token
//! node attestation, the unix workload attestor, short sync intervals; each in its own
//! temporary directory, killed when dropped.

#![allow(clippy::missing_panics_doc)]

use std::{
    path::PathBuf,
    process::{Child, Command, Output, Stdio},
    time::Duration,
};

use crate::peer;

pub struct SpireServer {
    child: Child,
    dir: tempfile::TempDir,
    port: u16,
    pub trust_domain: String,
}

impl Drop for SpireServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl SpireServer {
    pub fn start(trust_domain: &str) -> SpireServer {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let port = crate::free_local_port();
        std::fs::write(
            d.join("server.conf"),
            format!(
                r#"server {{
  bind_address = "127.0.0.1"
  bind_port = "{port}"
  socket_path = "{sock}"
  trust_domain = "{trust_domain}"
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
        let log = std::fs::File::create(d.join("server.log")).unwrap();
        let child = Command::new(peer("spire-server")).args(["run", "-config"]).arg(d.join("server.conf")).stdout(Stdio::null()).stderr(log).spawn().unwrap();
        let server = SpireServer { child, dir, port, trust_domain: trust_domain.to_owned() };
        crate::wait_until_blocking("spire-server is healthy", Duration::from_secs(60), || server.cli(&["healthcheck"]).status.success());
        server
    }

    /// The admin API socket (`server.socket_path`).
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("server.sock")
    }

    /// `spire-server <args> -socketPath <socket>`.
    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(peer("spire-server")).args(args).arg("-socketPath").arg(self.socket()).output().unwrap()
    }

    /// A join token whose agent gets `alias` as its SPIFFE ID.
    pub fn join_token(&self, alias: &str) -> String {
        let out = self.cli(&["token", "generate", "-spiffeID", alias, "-ttl", "600"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let token = String::from_utf8(out.stdout).unwrap();
        token.trim().strip_prefix("Token: ").unwrap_or(token.trim()).to_owned()
    }

    /// Every registration entry, as `spire-server entry show -output json` prints them.
    pub fn entries(&self) -> Vec<serde_json::Value> {
        let out = self.cli(&["entry", "show", "-output", "json"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        shown["entries"].as_array().cloned().unwrap_or_default()
    }

    /// The entry with this id, if any.
    pub fn entry(&self, id: &str) -> Option<serde_json::Value> {
        self.entries().into_iter().find(|e| e["id"] == id)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// Kills the server (its socket stays, refusing connections).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct SpireAgent {
    child: Child,
    dir: tempfile::TempDir,
}

impl Drop for SpireAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl SpireAgent {
    /// An agent attested with a join token for `alias`, with the unix workload attestor;
    /// its Workload API socket is in a directory of its own (to be mounted elsewhere).
    pub fn start(server: &SpireServer, alias: &str) -> SpireAgent {
        SpireAgent::start_with(server, alias, "")
    }

    /// [`SpireAgent::start`] with more plugin blocks (HCL), e.g. the `k8s` workload
    /// attestor for Pods on this node.
    pub fn start_with(server: &SpireServer, alias: &str, more_plugins: &str) -> SpireAgent {
        let token = server.join_token(alias);
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir_all(d.join("public")).unwrap();
        // Workloads of other users (the supervisor's uid 2000) must reach the socket.
        for path in [d, &d.join("public")] {
            std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        }
        std::fs::write(
            d.join("agent.conf"),
            format!(
                r#"agent {{
  data_dir = "{data}"
  log_level = "WARN"
  server_address = "127.0.0.1"
  server_port = "{port}"
  socket_path = "{sock}"
  trust_domain = "{trust_domain}"
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
    plugin_data {{
      discover_workload_path = true
    }}
  }}
{more_plugins}
}}
"#,
                data = d.join("agent-data").display(),
                port = server.port,
                sock = d.join("public/agent.sock").display(),
                trust_domain = server.trust_domain,
            ),
        )
        .unwrap();
        let log = std::fs::File::create(d.join("agent.log")).unwrap();
        let child = Command::new(peer("spire-agent"))
            .args(["run", "-config"])
            .arg(d.join("agent.conf"))
            .args(["-joinToken", &token])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let agent = SpireAgent { child, dir };
        crate::wait_until_blocking("spire-agent is healthy", Duration::from_secs(60), || {
            Command::new(peer("spire-agent")).args(["healthcheck", "-socketPath"]).arg(agent.socket()).output().unwrap().status.success()
        });
        agent
    }

    /// The Workload API socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("public/agent.sock")
    }

    /// The directory holding only the socket (what an environment mounts).
    pub fn socket_dir(&self) -> PathBuf {
        self.dir.path().join("public")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }
}
