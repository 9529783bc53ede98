//! A fake SPIFFE Workload API server (tonic, from the SPIFFE proto) on a unix socket,
//! scripted by the test: it refuses (PermissionDenied "no identity issued", then
//! closes the stream, as SPIRE does), or offers SVIDs for the IDs the test sets,
//! pushing an update to open streams when they change. Like SPIRE it rejects calls
//! without the `workload.spiffe.io: true` header, and it counts the calls that had it.

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use proto::spiffe_workload::{
    X509svid, X509svidRequest, X509svidResponse,
    spiffe_workload_api_server::{SpiffeWorkloadApi, SpiffeWorkloadApiServer},
};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType};
use tokio::sync::watch;
use tokio_stream::{Stream, StreamExt, wrappers::WatchStream};
use tonic::{Request, Response, Status};

/// What the fake offers right now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Offer {
    Refuse,
    Ids(Vec<String>),
}

#[derive(Clone)]
struct Fake {
    offer: watch::Receiver<Offer>,
    ca: Arc<Ca>,
    with_header: Arc<AtomicUsize>,
    without_header: Arc<AtomicUsize>,
}

/// A certificate authority for SVIDs; share one between fakes so that their SVIDs
/// trust each other (a server and a client of an mTLS test).
pub struct Ca {
    key: KeyPair,
    params: CertificateParams,
    der: Vec<u8>,
}

impl Default for Ca {
    fn default() -> Self {
        Self::new()
    }
}

impl Ca {
    pub fn new() -> Self {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params.subject_alt_names = vec![SanType::URI("spiffe://example.org".try_into().unwrap())];
        let der = params.self_signed(&key).unwrap().der().to_vec();
        Ca { key, params, der }
    }

    pub fn svid(&self, id: &str) -> X509svid {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = vec![SanType::URI(id.try_into().unwrap())];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.is_ca = IsCa::ExplicitNoCa;
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cert = params.signed_by(&key, &issuer).unwrap();
        X509svid { spiffe_id: id.to_owned(), x509_svid: cert.der().to_vec(), x509_svid_key: key.serialize_der(), bundle: self.der.clone(), hint: String::new() }
    }
}

type SvidStream = Pin<Box<dyn Stream<Item = Result<X509svidResponse, Status>> + Send>>;

#[tonic::async_trait]
impl SpiffeWorkloadApi for Fake {
    type FetchX509SVIDStream = SvidStream;

    async fn fetch_x509svid(&self, request: Request<X509svidRequest>) -> Result<Response<SvidStream>, Status> {
        self.check_header(&request)?;
        if *self.offer.borrow() == Offer::Refuse {
            return Err(Status::permission_denied("no identity issued"));
        }
        let ca = Arc::clone(&self.ca);
        // Every change of the offer is pushed as a full update; a refusal ends the stream.
        let stream = WatchStream::new(self.offer.clone()).take_while(|offer| *offer != Offer::Refuse).map(move |offer| match offer {
            Offer::Ids(ids) => Ok(X509svidResponse { svids: ids.iter().map(|id| ca.svid(id)).collect(), ..Default::default() }),
            Offer::Refuse => Err(Status::permission_denied("no identity issued")),
        });
        Ok(Response::new(Box::pin(stream)))
    }

    type FetchX509BundlesStream = Pin<Box<dyn Stream<Item = Result<proto::spiffe_workload::X509BundlesResponse, Status>> + Send>>;

    async fn fetch_x509_bundles(&self, _: Request<proto::spiffe_workload::X509BundlesRequest>) -> Result<Response<Self::FetchX509BundlesStream>, Status> {
        Err(Status::unimplemented("not in this fake"))
    }

    async fn fetch_jwtsvid(&self, _: Request<proto::spiffe_workload::JwtsvidRequest>) -> Result<Response<proto::spiffe_workload::JwtsvidResponse>, Status> {
        Err(Status::unimplemented("not in this fake"))
    }

    type FetchJWTBundlesStream = Pin<Box<dyn Stream<Item = Result<proto::spiffe_workload::JwtBundlesResponse, Status>> + Send>>;

    async fn fetch_jwt_bundles(&self, _: Request<proto::spiffe_workload::JwtBundlesRequest>) -> Result<Response<Self::FetchJWTBundlesStream>, Status> {
        Err(Status::unimplemented("not in this fake"))
    }

    async fn validate_jwtsvid(
        &self,
        _: Request<proto::spiffe_workload::ValidateJwtsvidRequest>,
    ) -> Result<Response<proto::spiffe_workload::ValidateJwtsvidResponse>, Status> {
        Err(Status::unimplemented("not in this fake"))
    }
}

impl Fake {
    fn check_header<T>(&self, request: &Request<T>) -> Result<(), Status> {
        let values: Vec<_> = request.metadata().get_all("workload.spiffe.io").iter().collect();
        if values.len() == 1 && values[0] == "true" {
            self.with_header.fetch_add(1, Ordering::SeqCst);
            Ok(())
        } else {
            self.without_header.fetch_add(1, Ordering::SeqCst);
            Err(Status::invalid_argument("security header missing from request"))
        }
    }
}

/// The running fake; dropping it stops the server.
pub struct FakeWorkloadApi {
    pub socket: PathBuf,
    offer: watch::Sender<Offer>,
    with_header: Arc<AtomicUsize>,
    without_header: Arc<AtomicUsize>,
    server: tokio::task::JoinHandle<()>,
}

impl FakeWorkloadApi {
    /// Starts on `dir/api.sock`, refusing at first. The socket is world-accessible
    /// because the agent connects as uid 2000.
    pub async fn start(dir: &Path) -> Self {
        Self::start_with(dir, "api.sock", Arc::new(Ca::new())).await
    }

    /// Starts on `dir/<file>` with SVIDs signed by `ca`.
    pub async fn start_with(dir: &Path, file: &str, ca: Arc<Ca>) -> Self {
        let socket = dir.join(file);
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o777)).unwrap();
        let (offer, receiver) = watch::channel(Offer::Refuse);
        let fake = Fake { offer: receiver, ca, with_header: Arc::new(AtomicUsize::new(0)), without_header: Arc::new(AtomicUsize::new(0)) };
        let (with_header, without_header) = (Arc::clone(&fake.with_header), Arc::clone(&fake.without_header));
        let server = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(SpiffeWorkloadApiServer::new(fake))
                .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener))
                .await;
        });
        FakeWorkloadApi { socket, offer, with_header, without_header, server }
    }

    pub fn endpoint(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    pub fn set(&self, offer: Offer) {
        self.offer.send_replace(offer);
    }

    pub fn calls_with_header(&self) -> usize {
        self.with_header.load(Ordering::SeqCst)
    }

    pub fn calls_without_header(&self) -> usize {
        self.without_header.load(Ordering::SeqCst)
    }
}

impl Drop for FakeWorkloadApi {
    fn drop(&mut self) {
        self.server.abort();
    }
}
