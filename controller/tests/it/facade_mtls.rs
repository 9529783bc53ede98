//! The facade's SPIFFE mTLS listener: SVIDs from (fake) Workload APIs sharing one CA;
//! the job's own SVID may claim, another workload's SVID of the same trust domain is
//! refused with PERMISSION_DENIED, and a client without a certificate gets no
//! connection at all.

use std::{sync::Arc, time::Duration};

use controller::{
    assignment::{Assignment, Rules, capability::CapabilityKey, placement::LabelPolicy},
    facade::{self, Facade},
    gitea::registrations::Registrations,
    lifecycle::Lifecycle,
    placements::Placements,
    store::{Record, Store, embedded::Embedded, now_ms},
};
use proto::facade::v1::{AssignmentCredential, ClaimRequest, facade_service_client::FacadeServiceClient};
use testkit::workload::{Ca, FakeWorkloadApi, Offer};
use tokio_util::sync::CancellationToken;

const FACADE_ID: &str = "spiffe://example.org/ci/controller";
/// Task 77's identity.
const JOB_ID: &str = "spiffe://example.org/ci/owner/repo/build/77";
const KEY: &[u8] = b"0123456789abcdef0123456789abcdef-mtls";

fn task() -> proto::runner::v1::Task {
    let workflow = "on: push\njobs:\n  build:\n    runs-on: [self-hosted, container, docker]\n    steps:\n      - run: true\n";
    let repository = prost_types::Value { kind: Some(prost_types::value::Kind::StringValue("owner/repo".into())) };
    proto::runner::v1::Task {
        id: 77,
        workflow_payload: Some(workflow.as_bytes().to_vec()),
        context: Some(prost_types::Struct { fields: [("repository".to_owned(), repository)].into_iter().collect() }),
        ..Default::default()
    }
}

async fn source(api: &FakeWorkloadApi) -> spiffe::X509Source {
    tokio::time::timeout(Duration::from_secs(20), spiffe::X509Source::builder().endpoint(api.endpoint()).build()).await.unwrap().unwrap()
}

/// Connects on the first call, as the supervisor's facade client does, so that a failed
/// handshake is a failed call that [`claim_retrying`] retries.
fn client(source: spiffe::X509Source, address: std::net::SocketAddr) -> FacadeServiceClient<tonic::transport::Channel> {
    let authorizer = spiffe_rustls::authorizer::exact([FACADE_ID]).unwrap();
    let config = Arc::new(spiffe_rustls::mtls_client(source).authorize(authorizer).with_alpn_protocols([b"h2"]).build().unwrap());
    let channel = tonic::transport::Endpoint::try_from("http://facade.local").unwrap().connect_with_connector_lazy(tower::service_fn(move |_| {
        let config = Arc::clone(&config);
        async move {
            let tcp = tokio::net::TcpStream::connect(address).await?;
            let name = rustls::pki_types::ServerName::try_from("facade.local").unwrap();
            let tls = tokio_rustls::TlsConnector::from(config).connect(name, tcp).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
        }
    }));
    FacadeServiceClient::new(channel)
}

/// A handshake can fail while the client's SVID source applies an update (spiffe-rustls
/// refuses to present material older than its source's revision: `PendingRevision`, which
/// CI once saw on the first connection); the supervisor retries a call that failed to
/// connect (Unavailable, or Unknown "transport error"), and so does this test.
async fn claim_retrying(
    client: &mut FacadeServiceClient<tonic::transport::Channel>,
    request: &ClaimRequest,
) -> Result<tonic::Response<proto::facade::v1::ClaimResponse>, tonic::Status> {
    let retried = testkit::poll(Duration::from_secs(5), || {
        let mut client = client.clone();
        async move {
            match client.claim(request.clone()).await {
                Err(status)
                    if status.code() == tonic::Code::Unavailable || (status.code() == tonic::Code::Unknown && status.message() == "transport error") =>
                {
                    Err(status)
                }
                other => Ok(other),
            }
        }
    });
    retried.await.unwrap_or_else(Err)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_jobs_own_svid_may_claim() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Arc::new(Ca::new());
    let server_api = FakeWorkloadApi::start_with(dir.path(), "server.sock", Arc::clone(&ca)).await;
    server_api.set(Offer::Ids(vec![FACADE_ID.into()]));
    let job_api = FakeWorkloadApi::start_with(dir.path(), "job.sock", Arc::clone(&ca)).await;
    job_api.set(Offer::Ids(vec![JOB_ID.into()]));
    let intruder_api = FakeWorkloadApi::start_with(dir.path(), "intruder.sock", Arc::clone(&ca)).await;
    intruder_api.set(Offer::Ids(vec!["spiffe://example.org/ci/owner/repo/build/78".into()]));

    let store: Arc<dyn Store> = Arc::new(Embedded::open(&dir.path().join("store.redb")).unwrap());
    let rules = Rules { trust_domain: "example.org".into(), labels: LabelPolicy::seed_compatible() };
    let assignment = Assignment::from_task(task(), &rules).unwrap();
    assert_eq!(assignment.identity.spiffe_id, JOB_ID);
    store.persist(&Record::pending(&assignment.id, assignment.placement, "", assignment.encode(), now_ms())).await.unwrap();
    let key = Arc::new(CapabilityKey::from_bytes(KEY).unwrap());
    let capability = key.issue(&assignment.id, u64::MAX / 2);
    let registrations = Registrations::default();
    let lifecycle = Lifecycle::new(Arc::clone(&store), Placements::new(), registrations.clone());
    let facade = Arc::new(Facade::new(Arc::clone(&store), registrations, lifecycle, key, rules));

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let tls = facade::mtls_server_config(source(&server_api).await, "example.org").unwrap();
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(facade::serve_mtls(facade, listener, tls, shutdown.clone()));

    let request =
        ClaimRequest { credential: Some(AssignmentCredential { assignment_id: assignment.id.clone(), capability }), holder: "holder-0123456789abcdef".into() };
    let mut intruder = client(source(&intruder_api).await, address);
    let status = claim_retrying(&mut intruder, &request).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status}");
    // Another task of the same job key of the same repository: its SVID is not this task's.
    assert!(status.message().contains("owner/repo/build/78"), "{status}");

    let mut job = client(source(&job_api).await, address);
    let claimed = claim_retrying(&mut job, &request).await.unwrap().into_inner();
    assert_eq!(claimed.task.unwrap().id, 77);

    // Without a client certificate the handshake fails: no call reaches the facade.
    let plain = tonic::transport::Endpoint::try_from(format!("http://{address}")).unwrap().connect().await;
    if let Ok(channel) = plain {
        let status = FacadeServiceClient::new(channel).claim(ClaimRequest::default()).await.unwrap_err();
        assert_ne!(status.code(), tonic::Code::Ok);
        assert_ne!(status.code(), tonic::Code::Unauthenticated, "a plaintext call reached the facade");
    }
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
}
