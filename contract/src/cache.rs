//! The jobs' cache as the runner image, the supervisor and the controller agree on it:
//! where the supervisor serves it to the job (the runner configuration's
//! `cache.external_server`), the file of the runner's registration secret (a value that
//! exists only in this environment and opens nothing but that local registration), how
//! a request the supervisor forwards names its environment to the facade, and which
//! requests are the cache's ([`Call`]).

/// The port of [`LISTEN`] and [`URL`].
pub const PORT: u16 = 41731;
/// Where the supervisor listens for the job's cache requests (loopback only).
pub const LISTEN: &str = "127.0.0.1:41731";
/// The same as the job reaches it (`ACTIONS_CACHE_URL`, without the trailing `/`).
pub const URL: &str = "http://127.0.0.1:41731";
/// In the runner's home: the secret gitea-runner registers each job with (its
/// `cache.external_secret_file`), written by the agent before the runner starts.
pub const SECRET_FILE: &str = ".cache-secret";

/// The path prefix of the cache on the facade's server.
pub const PREFIX: &str = "/gdr.cache.v1.Cache";
/// The assignment a forwarded request is for, and the session capability of its claim.
pub const HEADER_ASSIGNMENT: &str = "x-gdr-assignment";
pub const HEADER_CAPABILITY: &str = "x-gdr-capability";
/// The cache's URL as the job reaches it: the base of the download and upload URLs the
/// cache hands out.
pub const HEADER_URL: &str = "x-gdr-cache-url";

/// The legacy `_apis/artifactcache` API's paths (the archive and blob URLs the cache hands
/// out are under it too).
const V1: &str = "/_apis/artifactcache/";
/// The v2 Twirp `CacheService`'s paths.
const V2: &str = "/twirp/github.actions.results.api.v1.CacheService/";

/// One request of a cache client: the cache protocol's route table, and its only one.
/// The supervisor asks it which of a job's requests go to the controller (everything
/// else goes to Gitea); the facade, whether a request carries the job's token; the cache,
/// what to run and which API's format to answer in. It lives here, not in the cache,
/// because the static supervisor links `contract` and not the cache's storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// v1 `GET cache?keys=…&version=…`.
    Lookup,
    /// v1 `POST caches`.
    Reserve,
    /// v1 `PATCH caches/{id}`: one chunk.
    Chunk(String),
    /// v1 `POST caches/{id}`.
    Commit(String),
    /// `GET`/`HEAD artifacts/{id}`: an archive (the URL restores hand out).
    Download { id: String, head_only: bool },
    /// v2 `PUT blobs/{id}`: the archive, a block or the block list (the URL v2 hands out).
    Blob(String),
    /// v2 `CreateCacheEntry`.
    Create,
    /// v2 `FinalizeCacheEntryUpload`.
    Finalize,
    /// v2 `GetCacheEntryDownloadURL`.
    DownloadUrl,
    /// A v2 method the service does not have.
    UnknownMethod(String),
    /// Under the cache's paths, but no request of its (another method, another path):
    /// still the cache's to refuse, so that the client reads the cache's own answer.
    Unknown,
}

impl Call {
    /// The call `method` and `path` (without the query) make; `None` when the path is
    /// not the cache's at all.
    pub fn classify(method: &http::Method, path: &str) -> Option<Call> {
        if let Some(rest) = path.strip_prefix(V1) {
            return Some(Call::of_v1(method, rest));
        }
        let name = path.strip_prefix(V2)?;
        Some(match (method, name) {
            (&http::Method::POST, "CreateCacheEntry") => Call::Create,
            (&http::Method::POST, "FinalizeCacheEntryUpload") => Call::Finalize,
            (&http::Method::POST, "GetCacheEntryDownloadURL") => Call::DownloadUrl,
            (&http::Method::POST, other) if !other.contains('/') => Call::UnknownMethod(other.to_owned()),
            _ => Call::Unknown,
        })
    }

    /// A v1 call: `rest` is its path below [`V1`].
    fn of_v1(method: &http::Method, rest: &str) -> Call {
        use http::Method;
        let segments: Vec<&str> = rest.split('/').collect();
        match (method, segments.as_slice()) {
            (&Method::GET, ["cache"]) => Call::Lookup,
            (&Method::POST, ["caches"]) => Call::Reserve,
            (&Method::PATCH, ["caches", id]) => Call::Chunk((*id).to_owned()),
            (&Method::POST, ["caches", id]) => Call::Commit((*id).to_owned()),
            (&Method::GET | &Method::HEAD, ["artifacts", id]) => Call::Download { id: (*id).to_owned(), head_only: method == Method::HEAD },
            (&Method::PUT, ["blobs", id]) => Call::Blob((*id).to_owned()),
            _ => Call::Unknown,
        }
    }

    /// A URL the cache handed out: the toolkit treats it as signed and sends no token.
    pub fn is_handed_out(&self) -> bool {
        matches!(self, Call::Download { .. } | Call::Blob(_))
    }

    /// Which API it belongs to, as the cache's metrics count it: `v1`, `v2` or `download`.
    pub fn api(&self) -> &'static str {
        match self {
            Call::Download { .. } => "download",
            Call::Blob(_) | Call::Create | Call::Finalize | Call::DownloadUrl | Call::UnknownMethod(_) => "v2",
            Call::Lookup | Call::Reserve | Call::Chunk(_) | Call::Commit(_) | Call::Unknown => "v1",
        }
    }
}

/// The URL of archive `id` that a restore hands out: a [`Call::Download`].
pub fn archive_url(base: &str, id: u64) -> String {
    format!("{base}{V1}artifacts/{id}")
}

/// The URL a v2 save uploads upload `id` to: a [`Call::Blob`].
pub fn blob_url(base: &str, id: u64) -> String {
    format!("{base}{V1}blobs/{id}")
}

#[cfg(test)]
mod tests {
    use http::Method;

    use super::*;

    const TWIRP: &str = "/twirp/github.actions.results.api.v1.CacheService";

    #[test]
    fn the_port_is_the_one_of_the_address_and_the_url() {
        assert!(LISTEN.ends_with(&format!(":{PORT}")) && URL.ends_with(&format!(":{PORT}")));
    }

    #[test]
    fn every_request_of_the_toolkit_is_one_call_and_nothing_else_is_the_cache_s() {
        let twirp = |name: &str| format!("{TWIRP}/{name}");
        let table: Vec<(Method, String, Option<Call>)> = vec![
            (Method::GET, "/_apis/artifactcache/cache".into(), Some(Call::Lookup)),
            (Method::POST, "/_apis/artifactcache/caches".into(), Some(Call::Reserve)),
            (Method::PATCH, "/_apis/artifactcache/caches/7".into(), Some(Call::Chunk("7".into()))),
            (Method::POST, "/_apis/artifactcache/caches/7".into(), Some(Call::Commit("7".into()))),
            (Method::GET, "/_apis/artifactcache/artifacts/9".into(), Some(Call::Download { id: "9".into(), head_only: false })),
            (Method::HEAD, "/_apis/artifactcache/artifacts/9".into(), Some(Call::Download { id: "9".into(), head_only: true })),
            (Method::PUT, "/_apis/artifactcache/blobs/9".into(), Some(Call::Blob("9".into()))),
            (Method::POST, twirp("CreateCacheEntry"), Some(Call::Create)),
            (Method::POST, twirp("FinalizeCacheEntryUpload"), Some(Call::Finalize)),
            (Method::POST, twirp("GetCacheEntryDownloadURL"), Some(Call::DownloadUrl)),
            // The cache's paths, but none of its calls: the cache refuses them itself.
            (Method::POST, twirp("DeleteCacheEntry"), Some(Call::UnknownMethod("DeleteCacheEntry".into()))),
            (Method::POST, format!("{TWIRP}/"), Some(Call::UnknownMethod(String::new()))),
            (Method::GET, twirp("CreateCacheEntry"), Some(Call::Unknown)),
            (Method::POST, twirp("CreateCacheEntry/x"), Some(Call::Unknown)),
            (Method::DELETE, "/_apis/artifactcache/caches/7".into(), Some(Call::Unknown)),
            (Method::POST, "/_apis/artifactcache/cache".into(), Some(Call::Unknown)),
            (Method::GET, "/_apis/artifactcache/caches".into(), Some(Call::Unknown)),
            (Method::PUT, "/_apis/artifactcache/artifacts/9".into(), Some(Call::Unknown)),
            (Method::GET, "/_apis/artifactcache/blobs/9".into(), Some(Call::Unknown)),
            (Method::GET, "/_apis/artifactcache/caches/7/x".into(), Some(Call::Unknown)),
            (Method::GET, "/_apis/artifactcache/".into(), Some(Call::Unknown)),
            // Not the cache's: Gitea's (the v2 ArtifactService, the API), or nobody's.
            (Method::POST, "/twirp/github.actions.results.api.v1.ArtifactService/CreateArtifact".into(), None),
            (Method::POST, "/twirp/github.actions.results.api.v1.CacheServicex/CreateCacheEntry".into(), None),
            (Method::POST, TWIRP.into(), None),
            (Method::GET, "/api/actions_pipeline/_apis/pipelines/workflows/1/artifacts".into(), None),
            (Method::GET, "/api/v1/repos/o/r".into(), None),
            (Method::GET, "/_apis/artifactcachex".into(), None),
            (Method::GET, "/_apis/artifactcachex/cache".into(), None),
            (Method::GET, "/_apis/artifactcache".into(), None),
            (Method::GET, "//_apis/artifactcache/cache".into(), None),
            (Method::POST, "/_internal/register".into(), None),
            (Method::GET, "/".into(), None),
            (Method::GET, String::new(), None),
        ];
        for (method, path, call) in &table {
            assert_eq!(Call::classify(method, path), *call, "{method} {path}");
        }
    }

    #[test]
    fn the_urls_handed_out_are_the_calls_that_take_them_without_a_token() {
        let base = "http://127.0.0.1:41731";
        let archive = archive_url(base, 12);
        let blob = blob_url(base, 34);
        let (archive, blob) = (archive.strip_prefix(base).unwrap_or_default(), blob.strip_prefix(base).unwrap_or_default());
        assert_eq!(Call::classify(&Method::GET, archive), Some(Call::Download { id: "12".into(), head_only: false }));
        assert_eq!(Call::classify(&Method::PUT, blob), Some(Call::Blob("34".into())));
        assert!(Call::Download { id: "1".into(), head_only: true }.is_handed_out() && Call::Blob("1".into()).is_handed_out());
        for call in
            [Call::Lookup, Call::Reserve, Call::Chunk("1".into()), Call::Commit("1".into()), Call::Create, Call::Finalize, Call::DownloadUrl, Call::Unknown]
        {
            assert!(!call.is_handed_out(), "{call:?}");
        }
    }
}
