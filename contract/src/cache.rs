//! The jobs' cache as the runner image, the supervisor and the controller agree on it:
//! where the supervisor serves it to the job (the runner configuration's
//! `cache.external_server`), the file of the runner's registration secret (a value that
//! exists only in this environment and opens nothing but that local registration), and
//! how a request the supervisor forwards names its environment to the facade.

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

/// The legacy `_apis/artifactcache` API's path prefix.
pub const V1: &str = "/_apis/artifactcache/";
/// The v2 Twirp `CacheService`'s path prefix.
pub const V2: &str = "/twirp/github.actions.results.api.v1.CacheService/";

/// Whether a job's request to `path` belongs to the cache: what the supervisor sends to
/// the controller (everything else goes to Gitea).
pub fn is_cache(path: &str) -> bool {
    path.starts_with(V1) || path.starts_with(V2)
}
