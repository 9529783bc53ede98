//! What can go wrong in the cache, and what the client is told.

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
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
