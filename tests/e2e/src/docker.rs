//! The Docker host of the tests: a real dockerd (Debian's) started once per test binary
//! with its own bridge and subnet, so environment containers reach the host — the real
//! Gitea listens on the bridge's address — and several test binaries or a leftover
//! daemon never collide. It stops when the test binary exits (atexit), taking its
//! containers with it; every test still removes its own environments and checks that.
//!
//! A subnet is never shared, not even with a bridge some earlier binary left behind: with
//! two interfaces on one /24 the kernel routes replies to containers out of the older
//! one, and every container loses the host (a CI run's sandboxes could not reach the
//! facade for two minutes that way). So the bridge is chosen under a lock, on a /24 that
//! no interface uses, and bridges whose owner is gone are deleted first.

use std::{collections::HashSet, net::Ipv4Addr, path::Path, sync::Mutex};

use testkit::dockerd::{Dockerd, Network};

use crate::run;

/// The e2e tests' Docker host: testkit's dockerd on this binary's bridge (its socket,
/// CLI and log come from [`Dockerd`] through `Deref`), and the runner images loaded into it.
pub struct HostDocker {
    dockerd: Dockerd,
    /// The host's address on the bridge: what containers reach the host at.
    pub bridge_ip: Ipv4Addr,
    bridge: String,
    loaded: Mutex<HashSet<String>>,
}

static HOST: crate::Shared<HostDocker> = crate::Shared::new();

/// The shared Docker host, started on first use.
pub fn host() -> &'static HostDocker {
    HOST.get_or_start(HostDocker::start)
}

impl std::ops::Deref for HostDocker {
    type Target = Dockerd;
    fn deref(&self) -> &Dockerd {
        &self.dockerd
    }
}

impl HostDocker {
    fn start() -> HostDocker {
        let (bridge, bridge_ip) = claim_bridge();
        let dockerd = Dockerd::start(Network::Bridge(bridge.clone()));
        HostDocker { dockerd, bridge_ip, bridge, loaded: Mutex::new(HashSet::new()) }
    }

    /// The runner image of `variant`, built (cached) and loaded into this daemon once;
    /// returns its tag.
    pub fn image(&self, variant: &str) -> String {
        let (tag, tar) = crate::paths::image(variant);
        let mut loaded = self.loaded.lock().unwrap();
        if !loaded.contains(&tag) {
            let output = self.docker(&["load", "-i", &tar.display().to_string()]);
            assert!(output.status.success(), "docker load {}: {}", tar.display(), String::from_utf8_lossy(&output.stderr));
            loaded.insert(tag.clone());
        }
        tag
    }
}

impl crate::SharedPeer for HostDocker {
    fn stop(&self) {
        self.dockerd.stop();
        release_bridge(&self.bridge);
    }
}

/// Where each binary's bridge records its owner (pid and start time), so that the next
/// binary can tell a leftover bridge from one in use.
const BRIDGES: &str = "/tmp/gdr-e2e-bridges";

/// Creates this binary's bridge on a /24 of 10.213.0.0/16 that no interface uses, after
/// deleting the bridges whose owner is gone; returns its name and the host's address on it.
fn claim_bridge() -> (String, Ipv4Addr) {
    std::fs::create_dir_all(BRIDGES).unwrap();
    let lock = std::fs::File::create(Path::new(BRIDGES).join(".lock")).unwrap();
    // Two binaries (a test and a bench) must not pick the same free subnet at once.
    lock.lock().unwrap();
    for bridge in bridges() {
        let owner = std::fs::read_to_string(Path::new(BRIDGES).join(&bridge)).unwrap_or_default();
        if !owner_alive(&owner) {
            release_bridge(&bridge);
        }
    }
    let pid = std::process::id();
    let used = subnets_in_use();
    let third = (0..250u32).map(|i| u8::try_from((pid + i) % 250).unwrap()).find(|third| !used.contains(third));
    let third = third.expect("every 10.213.x.0/24 is in use by an interface: delete the stale ones (ip -br addr)");
    let bridge = format!("gdre{}", pid % 100_000);
    let bridge_ip = Ipv4Addr::new(10, 213, third, 1);
    let _ = run("ip", &["link", "del", &bridge]);
    // A MAC of the bridge's own (locally administered, one per subnet): without one, a
    // bridge takes the lowest MAC of its ports, so when the environment with that port was
    // removed the host's MAC changed under the running environments, whose ARP caches kept
    // the old one, and their connections to the host (Gitea, the registry mirror) timed
    // out for 30–60 s. Seen as `dial tcp <host>: i/o timeout` in a job started just after
    // another ended (the Kubernetes harness had found the same for its bridge).
    let mac = format!("02:42:0a:d5:{third:02x}:01");
    for args in [
        vec!["link", "add", bridge.as_str(), "address", mac.as_str(), "type", "bridge"],
        vec!["addr", "add", &format!("{bridge_ip}/24"), "dev", bridge.as_str()],
        vec!["link", "set", bridge.as_str(), "up"],
    ] {
        let output = run("ip", &args);
        assert!(output.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    }
    std::fs::write(Path::new(BRIDGES).join(&bridge), format!("{pid} {}", start_time(pid).unwrap_or_default())).unwrap();
    (bridge, bridge_ip)
}

fn release_bridge(bridge: &str) {
    let _ = run("ip", &["link", "del", bridge]);
    let _ = std::fs::remove_file(Path::new(BRIDGES).join(bridge));
}

/// The names of the test bridges on this host.
fn bridges() -> Vec<String> {
    let output = run("ip", &["-o", "link", "show", "type", "bridge"]);
    let text = String::from_utf8_lossy(&output.stdout);
    // "12: gdre123: <BROADCAST,…" (a name may carry "@…" for its parent).
    text.lines()
        .filter_map(|line| line.split(": ").nth(1))
        .map(|name| name.split('@').next().unwrap_or(name).to_owned())
        .filter(|name| name.starts_with("gdre"))
        .collect()
}

/// The third octets of the 10.213.x.0/24 subnets some interface has an address in.
fn subnets_in_use() -> HashSet<u8> {
    let output = run("ip", &["-4", "-o", "addr", "show"]);
    let text = String::from_utf8_lossy(&output.stdout);
    text.split_whitespace()
        .filter_map(|word| word.split('/').next()?.parse::<Ipv4Addr>().ok())
        .filter(|address| address.octets()[..2] == [10, 213])
        .map(|address| address.octets()[2])
        .collect()
}

/// Whether the process a bridge record names ("<pid> <start time>") still runs: the
/// start time tells a reused pid from its first owner.
fn owner_alive(record: &str) -> bool {
    let mut fields = record.split_whitespace();
    let (Some(pid), Some(started)) = (fields.next().and_then(|p| p.parse().ok()), fields.next()) else { return false };
    start_time(pid).is_some_and(|now| now == started)
}

/// A process's start time in clock ticks since boot (field 22 of /proc/PID/stat).
fn start_time(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces: count from its closing parenthesis.
    stat.rsplit_once(')')?.1.split_whitespace().nth(19).map(str::to_owned)
}
