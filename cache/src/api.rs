//! The cache's route table: every request `actions/cache` makes, told apart by method and
//! path once, here. The agent asks [`is_cache`] (in `contract`, which the static
//! supervisor links without the cache) which requests to send to the controller,
//! the facade asks a [`Call`] whether it is a handed-out URL (which the toolkit fetches
//! without its token) and what to answer where no cache is kept, and the service routes on
//! it.

use http::Method;

pub use contract::cache::{V1, V2, is_cache};

/// The v2 Twirp service.
pub const SERVICE: &str = "github.actions.results.api.v1.CacheService";

/// One request of a cache client.
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
    /// Nothing of the cache's.
    NotFound,
}

impl Call {
    /// The call `method` and `path` (without the query) make.
    pub fn of(method: &Method, path: &str) -> Call {
        let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        match (method, segments.as_slice()) {
            (&Method::GET, ["_apis", "artifactcache", "cache"]) => Call::Lookup,
            (&Method::POST, ["_apis", "artifactcache", "caches"]) => Call::Reserve,
            (&Method::PATCH, ["_apis", "artifactcache", "caches", id]) => Call::Chunk((*id).to_owned()),
            (&Method::POST, ["_apis", "artifactcache", "caches", id]) => Call::Commit((*id).to_owned()),
            (&Method::GET | &Method::HEAD, ["_apis", "artifactcache", "artifacts", id]) => {
                Call::Download { id: (*id).to_owned(), head_only: method == Method::HEAD }
            }
            (&Method::PUT, ["_apis", "artifactcache", "blobs", id]) => Call::Blob((*id).to_owned()),
            (&Method::POST, ["twirp", SERVICE, name]) => match *name {
                "CreateCacheEntry" => Call::Create,
                "FinalizeCacheEntryUpload" => Call::Finalize,
                "GetCacheEntryDownloadURL" => Call::DownloadUrl,
                other => Call::UnknownMethod(other.to_owned()),
            },
            _ => Call::NotFound,
        }
    }

    /// A URL the cache handed out: the toolkit treats it as signed and sends no token.
    pub fn is_handed_out(&self) -> bool {
        matches!(self, Call::Download { .. } | Call::Blob(_))
    }

    /// Which API it belongs to, for the metrics: `v1`, `v2` or `download`.
    pub fn api(&self) -> &'static str {
        match self {
            Call::Download { .. } => "download",
            Call::Blob(_) | Call::Create | Call::Finalize | Call::DownloadUrl | Call::UnknownMethod(_) => "v2",
            Call::Lookup | Call::Reserve | Call::Chunk(_) | Call::Commit(_) | Call::NotFound => "v1",
        }
    }

    /// Whether it uploads an archive's bytes.
    pub fn uploads(&self) -> bool {
        matches!(self, Call::Chunk(_) | Call::Blob(_))
    }

    /// What a job is told where the controller keeps no cache (`why`): a restore misses
    /// quietly (204, `{"ok": false}`), a save is refused with the reason.
    pub fn without_cache(&self, why: &str) -> crate::Response {
        use crate::http::{empty, json, message};
        match self {
            Call::Lookup => empty(204),
            Call::DownloadUrl => json(200, &serde_json::json!({ "ok": false })),
            Call::Create | Call::Finalize | Call::UnknownMethod(_) => json(400, &serde_json::json!({ "code": "failed_precondition", "msg": why })),
            _ => message(400, why),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_request_of_the_toolkit_is_one_call() {
        let table: &[(Method, &str, Call)] = &[
            (Method::GET, "/_apis/artifactcache/cache", Call::Lookup),
            (Method::POST, "/_apis/artifactcache/caches", Call::Reserve),
            (Method::PATCH, "/_apis/artifactcache/caches/7", Call::Chunk("7".into())),
            (Method::POST, "/_apis/artifactcache/caches/7", Call::Commit("7".into())),
            (Method::GET, "/_apis/artifactcache/artifacts/9", Call::Download { id: "9".into(), head_only: false }),
            (Method::HEAD, "/_apis/artifactcache/artifacts/9", Call::Download { id: "9".into(), head_only: true }),
            (Method::PUT, "/_apis/artifactcache/blobs/9", Call::Blob("9".into())),
            (Method::POST, "/twirp/github.actions.results.api.v1.CacheService/CreateCacheEntry", Call::Create),
            (Method::POST, "/twirp/github.actions.results.api.v1.CacheService/FinalizeCacheEntryUpload", Call::Finalize),
            (Method::POST, "/twirp/github.actions.results.api.v1.CacheService/GetCacheEntryDownloadURL", Call::DownloadUrl),
            (Method::POST, "/twirp/github.actions.results.api.v1.CacheService/DeleteCacheEntry", Call::UnknownMethod("DeleteCacheEntry".into())),
            (Method::DELETE, "/_apis/artifactcache/caches/7", Call::NotFound),
            (Method::GET, "/_apis/artifactcache/caches/7/x", Call::NotFound),
        ];
        for (method, path, call) in table {
            assert_eq!(Call::of(method, path), *call, "{method} {path}");
            assert!(is_cache(path), "{path}");
        }
        for path in ["/twirp/github.actions.results.api.v1.ArtifactService/CreateArtifact", "/api/v1/repos/o/r", "/_apis/artifactcachex"] {
            assert!(!is_cache(path), "{path}");
        }
        assert!(Call::Blob("1".into()).is_handed_out() && !Call::Reserve.is_handed_out());
    }
}
