//! The environment contract across the two binaries: for every placement and mode, the
//! real (static) supervisor is started with exactly the variables the controller's
//! drivers set — nothing more, no flags — and must start, wait for its identity where
//! SPIFFE is on, claim its task from the controller's real facade, and run the job
//! command. (Docker off and scratch directories are settings of the image, not of the
//! contract.) This is the boundary that once let every environment exit before
//! claiming while both sides' unit tests were green. With its own facade socket, the
//! environment's directory is bind-mounted where the driver mounts it (a private mount
//! namespace), and the capability file must be gone once the supervisor runs.

use std::{os::unix::fs::PermissionsExt, path::Path, sync::Arc, time::Duration};

use controller::{
    assignment::{Assignment, Placement, Rules, capability::CapabilityKey, placement::LabelPolicy},
    driver::environment_name,
    facade::{self, EnvironmentSockets, Facade, sockets::prepare_environment_dir},
    gitea::registrations::Registrations,
    lifecycle::Lifecycle,
    placements::Placements,
    store::{Record, State, Store, embedded::Embedded, now_ms},
    worker::{EnvironmentSettings, environment_spec},
};
use testkit::workload::{Ca, FakeWorkloadApi, Offer};
use tokio_util::sync::CancellationToken;

const FACADE_ID: &str = "spiffe://e2e.test/ci/controller";

fn rules() -> Rules {
    Rules { trust_domain: "e2e.test".into(), labels: LabelPolicy::default() }
}

fn task(id: i64, placement: Placement) -> proto::runner::v1::Task {
    let workflow = format!("on: push\njobs:\n  build:\n    runs-on: [disposable, {}, {}]\n    steps:\n      - run: true\n", placement.class, placement.driver);
    let string = |s: &str| prost_types::Value { kind: Some(prost_types::value::Kind::StringValue(s.to_owned())) };
    proto::runner::v1::Task {
        id,
        workflow_payload: Some(workflow.into_bytes()),
        context: Some(prost_types::Struct { fields: [("repository".to_owned(), string("owner/repo"))].into() }),
        secrets: [("GITEA_TOKEN".to_owned(), "job-token".to_owned())].into(),
        ..Default::default()
    }
}

fn open_dir(path: &Path) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o777)).unwrap();
}

#[derive(Debug, Clone, Copy)]
enum Mode {
    /// The docker driver's default: capability only, the environment's own facade
    /// directory mounted in.
    UnixCapabilityOnly,
    /// SPIFFE on: wait for the exact SVID, then claim over the unix socket.
    UnixWithIdentity,
    /// Pods and sandboxes: SPIFFE mTLS to the facade's TCP listener.
    MtlsWithIdentity,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_supervisor_starts_and_claims_with_exactly_what_drivers_set() {
    let supervisor = e2e::paths::supervisor();
    let dir = tempfile::Builder::new().prefix("gdr-e2e-contract-").tempdir_in("/tmp").unwrap();
    open_dir(dir.path());
    let store: Arc<dyn Store> = Arc::new(Embedded::open(&dir.path().join("store.redb")).unwrap());
    let key = Arc::new(CapabilityKey::from_bytes(b"contract-test-key-0123456789abcdef0123").unwrap());
    let registrations = Registrations::default();
    let lifecycle = Lifecycle::new(Arc::clone(&store), Placements::new(), registrations.clone());
    let facade = Arc::new(Facade::new(Arc::clone(&store), registrations, lifecycle, Arc::clone(&key), rules()));
    let shutdown = CancellationToken::new();
    let socket_dir = dir.path().join("environments");
    let sockets = EnvironmentSockets::new(&socket_dir, "contract", &Placement::ALL).unwrap();
    tokio::spawn(Arc::clone(&sockets).serve(Arc::clone(&facade), Arc::clone(&store), shutdown.clone()));
    // SPIFFE: one CA; the facade's and the jobs' SVIDs from fake Workload APIs.
    let ca = Arc::new(Ca::new());
    let server_api = FakeWorkloadApi::start_with(dir.path(), "facade-api.sock", Arc::clone(&ca)).await;
    server_api.set(Offer::Ids(vec![FACADE_ID.into()]));
    let job_api = FakeWorkloadApi::start_with(dir.path(), "job-api.sock", Arc::clone(&ca)).await;
    let source = tokio::time::timeout(Duration::from_secs(20), spiffe::X509Source::builder().endpoint(server_api.endpoint()).build()).await.unwrap().unwrap();
    let tls = facade::mtls_server_config(source, "e2e.test").unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mtls_address = listener.local_addr().unwrap();
    tokio::spawn(facade::serve_mtls(Arc::clone(&facade), listener, tls, shutdown.clone()));

    let mut id = 100;
    for placement in Placement::ALL {
        for mode in [Mode::UnixCapabilityOnly, Mode::UnixWithIdentity, Mode::MtlsWithIdentity] {
            id += 1;
            let assignment = Assignment::from_task(task(id, placement), &rules()).unwrap();
            store.persist(&Record::pending(&assignment.id, placement, "", assignment.encode(), now_ms())).await.unwrap();
            let settings = match mode {
                Mode::UnixCapabilityOnly => EnvironmentSettings {
                    gitea_url: Some("http://127.0.0.1:9".into()),
                    instance: "contract".into(),
                    capability_ttl: Duration::from_secs(600),
                    socket_dir: Some(socket_dir.clone()),
                    socket_placements: Placement::ALL.to_vec(),
                    ..EnvironmentSettings::default()
                },
                Mode::UnixWithIdentity => EnvironmentSettings {
                    spiffe_endpoint_socket: Some(job_api.endpoint()),
                    instance: "contract".into(),
                    capability_ttl: Duration::from_secs(600),
                    socket_dir: Some(socket_dir.clone()),
                    socket_placements: Placement::ALL.to_vec(),
                    ..EnvironmentSettings::default()
                },
                Mode::MtlsWithIdentity => EnvironmentSettings {
                    facade_url: format!("https://{mtls_address}"),
                    facade_spiffe_id: Some(FACADE_ID.into()),
                    spiffe_endpoint_socket: Some(job_api.endpoint()),
                    instance: "contract".into(),
                    capability_ttl: Duration::from_secs(600),
                    ..EnvironmentSettings::default()
                },
            };
            job_api.set(Offer::Ids(vec![assignment.identity.spiffe_id.clone()]));
            let spec = environment_spec(&assignment, placement, &environment_name("contract", &assignment.id), &settings, &key);
            assert!(spec.env.values().all(|v| !v.is_empty()), "{placement} {mode:?}: an empty variable was set");
            // What the worker does before it creates the environment.
            if let Some(own) = &spec.facade_dir {
                assert!(!spec.env.contains_key("CI_RUNNER_CAPABILITY"), "{placement} {mode:?}: the capability is in the environment's configuration");
                prepare_environment_dir(&socket_dir, own.host.file_name().unwrap().to_str().unwrap(), &own.capability).unwrap();
                sockets.open(&assignment.id).unwrap();
            }

            let scratch = dir.path().join(format!("env-{id}"));
            for sub in ["state", "runner"] {
                std::fs::create_dir_all(scratch.join(sub)).unwrap();
                open_dir(&scratch.join(sub));
            }
            // The environment's own directory where the driver mounts it: in a private mount
            // namespace (the supervisor runs as root here, as in a container).
            let mut command = match &spec.facade_dir {
                Some(own) => {
                    let mut command = tokio::process::Command::new("unshare");
                    let mount = format!(
                        "mount --make-rprivate / && mkdir -p {inside} && mount --bind {host} {inside} && exec \"$0\" \"$@\"",
                        inside = contract::facade::ENVIRONMENT_DIR,
                        host = own.host.display()
                    );
                    command.args(["--mount", "--", "sh", "-c", &mount]).arg(&supervisor);
                    command
                }
                None => tokio::process::Command::new(&supervisor),
            };
            command
                .env_clear()
                .envs(&spec.env)
                .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
                .env(contract::environment::supervisor::DOCKER, "false")
                .env(contract::environment::supervisor::STATE_DIR, scratch.join("state"))
                .env(contract::environment::supervisor::RUNNER_DIR, scratch.join("runner"))
                // The runner's stand-in: the job command runs once the task is claimed, in
                // the runner's directory where `.runner` was written.
                .args(["run", "--", "sh", "-c", "test -f .runner && grep -q '\"address\": \"http://127.0.0.1:' .runner && echo runner-started"])
                .kill_on_drop(true);
            // The supervisor's log goes to a file, so a run that hangs still says where.
            let log = scratch.join("supervisor.log");
            command.stdout(std::process::Stdio::piped()).stderr(std::fs::File::create(&log).unwrap());
            let Ok(output) = tokio::time::timeout(Duration::from_secs(60), command.spawn().unwrap().wait_with_output()).await else {
                panic!("{placement} {mode:?}: the supervisor did not finish within 60 s:\n{}", std::fs::read_to_string(&log).unwrap_or_default());
            };
            let output = output.unwrap();
            let stderr = std::fs::read_to_string(&log).unwrap_or_default();
            let stdout = String::from_utf8_lossy(&output.stdout);
            assert!(output.status.success(), "{placement} {mode:?}: the supervisor exited with {}\n{stderr}", output.status);
            assert!(stdout.contains("runner-started"), "{placement} {mode:?}: {stdout}\n{stderr}");
            let record = store.get(&assignment.id).await.unwrap().unwrap().value;
            assert!(matches!(record.state, State::Claimed { .. }), "{placement} {mode:?}: not claimed: {record:?}\n{stderr}");
            if let Some(own) = &spec.facade_dir {
                let file = own.host.join(contract::facade::CAPABILITY_NAME);
                assert!(!file.exists(), "{placement} {mode:?}: PID 1 left the capability file {}", file.display());
            }
        }
    }
    shutdown.cancel();
}
