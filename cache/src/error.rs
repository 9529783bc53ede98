//! What can go wrong in the cache: a request it refuses ([`CacheError::Refused`], answered
//! in the request's API's format, see [`crate::refusal`]) or a failure of its own (a 500).

use crate::refusal::Refusal;

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// Not a failure: a request the cache does not serve, and why. Every room returns it
    /// beside its failures, so that one `?` carries both up to the service, which answers
    /// it with its status and counts its reason.
    #[error(transparent)]
    Refused(#[from] Refusal),
    #[error("the cache's storage failed")]
    Storage(#[from] object_store::Error),
    #[error("the cache's object {path} is not what the cache wrote")]
    Corrupt {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("reading the request failed: {0}")]
    Request(String),
    #[error("cannot open the cache's storage ({place})")]
    Open {
        place: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}
