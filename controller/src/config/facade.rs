//! `[facade]` and `[http]`: how environments reach the controller, and where it serves
//! its metrics and health.

use std::{path::PathBuf, time::Duration};

use serde::Deserialize;

use super::PoolConfig;
use crate::setting::{Problems, duration};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FacadeConfig {
    /// File with at least 32 bytes of HMAC key for assignment capabilities (mode 0600).
    pub capability_key_file: PathBuf,
    #[serde(default = "default_capability_ttl", with = "duration")]
    pub capability_ttl: Duration,
    /// Where every docker environment gets its own facade socket
    /// (`<dir>/<environment>/facade.sock`, the directory mounted into that environment
    /// alone), e.g. `/run/gitea-dynamic-runner/environments`.
    pub environment_socket_dir: Option<PathBuf>,
    /// mTLS listener for environments with SPIFFE, e.g. `0.0.0.0:9443`.
    pub listen: Option<String>,
    /// Development mode: a plain-TCP listener (HTTP/2, no TLS) authenticated by the
    /// capability alone, for environments that cannot mount the unix socket (sandbox
    /// VMs) where no SPIRE runs. Only a loopback or private address, e.g.
    /// `10.0.0.5:9444`; environments then get `url = "http://10.0.0.5:9444"`.
    pub insecure_listen: Option<String>,
    /// The Workload API of the controller itself (for its own SVID).
    pub spiffe_endpoint_socket: Option<String>,
    /// The facade's URL and SPIFFE ID as Pods and sandboxes see them (docker
    /// environments use their own socket).
    pub url: Option<String>,
    pub spiffe_id: Option<String>,
    /// SPIFFE_ENDPOINT_SOCKET inside environments; set means environments wait for
    /// their job's SVID before claiming.
    pub environment_spiffe_endpoint_socket: Option<String>,
}

fn default_capability_ttl() -> Duration {
    Duration::from_secs(24 * 3600)
}

impl FacadeConfig {
    /// Checks the facade against the placements it serves (`pools`).
    pub fn validate(&self, pools: &[PoolConfig], problems: &mut Problems) {
        let socket_placements = crate::facade::sockets::PLACEMENTS;
        if self.environment_socket_dir.is_none() && self.listen.is_none() && self.insecure_listen.is_none() {
            problems.add("facade", "set facade.environment_socket_dir (docker), facade.listen (SPIFFE mTLS) or facade.insecure_listen (development mode)");
        }
        match &self.environment_socket_dir {
            None if pools.iter().any(|p| socket_placements.contains(&p.placement)) => problems.add(
                "facade.environment_socket_dir",
                "pool container.docker needs it: each container gets its own facade socket there, e.g. \"/run/gitea-dynamic-runner/environments\"",
            ),
            Some(dir) if !dir.is_absolute() => problems.add("facade.environment_socket_dir", format!("{} must be an absolute path", dir.display())),
            _ => {}
        }
        if self.url.is_none() && pools.iter().any(|p| !socket_placements.contains(&p.placement)) {
            problems.add("facade.url", "required for Pods and sandboxes: the https:// (SPIFFE mTLS) or http:// (development mode) URL they reach");
        }
        if let Some(listen) = &self.insecure_listen {
            match listen.parse::<std::net::SocketAddr>() {
                Ok(address) => {
                    if let Err(message) = contract::facade::insecure_address(address) {
                        problems.add("facade.insecure_listen", message);
                    }
                }
                Err(_) => problems.add("facade.insecure_listen", format!("{listen:?} must be a literal ip:port, e.g. 10.0.0.5:9444")),
            }
        }
        if let Some(url) = &self.url
            && let Err(message) = contract::facade::FacadeUrl::parse(url)
        {
            problems.add("facade.url", message);
        }
        if self.listen.is_some() && self.spiffe_endpoint_socket.is_none() {
            problems.add("facade.spiffe_endpoint_socket", "required with facade.listen (the mTLS listener needs the controller's SVID)");
        }
        if self.capability_ttl < Duration::from_secs(60) {
            problems.add("facade.capability_ttl", "must be at least 1m");
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// `/metrics`, `/healthz`, `/readyz`.
    pub listen: String,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig { listen: "127.0.0.1:9100".into() }
    }
}
