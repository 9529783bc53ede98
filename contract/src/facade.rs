//! How an environment reaches the controller's facade (`CI_RUNNER_FACADE_URL`), for
//! both sides: the controller validates the listener it is asked to open and the URL it
//! hands out, the supervisor the URL it is given — with the same rules.
//!
//! - `unix:///path`: a socket mounted into the environment (docker driver);
//!   authenticated by the assignment capability.
//! - `https://host:port`: TLS with SPIFFE X.509 SVIDs on both sides; the supervisor
//!   accepts only the facade's exact SPIFFE ID and the facade checks the job's.
//! - `http://ip:port`: **development mode** for environments that cannot mount a socket
//!   (a sandbox VM) on hosts without SPIRE: plain HTTP/2, authenticated by the capability
//!   alone, so only literal loopback or private addresses are allowed — never a name
//!   that could resolve elsewhere, never a public address.

use std::net::{IpAddr, SocketAddr};

/// Where the docker driver mounts an environment's own facade directory: the host's
/// `<facade.environment_socket_dir>/<environment>`, holding the socket the controller
/// serves for that environment alone (and, until PID 1 has read it, the capability file).
/// A directory and not the socket file: a restarted controller binds a new socket (a new
/// inode) that a mounted file would never show.
pub const ENVIRONMENT_DIR: &str = "/run/gitea-dynamic-runner";
/// The socket's name inside [`ENVIRONMENT_DIR`].
pub const SOCKET_NAME: &str = "facade.sock";
/// The capability file's name inside [`ENVIRONMENT_DIR`].
pub const CAPABILITY_NAME: &str = "capability";

/// `CI_RUNNER_FACADE_URL` of an environment with its own socket.
pub fn environment_socket_url() -> String {
    format!("unix://{ENVIRONMENT_DIR}/{SOCKET_NAME}")
}

/// A parsed facade URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FacadeUrl {
    Unix(String),
    /// `host:port` as written (the server is verified by its SPIFFE ID, not its name).
    Https(String),
    /// Development mode: plain HTTP/2 to a loopback or private address.
    InsecureHttp(SocketAddr),
}

impl FacadeUrl {
    /// # Errors
    /// What is wrong with `url`, and what to write instead.
    pub fn parse(url: &str) -> Result<FacadeUrl, String> {
        if let Some(path) = url.strip_prefix("unix://") {
            if !path.starts_with('/') || path.len() < 2 {
                return Err(format!("{url:?} must be unix:///absolute/path"));
            }
            return Ok(FacadeUrl::Unix(path.to_owned()));
        }
        if let Some(authority) = url.strip_prefix("https://") {
            let authority = authority.trim_end_matches('/');
            if authority.is_empty() || authority.contains('/') || authority.rsplit_once(':').is_none_or(|(_, port)| port.parse::<u16>().is_err()) {
                return Err(format!("{url:?} must be https://host:port"));
            }
            return Ok(FacadeUrl::Https(authority.to_owned()));
        }
        if let Some(authority) = url.strip_prefix("http://") {
            let address: SocketAddr = authority
                .trim_end_matches('/')
                .parse()
                .map_err(|_| format!("{url:?}: plain http facades (development mode) must name a literal IP address and port, e.g. http://10.0.0.5:9444"))?;
            insecure_address(address)?;
            return Ok(FacadeUrl::InsecureHttp(address));
        }
        Err(format!("{url:?} must be unix:///path, https://host:port (SPIFFE mTLS) or http://private-ip:port (development mode)"))
    }
}

/// Whether plain-HTTP facades may use `address`: loopback or private (RFC 1918, IPv6
/// unique local), and a concrete address (not 0.0.0.0 / ::, which would listen on
/// public interfaces too).
///
/// # Errors
/// Why the address is refused.
pub fn insecure_address(address: SocketAddr) -> Result<(), String> {
    let ip = address.ip();
    if ip.is_unspecified() {
        return Err(format!("{ip} listens on every interface, public ones included: name the private address the environments reach"));
    }
    let private = match ip {
        IpAddr::V4(v4) => v4.is_loopback() || v4.is_private(),
        IpAddr::V6(v6) => v6.is_loopback() || (v6.segments()[0] & 0xfe00) == 0xfc00,
    };
    if !private {
        return Err(format!(
            "{ip} is not a loopback or private address: the development-mode facade is authenticated by the capability alone and must never be \
             reachable from outside; use the SPIFFE mTLS listener (https) instead"
        ));
    }
    if address.port() == 0 {
        return Err(format!("{address} has no port"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_parsed_or_refused_with_the_reason() {
        let ok: &[(&str, FacadeUrl)] = &[
            ("unix:///run/gdr/facade.sock", FacadeUrl::Unix("/run/gdr/facade.sock".into())),
            ("https://controller.ci:9443", FacadeUrl::Https("controller.ci:9443".into())),
            ("https://10.0.0.5:9443/", FacadeUrl::Https("10.0.0.5:9443".into())),
            ("http://127.0.0.1:9444", FacadeUrl::InsecureHttp("127.0.0.1:9444".parse().unwrap())),
            ("http://10.213.4.1:9444/", FacadeUrl::InsecureHttp("10.213.4.1:9444".parse().unwrap())),
            ("http://172.17.0.1:1", FacadeUrl::InsecureHttp("172.17.0.1:1".parse().unwrap())),
            ("http://192.168.1.2:9444", FacadeUrl::InsecureHttp("192.168.1.2:9444".parse().unwrap())),
            ("http://[fd00::1]:9444", FacadeUrl::InsecureHttp("[fd00::1]:9444".parse().unwrap())),
            ("http://[::1]:9444", FacadeUrl::InsecureHttp("[::1]:9444".parse().unwrap())),
        ];
        for (url, want) in ok {
            assert_eq!(FacadeUrl::parse(url).as_ref(), Ok(want), "{url}");
        }
        let refused: &[(&str, &str)] = &[
            ("unix://relative.sock", "absolute"),
            ("https://controller", "https://host:port"),
            ("https://controller:port", "https://host:port"),
            ("http://controller:9444", "literal IP"),
            ("http://8.8.8.8:9444", "not a loopback or private"),
            ("http://172.32.0.1:9444", "not a loopback or private"),
            ("http://[2001:db8::1]:9444", "not a loopback or private"),
            ("http://0.0.0.0:9444", "every interface"),
            ("http://10.0.0.1:0", "no port"),
            ("tcp://10.0.0.1:9444", "must be unix"),
            ("", "must be unix"),
        ];
        for (url, reason) in refused {
            let error = FacadeUrl::parse(url).expect_err(url);
            assert!(error.contains(reason), "{url}: {error}");
        }
    }
}
