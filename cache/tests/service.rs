//! The cache service through its HTTP interface, as `@actions/cache` calls it, on both
//! backends — a directory, and a real S3-compatible server (versitygw): the v1 and v2 flows,
//! GitHub's scoping, committed entries never overwritten, chunks out of order, ranges,
//! and the sweep's limits. The wire formats follow `@actions/cache` 4.x (its requests
//! and what it reads of the answers); the real client runs in the e2e tests.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use cache::{Cache, CacheMetrics, Limits, Scope};
use http_body_util::{BodyExt as _, Full};

const BASE: &str = "http://127.0.0.1:8781";
const VERSION: &str = "4a12dc7233002e19937c6dadb33c15edb28fbb956a35e586003f83acdc591d39";

/// Where a test's cache keeps its entries: a directory, or a bucket of a real S3 server.
enum Backend {
    Directory(tempfile::TempDir),
    S3(testkit::s3::S3Server),
}

impl Backend {
    fn directory() -> Backend {
        Backend::Directory(tempfile::tempdir().unwrap())
    }

    fn s3() -> Backend {
        Backend::S3(testkit::s3::S3Server::start("cache"))
    }

    fn store(&self) -> Arc<dyn object_store::ObjectStore> {
        match self {
            Backend::Directory(dir) => cache::backend::directory(dir.path()).unwrap(),
            Backend::S3(server) => cache::backend::s3(&cache::backend::S3 {
                bucket: server.bucket.clone(),
                endpoint: Some(server.endpoint.clone()),
                region: "us-east-1".into(),
                prefix: "ci/".into(),
                access_key_id: testkit::s3::ACCESS_KEY_ID.into(),
                secret_access_key: testkit::s3::SECRET_ACCESS_KEY.into(),
                path_style: true,
            })
            .unwrap(),
        }
    }

    fn cache(&self, limits: Limits) -> Cache {
        Cache::new(self.store(), limits, Arc::new(CacheMetrics::default()))
    }

    /// The resolution of the times the store keeps (what tells which entry is older).
    fn tick(&self) -> Duration {
        match self {
            Backend::Directory(_) => Duration::from_millis(20),
            Backend::S3(_) => Duration::from_millis(1100),
        }
    }
}

/// Each case, once per backend.
macro_rules! on_both_backends {
    ($($case:ident),* $(,)?) => {
        mod directory {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                super::$case(super::Backend::directory()).await
            })*
        }
        mod s3 {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                super::$case(super::Backend::s3()).await
            })*
        }
    };
}

on_both_backends!(
    v1_saves_in_chunks_out_of_order_and_restores_by_key_and_prefix,
    a_committed_entry_is_never_overwritten_and_a_broken_upload_is_refused,
    scopes_follow_github_repositories_apart_pull_requests_read_main_but_never_write_it,
    v2_creates_uploads_in_blocks_finalizes_and_restores,
    the_sweep_keeps_each_repository_and_the_whole_within_limits_least_recently_used_first,
    a_save_larger_than_the_limit_is_refused_with_the_setting_named,
    two_controllers_on_one_store_share_the_entries,
);

fn roomy() -> Limits {
    Limits { max_total: 1 << 30, max_repository: 1 << 28, max_age: Duration::from_secs(3600) }
}

fn main_branch(repository: &str) -> Scope {
    Scope::new(repository, "refs/heads/main", ["refs/heads/main".to_owned()])
}

fn pull_request(repository: &str, number: u32) -> Scope {
    Scope::new(repository, format!("refs/pull/{number}/head"), ["refs/heads/main".to_owned(), "refs/heads/main".to_owned()])
}

async fn call(cache: &Cache, scope: &Scope, method: &str, path: &str, headers: &[(&str, String)], body: impl Into<Bytes>) -> (u16, http::HeaderMap, Bytes) {
    let mut request = http::Request::builder().method(method).uri(path);
    for (name, value) in headers {
        request = request.header(*name, value);
    }
    let response = cache.handle(scope, BASE, request.body(Full::new(body.into())).unwrap()).await;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    (status, headers, response.into_body().collect().await.unwrap().to_bytes())
}

fn json(bytes: &Bytes) -> serde_json::Value {
    serde_json::from_slice(bytes).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(bytes)))
}

/// Saves `data` under `key` the v1 way, in chunks of `chunk` bytes sent last first;
/// the status of the reserve, then of the commit.
async fn save_v1(cache: &Cache, scope: &Scope, key: &str, data: &[u8], chunk: usize) -> (u16, u16) {
    let reserve = serde_json::json!({ "key": key, "version": VERSION, "cacheSize": data.len() });
    let (status, _, body) = call(cache, scope, "POST", "/_apis/artifactcache/caches", &[], reserve.to_string()).await;
    if status != 200 {
        return (status, 0);
    }
    let id = json(&body)["cacheId"].as_u64().unwrap();
    assert!(id > 0 && id < 1 << 53);
    let chunks: Vec<(usize, &[u8])> = data.chunks(chunk.max(1)).enumerate().map(|(i, c)| (i * chunk, c)).collect();
    for (start, bytes) in chunks.into_iter().rev() {
        let range = format!("bytes {start}-{}/*", start + bytes.len() - 1);
        let (status, _, body) =
            call(cache, scope, "PATCH", &format!("/_apis/artifactcache/caches/{id}"), &[("content-range", range)], Bytes::copy_from_slice(bytes)).await;
        assert_eq!(status, 204, "{}", String::from_utf8_lossy(&body));
    }
    let commit = serde_json::json!({ "size": data.len() });
    let (status, _, _) = call(cache, scope, "POST", &format!("/_apis/artifactcache/caches/{id}"), &[], commit.to_string()).await;
    (200, status)
}

/// Restores the v1 way: the key it matched and the archive, or `None` on a miss.
async fn restore_v1(cache: &Cache, scope: &Scope, keys: &[&str]) -> Option<(String, Bytes)> {
    let keys = keys.join("%2C");
    let (status, _, body) = call(cache, scope, "GET", &format!("/_apis/artifactcache/cache?keys={keys}&version={VERSION}"), &[], Bytes::new()).await;
    if status == 204 {
        return None;
    }
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let answer = json(&body);
    let location = answer["archiveLocation"].as_str().unwrap();
    let path = location.strip_prefix(BASE).expect("the archive is at the cache's URL");
    let (status, headers, archive) = call(cache, scope, "GET", path, &[], Bytes::new()).await;
    assert_eq!(status, 200);
    assert_eq!(headers[http::header::CONTENT_LENGTH].to_str().unwrap(), archive.len().to_string());
    Some((answer["cacheKey"].as_str().unwrap().to_owned(), archive))
}

async fn v1_saves_in_chunks_out_of_order_and_restores_by_key_and_prefix(backend: Backend) {
    let cache = backend.cache(roomy());
    let scope = main_branch("acme/app");
    let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(restore_v1(&cache, &scope, &["deps-abc"]).await, None, "a miss is 204");
    assert_eq!(save_v1(&cache, &scope, "deps-abc", &data, 30_000).await, (200, 200));
    let (key, archive) = restore_v1(&cache, &scope, &["deps-abc"]).await.unwrap();
    assert_eq!((key.as_str(), archive.as_ref()), ("deps-abc", data.as_slice()));
    let (key, _) = restore_v1(&cache, &scope, &["deps-xyz", "deps-"]).await.unwrap();
    assert_eq!(key, "deps-abc", "a restore key matches by prefix");
    assert_eq!(cache.metrics().hits.get(), 2);
    assert_eq!(cache.metrics().misses.get(), 1);
}

async fn a_committed_entry_is_never_overwritten_and_a_broken_upload_is_refused(backend: Backend) {
    let cache = backend.cache(roomy());
    let scope = main_branch("acme/app");
    assert_eq!(save_v1(&cache, &scope, "k", b"first", 2).await, (200, 200));
    assert_eq!(save_v1(&cache, &scope, "k", b"second", 2).await.0, 409, "the reserve of a committed key");
    assert_eq!(restore_v1(&cache, &scope, &["k"]).await.unwrap().1.as_ref(), b"first");

    // Two jobs reserve the same key at once: the first commit wins, the second is told.
    let reserve = serde_json::json!({ "key": "race", "version": VERSION, "cacheSize": 3 }).to_string();
    let mut ids = Vec::new();
    for _ in 0..2 {
        let (_, _, body) = call(&cache, &scope, "POST", "/_apis/artifactcache/caches", &[], reserve.clone()).await;
        ids.push(json(&body)["cacheId"].as_u64().unwrap());
    }
    let mut statuses = Vec::new();
    for (id, content) in ids.iter().zip([b"one", b"two"]) {
        let range = ("content-range", "bytes 0-2/*".to_owned());
        call(&cache, &scope, "PATCH", &format!("/_apis/artifactcache/caches/{id}"), &[range], Bytes::from_static(content)).await;
        let (status, _, _) = call(&cache, &scope, "POST", &format!("/_apis/artifactcache/caches/{id}"), &[], r#"{"size":3}"#).await;
        statuses.push(status);
    }
    assert_eq!(statuses, [200, 409]);
    assert_eq!(restore_v1(&cache, &scope, &["race"]).await.unwrap().1.as_ref(), b"one");

    // A chunk missing, a chunk of the wrong length, a commit of the wrong size.
    let (_, _, body) = call(&cache, &scope, "POST", "/_apis/artifactcache/caches", &[], r#"{"key":"gap","version":"v1","cacheSize":10}"#).await;
    let id = json(&body)["cacheId"].as_u64().unwrap();
    let (status, _, _) =
        call(&cache, &scope, "PATCH", &format!("/_apis/artifactcache/caches/{id}"), &[("content-range", "bytes 0-9/*".to_owned())], "short").await;
    assert_eq!(status, 400, "five bytes for a ten-byte range");
    call(&cache, &scope, "PATCH", &format!("/_apis/artifactcache/caches/{id}"), &[("content-range", "bytes 5-9/*".to_owned())], "later").await;
    let (status, _, body) = call(&cache, &scope, "POST", &format!("/_apis/artifactcache/caches/{id}"), &[], r#"{"size":10}"#).await;
    assert_eq!(status, 400);
    assert!(json(&body)["message"].as_str().unwrap().contains("gap"), "{}", String::from_utf8_lossy(&body));
    let (status, _, _) = call(&cache, &scope, "GET", "/_apis/artifactcache/cache?keys=gap&version=v1", &[], Bytes::new()).await;
    assert_eq!(status, 204, "an entry that was never committed is invisible");
}

/// GitHub's scoping, as a table: who saves what, who restores what.
async fn scopes_follow_github_repositories_apart_pull_requests_read_main_but_never_write_it(backend: Backend) {
    let cache = backend.cache(roomy());
    let main = main_branch("acme/app");
    let pr = pull_request("acme/app", 7);
    let other_pr = pull_request("acme/app", 8);
    let other_repository = main_branch("evil/app");
    assert_eq!(save_v1(&cache, &main, "deps", b"from main", 100).await, (200, 200));
    assert_eq!(save_v1(&cache, &pr, "pr-only", b"from the pull request", 100).await, (200, 200));
    // The pull request's own save of the default branch's key goes to its own scope.
    assert_eq!(save_v1(&cache, &pr, "deps", b"poisoned", 100).await, (200, 200));
    let table: &[(&str, &Scope, &str, Option<&[u8]>)] = &[
        ("main restores its own", &main, "deps", Some(b"from main")),
        ("main never sees the pull request's save of its key", &main, "deps", Some(b"from main")),
        ("main never sees the pull request's own key", &main, "pr-only", None),
        ("the pull request restores its own first", &pr, "deps", Some(b"poisoned")),
        ("another pull request reads main, not its sibling", &other_pr, "deps", Some(b"from main")),
        ("a sibling's key is invisible", &other_pr, "pr-only", None),
        ("another repository misses", &other_repository, "deps", None),
    ];
    let mut printed = vec![format!("{:<55} {:<10} {}", "case", "key", "restored")];
    for (case, scope, key, expected) in table {
        let restored = restore_v1(&cache, scope, &[key]).await.map(|(_, archive)| archive);
        printed.push(format!("{case:<55} {key:<10} {:?}", restored.as_ref().map(|a| String::from_utf8_lossy(a).into_owned())));
        assert_eq!(restored.as_deref(), *expected, "{case}");
    }
    println!("{}", printed.join("\n"));
    // A download of another repository's archive by its id finds nothing.
    let (_, _, body) = call(&cache, &main, "GET", &format!("/_apis/artifactcache/cache?keys=deps&version={VERSION}"), &[], Bytes::new()).await;
    let path = json(&body)["archiveLocation"].as_str().unwrap().strip_prefix(BASE).unwrap().to_owned();
    assert_eq!(call(&cache, &other_repository, "GET", &path, &[], Bytes::new()).await.0, 404);
}

async fn v2_creates_uploads_in_blocks_finalizes_and_restores(backend: Backend) {
    let cache = backend.cache(roomy());
    let scope = main_branch("acme/app");
    let twirp = |method: &str| format!("/twirp/github.actions.results.api.v1.CacheService/{method}");
    let (status, _, body) = call(&cache, &scope, "POST", &twirp("GetCacheEntryDownloadURL"), &[], format!(r#"{{"key":"k","version":"{VERSION}"}}"#)).await;
    assert_eq!((status, json(&body)), (200, serde_json::json!({ "ok": false })));
    let (_, _, body) = call(&cache, &scope, "POST", &twirp("CreateCacheEntry"), &[], format!(r#"{{"key":"k","version":"{VERSION}"}}"#)).await;
    let created = json(&body);
    assert_eq!(created["ok"], true);
    let upload = created["signed_upload_url"].as_str().unwrap().strip_prefix(BASE).unwrap().to_owned();
    // Blocks as the Azure SDK stages them (URL-encoded base64 ids), then the list.
    for (id, content) in [("AAA%3D", "hello "), ("AAE%3D", "world")] {
        let (status, headers, _) = call(&cache, &scope, "PUT", &format!("{upload}?comp=block&blockid={id}"), &[], content).await;
        assert_eq!(status, 201);
        assert!(headers.contains_key("x-ms-request-id"));
    }
    let list = r#"<?xml version="1.0" encoding="utf-8"?><BlockList><Latest>AAA=</Latest><Latest>AAE=</Latest></BlockList>"#;
    assert_eq!(call(&cache, &scope, "PUT", &format!("{upload}?comp=blocklist"), &[], list).await.0, 201);
    let (_, _, body) =
        call(&cache, &scope, "POST", &twirp("FinalizeCacheEntryUpload"), &[], format!(r#"{{"key":"k","version":"{VERSION}","size_bytes":"11"}}"#)).await;
    let finalized = json(&body);
    assert_eq!(finalized["ok"], true, "{finalized}");
    assert!(finalized["entry_id"].as_str().unwrap().parse::<u64>().unwrap() > 0);
    let (_, _, body) =
        call(&cache, &scope, "POST", &twirp("GetCacheEntryDownloadURL"), &[], format!(r#"{{"key":"x","restore_keys":["k"],"version":"{VERSION}"}}"#)).await;
    let found = json(&body);
    assert_eq!(found["matched_key"], "k");
    let download = found["signed_download_url"].as_str().unwrap().strip_prefix(BASE).unwrap().to_owned();
    assert_eq!(call(&cache, &scope, "GET", &download, &[], Bytes::new()).await.2.as_ref(), b"hello world");
    let (status, headers, part) = call(&cache, &scope, "GET", &download, &[("range", "bytes=6-".to_owned())], Bytes::new()).await;
    assert_eq!((status, part.as_ref(), headers[http::header::CONTENT_RANGE].to_str().unwrap()), (206, b"world".as_ref(), "bytes 6-10/11"));
    // A second create of the committed key: not ok, no message (the client goes on quietly).
    let (_, _, body) = call(&cache, &scope, "POST", &twirp("CreateCacheEntry"), &[], format!(r#"{{"key":"k","version":"{VERSION}"}}"#)).await;
    assert_eq!(json(&body), serde_json::json!({ "ok": false }));
    // One PUT of a whole small archive.
    let (_, _, body) = call(&cache, &scope, "POST", &twirp("CreateCacheEntry"), &[], format!(r#"{{"key":"small","version":"{VERSION}"}}"#)).await;
    let upload = json(&body)["signed_upload_url"].as_str().unwrap().strip_prefix(BASE).unwrap().to_owned();
    assert_eq!(call(&cache, &scope, "PUT", &upload, &[("x-ms-blob-type", "BlockBlob".to_owned())], "tiny").await.0, 201);
    let (_, _, body) =
        call(&cache, &scope, "POST", &twirp("FinalizeCacheEntryUpload"), &[], format!(r#"{{"key":"small","version":"{VERSION}","size_bytes":4}}"#)).await;
    assert_eq!(json(&body)["ok"], true);
    assert_eq!(restore_v1(&cache, &scope, &["small"]).await.unwrap().1.as_ref(), b"tiny", "both APIs share the entries");
}

async fn the_sweep_keeps_each_repository_and_the_whole_within_limits_least_recently_used_first(backend: Backend) {
    let limits = Limits { max_total: 250, max_repository: 150, max_age: Duration::from_secs(3600) };
    let cache = backend.cache(limits);
    let (a, b) = (main_branch("acme/a"), main_branch("acme/b"));
    for key in ["a1", "a2", "a3"] {
        save_v1(&cache, &a, key, &[1u8; 60], 60).await;
        tokio::time::sleep(backend.tick()).await;
    }
    for key in ["b1", "b2"] {
        save_v1(&cache, &b, key, &[2u8; 60], 60).await;
        tokio::time::sleep(backend.tick()).await;
    }
    let swept = cache.sweep().await.unwrap();
    // a: 180 > 150 → a1 goes; then 120 + 120 = 240 ≤ 250.
    assert_eq!((swept.evicted, swept.entries, swept.bytes), (1, 4, 240), "{swept:?}");
    assert_eq!(restore_v1(&cache, &a, &["a1"]).await, None);
    assert!(restore_v1(&cache, &a, &["a2"]).await.is_some());
    assert_eq!(cache.metrics().stored_entries.get(), 4);
    let aged = backend.cache(Limits { max_age: Duration::ZERO, ..limits });
    tokio::time::sleep(backend.tick()).await;
    assert_eq!(aged.sweep().await.unwrap().entries, 0, "every entry is older than a zero age limit");
}

async fn a_save_larger_than_the_limit_is_refused_with_the_setting_named(backend: Backend) {
    let cache = backend.cache(Limits { max_total: 1 << 20, max_repository: 1000, max_age: Duration::from_secs(60) });
    let scope = main_branch("acme/app");
    let (status, _, body) =
        call(&cache, &scope, "POST", "/_apis/artifactcache/caches", &[], format!(r#"{{"key":"big","version":"{VERSION}","cacheSize":5000}}"#)).await;
    assert_eq!(status, 400);
    assert!(json(&body)["message"].as_str().unwrap().contains("cache.max_repository_size"), "{}", String::from_utf8_lossy(&body));
    let (status, _, _) = call(&cache, &scope, "GET", "/_apis/artifactcache/nothing", &[], Bytes::new()).await;
    assert_eq!(status, 404);
}

/// Two controllers (each its own cache over the same bucket or directory): what one
/// saves, the other restores; a key one committed, the other refuses; and a restart is
/// just another such cache.
async fn two_controllers_on_one_store_share_the_entries(backend: Backend) {
    let (first, second) = (backend.cache(roomy()), backend.cache(roomy()));
    let scope = main_branch("acme/app");
    assert_eq!(save_v1(&first, &scope, "shared", b"saved by the first", 7).await, (200, 200));
    assert_eq!(restore_v1(&second, &scope, &["shared"]).await.unwrap().1.as_ref(), b"saved by the first");
    assert_eq!(save_v1(&second, &scope, "shared", b"again", 7).await.0, 409);
}
