//! The job-local dockerd: its socket, its command line (pure) and the settings it takes
//! ([`Bridge`]), its start through `supervisor activate` ([`ActivateArgs`]), its
//! readiness probe, its log.
//!
//! PID 1 binds dockerd's socket itself, before anything of the job runs, and hands it
//! to dockerd (`-H fd://`, systemd's socket activation): a `docker` call made while
//! dockerd is still starting waits in the socket's backlog instead of failing, so no
//! step has to wait for dockerd. Readiness is `GET /_ping` answering 200 `OK`.

use std::{
    ffi::OsString,
    os::unix::net::{UnixListener, UnixStream},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

/// dockerd's networking (`--docker-bridge`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
pub enum Bridge {
    /// dockerd's default bridge network (what jobs expect).
    Default,
    /// No bridge and no iptables rules (containers need --network none or host).
    None,
}

/// Where dockerd takes its API connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    /// The socket PID 1 bound and handed over as [`LISTEN_FD`].
    Activated,
    /// A socket dockerd binds itself: a rootless dockerd starts in namespaces of its own,
    /// behind rootlesskit, which keeps fd 3 for itself.
    Socket(PathBuf),
}

/// What dockerd is started with.
#[derive(Debug, Clone)]
pub struct DockerdConfig {
    pub dockerd: PathBuf,
    pub listen: Listen,
    pub storage_driver: &'static str,
    pub registry_mirrors: Vec<String>,
    pub data_root: PathBuf,
    pub exec_root: PathBuf,
    pub pidfile: PathBuf,
    pub bridge: Bridge,
    /// dockerd's own budget for stopping containers on SIGTERM.
    pub shutdown_timeout: Duration,
    pub mtu: Option<u32>,
}

/// dockerd's arguments: its socket (fd 3 from PID 1, or a path), job-local paths,
/// explicit cgroupfs driver (dockerd would pick systemd on v2 if /run/systemd/system
/// exists), the storage driver, the operator's mirrors, no TCP listener.
pub fn args(config: &DockerdConfig) -> Vec<OsString> {
    let host = match &config.listen {
        Listen::Activated => OsString::from("--host=fd://"),
        Listen::Socket(path) => arg_path("--host=unix://", path),
    };
    let mut args: Vec<OsString> = vec![
        host,
        arg_path("--data-root=", &config.data_root),
        arg_path("--exec-root=", &config.exec_root),
        arg_path("--pidfile=", &config.pidfile),
        "--exec-opt=native.cgroupdriver=cgroupfs".into(),
        format!("--storage-driver={}", config.storage_driver).into(),
        format!("--shutdown-timeout={}", config.shutdown_timeout.as_secs().max(1)).into(),
    ];
    args.extend(config.registry_mirrors.iter().map(|mirror| OsString::from(format!("--registry-mirror={mirror}"))));
    match config.bridge {
        Bridge::Default => {
            // Only the default bridge: `--default-network-opt` (per-job networks) needs
            // dockerd ≥ 24, and Debian's 20.10 refuses to start with it.
            if let Some(mtu) = config.mtu {
                args.push(format!("--mtu={mtu}").into());
            }
        }
        Bridge::None => {
            args.push("--bridge=none".into());
            args.push("--iptables=false".into());
            args.push("--ip6tables=false".into());
        }
    }
    args
}

/// dockerd's socket at `path`, owned by root and the docker group `group` (mode 0660),
/// a stale one removed first.
///
/// # Errors
/// When the old socket cannot be removed or the new one bound or given its owner.
pub fn bind_socket(path: &Path, group: u32) -> std::io::Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt as _;
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(error),
    }
    let listener = UnixListener::bind(path)?;
    std::os::unix::fs::chown(path, Some(0), Some(group))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
    Ok(listener)
}

/// The fd on which the started program finds its socket (systemd's first).
pub const LISTEN_FD: i32 = 3;

/// `supervisor activate PROGRAM ARGS…`: what [`activate`] execs.
#[derive(Debug, Clone, clap::Args)]
pub struct ActivateArgs {
    pub program: PathBuf,
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<OsString>,
}

/// `supervisor activate PROGRAM ARGS…`: becomes PROGRAM with [`LISTEN_FD`] announced
/// as systemd does. Hand-written because `LISTEN_PID` must be the pid of the process
/// that reads it, which PID 1 only learns after the fork — and after the fork a
/// `Command`'s environment is fixed — so this process sets it for itself and execs.
pub fn activate(args: &ActivateArgs) -> u8 {
    use std::os::unix::process::CommandExt as _;
    let error = std::process::Command::new(&args.program).args(&args.args).env("LISTEN_FDS", "1").env("LISTEN_PID", std::process::id().to_string()).exec();
    eprintln!("supervisor activate: cannot run {}: {error}", args.program.display());
    crate::exit::spawn_failure(&error)
}

fn arg_path(flag: &str, path: &Path) -> OsString {
    let mut arg = OsString::from(flag);
    arg.push(path.as_os_str());
    arg
}

/// The storage driver for a data root at `path`: overlay2, except on overlayfs (a
/// container's writable layer without a volume), which a user namespace's overlay
/// cannot stack on: there vfs, slow but working.
pub fn storage_driver_for(path: &Path) -> &'static str {
    match nix::sys::statfs::statfs(path) {
        Ok(fs) if fs.filesystem_type() == nix::sys::statfs::OVERLAYFS_SUPER_MAGIC => "vfs",
        _ => "overlay2",
    }
}

/// The MTU of the environment's uplink, for dockerd's bridges: CI pods on overlay
/// networks have MTUs below 1500, and a larger bridge MTU makes downloads hang.
pub fn uplink_mtu(sys_class_net: &Path) -> Option<u32> {
    let mtu: u32 = std::fs::read_to_string(sys_class_net.join("eth0/mtu")).ok()?.trim().parse().ok()?;
    (mtu > 0 && mtu < 1500).then_some(mtu)
}

#[derive(Debug, thiserror::Error)]
pub enum PingError {
    #[error("cannot connect to {socket}")]
    Connect {
        socket: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no answer from {socket}")]
    Io {
        socket: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("GET /_ping on {socket} answered {status_line:?}")]
    NotOk { socket: PathBuf, status_line: String },
}

/// One `GET /_ping` over the unix socket, bounded by `timeout` (synchronous: PID 1 has
/// no async runtime).
///
/// # Errors
/// Anything but `200` with body `OK`.
pub fn ping(socket: &Path, timeout: Duration) -> Result<Duration, PingError> {
    let started = Instant::now();
    let io = |source| PingError::Io { socket: socket.to_owned(), source };
    let stream = UnixStream::connect(socket).map_err(|source| PingError::Connect { socket: socket.to_owned(), source })?;
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    stream.set_write_timeout(Some(timeout)).map_err(io)?;
    let answer = crate::http1::get(stream, "docker", "/_ping").map_err(io)?;
    if answer.status() == Some(200) && answer.body.trim() == "OK" {
        Ok(started.elapsed())
    } else {
        Err(PingError::NotOk { socket: socket.to_owned(), status_line: answer.status_line })
    }
}

/// The last `lines` lines of a log file, for error messages and `doctor`.
pub fn log_tail(path: &Path, lines: usize) -> String {
    let Ok(text) = std::fs::read(path) else { return String::new() };
    let text = String::from_utf8_lossy(&text);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use super::*;

    fn config(bridge: Bridge, mtu: Option<u32>) -> DockerdConfig {
        DockerdConfig {
            dockerd: "dockerd".into(),
            listen: Listen::Activated,
            storage_driver: "overlay2",
            registry_mirrors: Vec::new(),
            data_root: "/var/lib/docker".into(),
            exec_root: "/var/run/docker".into(),
            pidfile: "/var/run/docker.pid".into(),
            bridge,
            shutdown_timeout: Duration::from_secs(10),
            mtu,
        }
    }

    fn strings(args: Vec<OsString>) -> Vec<String> {
        args.into_iter().map(|a| a.into_string().unwrap()).collect()
    }

    #[test]
    fn default_bridge_arguments() {
        assert_eq!(
            strings(args(&config(Bridge::Default, None))),
            [
                "--host=fd://",
                "--data-root=/var/lib/docker",
                "--exec-root=/var/run/docker",
                "--pidfile=/var/run/docker.pid",
                "--exec-opt=native.cgroupdriver=cgroupfs",
                "--storage-driver=overlay2",
                "--shutdown-timeout=10",
            ]
        );
    }

    #[test]
    fn rootless_socket_and_mirrors() {
        let mut rootless = config(Bridge::Default, None);
        rootless.listen = Listen::Socket("/run/user/2000/docker.sock".into());
        rootless.storage_driver = "vfs";
        rootless.registry_mirrors = vec!["http://10.0.0.1:5000".into(), "https://mirror.example".into()];
        let args = strings(args(&rootless));
        assert_eq!(args[0], "--host=unix:///run/user/2000/docker.sock");
        assert!(args.contains(&"--storage-driver=vfs".to_owned()));
        assert_eq!(
            args.iter().filter(|a| a.starts_with("--registry-mirror=")).collect::<Vec<_>>(),
            ["--registry-mirror=http://10.0.0.1:5000", "--registry-mirror=https://mirror.example"]
        );
    }

    #[test]
    fn mtu_and_no_bridge() {
        let with_mtu = strings(args(&config(Bridge::Default, Some(1450))));
        assert!(with_mtu.contains(&"--mtu=1450".to_owned()));
        assert!(!with_mtu.iter().any(|a| a.starts_with("--default-network-opt")));
        let none = strings(args(&config(Bridge::None, Some(1450))));
        assert!(none.contains(&"--bridge=none".to_owned()));
        assert!(none.contains(&"--iptables=false".to_owned()));
        assert!(!none.iter().any(|a| a.starts_with("--mtu")));
    }

    #[test]
    fn ping_against_a_fake_socket() {
        use std::os::unix::net::UnixListener;
        let dir = std::env::temp_dir().join(format!("ping-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (answer, ok) in [
            ("HTTP/1.1 200 OK\r\nApi-Version: 1.41\r\n\r\nOK", true),
            ("HTTP/1.1 500 Internal Server Error\r\n\r\nOK", false),
            ("HTTP/1.1 200 OK\r\n\r\nnot ok", false),
        ] {
            let socket = dir.join("d.sock");
            let _ = std::fs::remove_file(&socket);
            let listener = UnixListener::bind(&socket).unwrap();
            let server = std::thread::spawn(move || {
                let (mut stream, _) = listener.accept().unwrap();
                let mut request = [0u8; 256];
                let n = stream.read(&mut request).unwrap();
                assert!(String::from_utf8_lossy(&request[..n]).starts_with("GET /_ping HTTP/1.0"));
                stream.write_all(answer.as_bytes()).unwrap();
            });
            assert_eq!(ping(&socket, Duration::from_secs(2)).is_ok(), ok, "{answer:?}");
            server.join().unwrap();
        }
        assert!(matches!(ping(&dir.join("missing.sock"), Duration::from_secs(1)), Err(PingError::Connect { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn mtu_detection() {
        let dir = std::env::temp_dir().join(format!("mtu-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("eth0")).unwrap();
        for (text, want) in [("1450\n", Some(1450)), ("1500\n", None), ("9000\n", None), ("x", None)] {
            std::fs::write(dir.join("eth0/mtu"), text).unwrap();
            assert_eq!(uplink_mtu(&dir), want, "{text:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
