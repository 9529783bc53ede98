//! The two places the cache keeps its entries, opened as one `object_store` API: a
//! directory of this host, or an S3-compatible bucket (path-style or virtual-hosted,
//! under an optional prefix) that several controllers share.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

use object_store::{ObjectStore, aws::AmazonS3Builder, local::LocalFileSystem, prefix::PrefixStore};

use crate::error::CacheError;

/// An S3-compatible bucket, with the credentials already read from their files.
#[derive(Clone)]
pub struct S3 {
    pub bucket: String,
    /// e.g. `https://s3.example.com`; `None`: AWS for `region`.
    pub endpoint: Option<String>,
    pub region: String,
    /// Objects under this prefix of the bucket.
    pub prefix: String,
    pub access_key_id: String,
    pub secret_access_key: String,
    pub path_style: bool,
}

impl std::fmt::Debug for S3 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3").field("bucket", &self.bucket).field("endpoint", &self.endpoint).field("prefix", &self.prefix).finish_non_exhaustive()
    }
}

/// A storage, opened.
#[derive(Debug, Clone)]
pub struct Backend {
    pub store: Arc<dyn ObjectStore>,
    /// The directory it is (the free space the cache keeps is measured there); `None`: a
    /// bucket.
    pub directory: Option<PathBuf>,
}

impl Backend {
    /// The pieces an archive is written in: on a bucket, S3's 5 MiB smallest part and some;
    /// in a directory small ones, since each upload in flight holds a few.
    pub fn write_chunk(&self) -> usize {
        if self.directory.is_some() { 1 << 20 } else { 8 << 20 }
    }
}

/// A directory (made, mode 0700, if missing).
///
/// # Errors
/// When it cannot be made or used.
pub fn directory(dir: &Path) -> Result<Backend, CacheError> {
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| CacheError::Open { place: dir.display().to_string(), source: Box::new(source) })?;
    let store = LocalFileSystem::new_with_prefix(dir).map_err(|source| CacheError::Open { place: dir.display().to_string(), source: Box::new(source) })?;
    Ok(Backend { store: Arc::new(store), directory: Some(dir.to_owned()) })
}

/// A bucket. TLS is reqwest's rustls with the process's ring provider (installed here
/// if none is).
///
/// # Errors
/// When the settings cannot make a client.
pub fn s3(settings: &S3) -> Result<Backend, CacheError> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut builder = AmazonS3Builder::new()
        .with_bucket_name(&settings.bucket)
        .with_region(&settings.region)
        .with_access_key_id(&settings.access_key_id)
        .with_secret_access_key(&settings.secret_access_key)
        .with_virtual_hosted_style_request(!settings.path_style);
    if let Some(endpoint) = &settings.endpoint {
        builder = builder.with_endpoint(endpoint).with_allow_http(endpoint.starts_with("http://"));
    }
    let place = format!("s3 bucket {}", settings.bucket);
    let store = builder.build().map_err(|source| CacheError::Open { place: place.clone(), source: Box::new(source) })?;
    let prefix = settings.prefix.trim_matches('/');
    let store: Arc<dyn ObjectStore> = if prefix.is_empty() { Arc::new(store) } else { Arc::new(PrefixStore::new(store, prefix)) };
    Ok(Backend { store, directory: None })
}
