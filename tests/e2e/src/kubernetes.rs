//! The Kubernetes cluster of the tests: the real single-node v1.34 cluster built by the
//! peer scripts (`shared/peers/kubernetes`: etcd, kube-apiserver, controller-manager,
//! scheduler, kubelet on a private containerd with runc and the bridge CNI), started once
//! per test binary and stopped when it exits.
//!
//! What the harness adds to the peer's `up.sh`, each for a reason found here:
//! - the kubelet is restarted with eviction and image-GC thresholds near zero: a build
//!   host's disk is mostly full of build caches, and the defaults (evict below 10–15 %
//!   free, collect images above 85 % used) would taint the node and delete the runner
//!   image, which no registry can bring back;
//! - the Pods' bridge gets the host address [`Cluster::HOST_IP`]: Pods have no route
//!   off their subnet, and reach Gitea and the facade there; and a fixed MAC, so that a
//!   Pod ending does not change the gateway's MAC under the others;
//! - images are imported into the node's containerd (no registry is reachable).

use std::{
    collections::HashSet,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    sync::Mutex,
    time::{Duration, Instant},
};

use crate::run;

pub struct Cluster {
    /// The cluster-admin kubeconfig.
    pub kubeconfig: PathBuf,
    scripts: PathBuf,
    top: PathBuf,
    loaded: Mutex<HashSet<String>>,
}

static CLUSTER: crate::Shared<Cluster> = crate::Shared::new();

/// The shared cluster, started on first use.
pub fn cluster() -> &'static Cluster {
    CLUSTER.get_or_start(Cluster::start)
}

/// The peer's scripts: `K8S_PEER_SCRIPTS`, or `shared/peers/kubernetes` beside the
/// repository or beside the repository it was cloned from.
fn scripts() -> PathBuf {
    crate::paths::shared("peers/kubernetes", "up.sh", "K8S_PEER_SCRIPTS")
}

impl Cluster {
    /// Pods reach the host at this address on their bridge.
    pub const HOST_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 1);
    const BRIDGE: &str = "k8speer0";
    /// Locally administered, fixed: see `give_the_bridge_the_host_address`.
    const BRIDGE_MAC: &str = "02:00:0a:f4:00:01";

    fn start() -> Cluster {
        let scripts = scripts();
        let top = testkit::peers_cache().join("kubernetes");
        assert!(top.join("bin/kube-apiserver").exists(), "{} has no Kubernetes build: run scripts/install test-peers", top.display());
        let started = Instant::now();
        let output = Command::new(scripts.join("up.sh")).env("PEERS_CACHE", top.parent().unwrap()).stdin(Stdio::null()).output().unwrap();
        assert!(output.status.success(), "up.sh failed:\n{}\n{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        let cluster = Cluster { kubeconfig: top.join("run/pki/admin.kubeconfig"), scripts, top, loaded: Mutex::new(HashSet::new()) };
        cluster.restart_kubelet_without_disk_thresholds();
        cluster.give_the_bridge_the_host_address();
        cluster.wait_until_schedulable();
        eprintln!("Kubernetes cluster up in {:?}", started.elapsed());
        cluster
    }

    fn run_dir(&self) -> PathBuf {
        self.top.join("run")
    }

    fn restart_kubelet_without_disk_thresholds(&self) {
        let run_dir = self.run_dir();
        let pid = std::fs::read_to_string(run_dir.join("kubelet.pid")).unwrap().trim().to_owned();
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("the kubelet up.sh started is not running");
        let args: Vec<String> = cmdline.split(|b| *b == 0).filter(|a| !a.is_empty()).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
        let config = run_dir.join("kubelet-config.yaml");
        let mut text = std::fs::read_to_string(&config).unwrap();
        text.push_str(
            "evictionHard: {memory.available: \"50Mi\", nodefs.available: \"1%\", imagefs.available: \"1%\", nodefs.inodesFree: \"1%\"}\n\
             imageGCHighThresholdPercent: 100\nimageGCLowThresholdPercent: 99\n",
        );
        std::fs::write(&config, text).unwrap();
        let _ = run("kill", &[&pid]);
        // The old kubelet's exit is waited for, not asserted: the new one fails loudly if the port is still held.
        let _ = testkit::poll_blocking(Duration::from_secs(30), || if Path::new(&format!("/proc/{pid}")).exists() { Err(()) } else { Ok(()) });
        let log = std::fs::OpenOptions::new().append(true).create(true).open(run_dir.join("logs/kubelet.log")).unwrap();
        let child = Command::new(&args[0]).args(&args[1..]).stdin(Stdio::null()).stdout(log.try_clone().unwrap()).stderr(log).spawn().unwrap();
        std::fs::write(run_dir.join("kubelet.pid"), child.id().to_string()).unwrap();
        // The kubelet outlives this handle; down.sh stops it by its pid file.
        std::mem::forget(child);
    }

    fn give_the_bridge_the_host_address(&self) {
        // The bridge CNI plugin makes the bridge with the first Pod, and uses an existing one.
        if !Path::new(&format!("/sys/class/net/{}", Self::BRIDGE)).exists() {
            let output = run("ip", &["link", "add", Self::BRIDGE, "type", "bridge"]);
            assert!(output.status.success(), "ip link add: {}", String::from_utf8_lossy(&output.stderr));
        }
        // A bridge takes the lowest MAC of its ports unless it has one of its own: when the
        // Pod with that port ended, the gateway's MAC changed under the Pods still running,
        // whose ARP caches kept the old one, and their next connection to the host stalled
        // for ~35 s (until the stale entry was probed out). Seen as a job whose `curl` of
        // Gitea took 36 s in one run of three.
        let output = run("ip", &["link", "set", "dev", Self::BRIDGE, "address", Self::BRIDGE_MAC]);
        assert!(output.status.success(), "ip link set address: {}", String::from_utf8_lossy(&output.stderr));
        let address = format!("{}/24", Self::HOST_IP);
        let shown = run("ip", &["-4", "addr", "show", "dev", Self::BRIDGE]);
        if !String::from_utf8_lossy(&shown.stdout).contains(&address) {
            let output = run("ip", &["addr", "add", &address, "dev", Self::BRIDGE]);
            assert!(output.status.success(), "ip addr add: {}", String::from_utf8_lossy(&output.stderr));
        }
        let output = run("ip", &["link", "set", Self::BRIDGE, "up"]);
        assert!(output.status.success(), "ip link set up: {}", String::from_utf8_lossy(&output.stderr));
    }

    fn wait_until_schedulable(&self) {
        testkit::poll_blocking(Duration::from_secs(120), || {
            let output = self.kubectl(&[
                "get",
                "nodes",
                "-o",
                "jsonpath={range .items[*]}{.spec.taints}{\" ready=\"}{.status.conditions[?(@.type==\"Ready\")].status}{end}",
            ]);
            let text = String::from_utf8_lossy(&output.stdout).into_owned();
            if output.status.success() && text.contains("ready=True") && !text.contains("NoSchedule") { Ok(()) } else { Err(text) }
        })
        .unwrap_or_else(|text| panic!("the node is not schedulable after 120 s: {text}"));
    }

    /// `kubectl` as cluster-admin.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        self.kubectl_command(args).stdin(Stdio::null()).output().expect("kubectl cannot run")
    }

    fn kubectl_command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(self.top.join("bin/kubectl"));
        command.arg("--kubeconfig").arg(&self.kubeconfig).args(args);
        command
    }

    /// `kubectl` that must succeed; its stdout.
    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        let output = self.kubectl(args);
        assert!(output.status.success(), "kubectl {args:?}: {}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// `kubectl apply -f -` of `yaml`; its output.
    pub fn apply(&self, yaml: &str, extra: &[&str]) -> Output {
        use std::io::Write as _;
        let mut child =
            self.kubectl_command(&["apply", "-f", "-"]).args(extra).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        child.stdin.take().unwrap().write_all(yaml.as_bytes()).unwrap();
        child.wait_with_output().unwrap()
    }

    /// The runner image of `variant`, imported into the node's containerd; its reference.
    pub fn image(&self, variant: &str) -> String {
        let (tag, tar) = crate::paths::image(variant);
        self.import(&tag, &tar);
        tag
    }

    /// The image `tag` from its archive `tar`, imported into the node's containerd once.
    pub fn import(&self, tag: &str, tar: &Path) {
        let mut loaded = self.loaded.lock().unwrap();
        if !loaded.contains(tag) {
            let socket = self.run_dir().join("containerd/containerd.sock");
            let output = run("ctr", &["--address", &socket.display().to_string(), "-n", "k8s.io", "images", "import", &tar.display().to_string()]);
            assert!(output.status.success(), "ctr images import {}: {}", tar.display(), String::from_utf8_lossy(&output.stderr));
            loaded.insert(tag.to_owned());
        }
    }

    /// The API server's port on the host (the test cluster's API listens on 127.0.0.1).
    pub fn api_port(&self) -> u16 {
        let kubeconfig = std::fs::read_to_string(&self.kubeconfig).unwrap();
        let server = kubeconfig.lines().find_map(|l| l.trim().strip_prefix("server: ")).expect("the kubeconfig names no server");
        server.rsplit(':').next().unwrap().trim_end_matches('/').parse().expect("the API server's URL has no port")
    }

    /// A fresh namespace (with its default ServiceAccount, which Pods need).
    pub fn namespace(&self, prefix: &str) -> String {
        let name = format!("{prefix}-{}", fastrand::u32(..) % 1_000_000);
        self.kubectl_ok(&["create", "namespace", &name]);
        testkit::wait_until_blocking(&format!("namespace {name} has its default ServiceAccount"), Duration::from_secs(60), || {
            self.kubectl(&["-n", &name, "get", "serviceaccount", "default"]).status.success()
        });
        name
    }

    /// Names of the Pods in `namespace` matching `selector` (terminating ones included).
    pub fn pods(&self, namespace: &str, selector: &str) -> Vec<String> {
        let output = self.kubectl_ok(&["-n", namespace, "get", "pods", "-l", selector, "-o", "jsonpath={.items[*].metadata.name}"]);
        output.split_whitespace().map(str::to_owned).collect()
    }
}

impl crate::SharedPeer for Cluster {
    fn stop(&self) {
        let _ = Command::new(self.scripts.join("down.sh"))
            .env("PEERS_CACHE", self.top.parent().unwrap())
            .env("WIPE", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// SPIRE for the cluster's node: a real server, and an agent with the `k8s` workload
/// attestor, which asks this node's kubelet which Pod a caller is in. The kubelet
/// listens on 127.0.0.1 only here, and the admin certificate is authorised by its
/// webhook (a node's agent would use its own credential).
pub struct NodeSpire {
    pub server: testkit::spire::SpireServer,
    pub agent: testkit::spire::SpireAgent,
}

impl NodeSpire {
    pub const TRUST_DOMAIN: &str = "e2e.test";
    /// The agent's SPIFFE ID: the parent of every entry made here.
    pub const AGENT: &str = "spiffe://e2e.test/gdr/k8s-node";

    pub fn start(cluster: &Cluster) -> NodeSpire {
        let pki = cluster.kubeconfig.parent().unwrap().to_owned();
        let server = testkit::spire::SpireServer::start(Self::TRUST_DOMAIN);
        let attestor = format!(
            "  WorkloadAttestor \"k8s\" {{\n    plugin_data {{\n      kubelet_secure_port = 30250\n      skip_kubelet_verification = true\n      certificate_path = \"{}\"\n      private_key_path = \"{}\"\n    }}\n  }}",
            pki.join("admin.crt").display(),
            pki.join("admin.key").display()
        );
        let agent = testkit::spire::SpireAgent::start_with(&server, Self::AGENT, &attestor);
        NodeSpire { server, agent }
    }

    /// An entry for `id` under the node's agent.
    pub fn entry(&self, id: &str, selectors: &[String]) {
        let mut args = vec!["entry", "create", "-parentID", Self::AGENT, "-spiffeID", id];
        for selector in selectors {
            args.extend(["-selector", selector.as_str()]);
        }
        let output = self.server.cli(&args);
        assert!(output.status.success(), "spire-server entry create {id}: {}", String::from_utf8_lossy(&output.stderr));
    }

    /// The controller's `[kubernetes.spire]` and mTLS facade, the controller being `controller_id`.
    pub fn for_pods(&self, controller_id: &str) -> crate::stack::PodSpire {
        crate::stack::PodSpire {
            server_socket: self.server.socket(),
            agent_socket: self.agent.socket(),
            controller_id: controller_id.into(),
            parent_id: Self::AGENT.into(),
        }
    }
}
