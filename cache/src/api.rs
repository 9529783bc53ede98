//! The cache's requests as the cache takes them: the protocol's one route table is
//! [`Call`] in `contract::cache` (the static supervisor links it without the cache's
//! storage, to tell which of a job's requests are the cache's); here, what the controller
//! makes of a request that reaches it, and what a job is told where no cache is kept.

pub use contract::cache::Call;
use http::Method;

use crate::http::{Response, empty, json, message};

/// The call a request that reached the cache makes. A path that is not the cache's at
/// all arrives only through the facade (the supervisor sends the cache nothing else): it
/// is refused as a call the cache does not have, as [`Call::Unknown`] is.
pub fn call_of(method: &Method, path: &str) -> Call {
    Call::classify(method, path).unwrap_or(Call::Unknown)
}

/// What a job is told where the controller keeps no cache (`why`): a restore misses
/// quietly (204, `{"ok": false}`), a save is refused with the reason.
pub fn without_cache(call: &Call, why: &str) -> Response {
    match call {
        Call::Lookup => empty(204),
        Call::DownloadUrl => json(200, &serde_json::json!({ "ok": false })),
        Call::Create | Call::Finalize | Call::UnknownMethod(_) => json(400, &serde_json::json!({ "code": "failed_precondition", "msg": why })),
        _ => message(400, why),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_not_the_cache_s_is_a_call_it_does_not_have() {
        assert_eq!(call_of(&Method::GET, "/_apis/artifactcache/cache"), Call::Lookup);
        for path in ["/", "/twirp/github.actions.results.api.v1.ArtifactService/CreateArtifact", "/_apis/artifactcachex"] {
            assert_eq!(call_of(&Method::POST, path), Call::Unknown, "{path}");
        }
    }

    #[test]
    fn without_a_cache_restores_miss_and_saves_say_why() {
        let status = |call: Call| without_cache(&call, "no cache").status().as_u16();
        assert_eq!(status(Call::Lookup), 204);
        assert_eq!(status(Call::DownloadUrl), 200);
        assert_eq!(status(Call::Create), 400);
        assert_eq!(status(Call::Reserve), 400);
        assert_eq!(status(Call::Unknown), 400);
    }
}
