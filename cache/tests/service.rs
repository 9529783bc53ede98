//! The cache service through its HTTP interface, as `@actions/cache` calls it, on both
//! backends — a directory, and a real S3-compatible server (versitygw): the v1 and v2 flows,
//! GitHub's scoping, committed entries never overwritten, chunks out of order, ranges,
//! and the sweep's limits. The wire formats follow `@actions/cache` 4.x (its requests
//! and what it reads of the answers); the real client runs in the e2e tests.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{sync::Arc, time::Duration};

use cache::KeepFree;

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

    fn store(&self) -> cache::backend::Backend {
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
    Limits::new(1 << 30, 1 << 28, Duration::from_secs(3600))
}

fn main_branch(repository: &str) -> Scope {
    Scope::new(repository, "refs/heads/main", ["refs/heads/main".to_owned()]).for_job(format!("{repository}@main"))
}

fn pull_request(repository: &str, number: u32) -> Scope {
    Scope::new(repository, format!("refs/pull/{number}/head"), ["refs/heads/main".to_owned(), "refs/heads/main".to_owned()])
        .for_job(format!("{repository}#{number}"))
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
    let limits = Limits::new(250, 150, Duration::from_secs(3600));
    let cache = backend.cache(limits);
    let (a, b) = (main_branch("acme/a"), main_branch("acme/b"));
    // Each save swept as the sweep loop does after a commit (until then a commit counts
    // against the in-flight allowance, which is one largest entry here).
    let mut evicted = 0;
    let mut swept = cache::sweep::Swept::default();
    for (scope, key) in [(&a, "a1"), (&a, "a2"), (&a, "a3"), (&b, "b1"), (&b, "b2")] {
        assert_eq!(save_v1(&cache, scope, key, &[1u8; 60], 60).await, (200, 200), "{key}");
        tokio::time::sleep(backend.tick()).await;
        swept = cache.sweep().await.unwrap();
        evicted += swept.evicted;
    }
    // a: 180 > 150 → a1 goes; then 120 + 120 = 240 ≤ 250.
    assert_eq!((evicted, swept.entries, swept.bytes), (1, 4, 240), "{swept:?}");
    assert_eq!(restore_v1(&cache, &a, &["a1"]).await, None);
    assert!(restore_v1(&cache, &a, &["a2"]).await.is_some());
    assert_eq!(cache.metrics().stored_entries.get(), 4);
    let aged = backend.cache(Limits { max_age: Duration::ZERO, ..limits });
    tokio::time::sleep(backend.tick()).await;
    assert_eq!(aged.sweep().await.unwrap().entries, 0, "every entry is older than a zero age limit");
}

async fn a_save_larger_than_the_limit_is_refused_with_the_setting_named(backend: Backend) {
    let cache = backend.cache(Limits::new(1 << 20, 1000, Duration::from_secs(60)));
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

/// What one job's requests may hold, each bound tried as a hostile step would: refused
/// with its status, counted by its reason, and nothing of it left charged afterwards.
mod bounds {
    use super::*;

    fn refusals(cache: &Cache, reason: &str) -> u64 {
        cache.metrics().refusals.get_or_create(&cache::metrics::ReasonLabel { reason: reason.to_owned() }).get()
    }

    async fn reserve(cache: &Cache, scope: &Scope, key: &str, size: u64) -> (u16, Option<u64>, String) {
        let reserve = serde_json::json!({ "key": key, "version": VERSION, "cacheSize": size }).to_string();
        let (status, _, body) = call(cache, scope, "POST", "/_apis/artifactcache/caches", &[], reserve).await;
        let id = (status == 200).then(|| json(&body)["cacheId"].as_u64().unwrap());
        (status, id, String::from_utf8_lossy(&body).into_owned())
    }

    async fn patch(cache: &Cache, scope: &Scope, id: u64, start: u64, bytes: &'static [u8]) -> (u16, String) {
        let range = ("content-range", format!("bytes {start}-{}/*", start + bytes.len() as u64 - 1));
        let (status, _, body) = call(cache, scope, "PATCH", &format!("/_apis/artifactcache/caches/{id}"), &[range], Bytes::from_static(bytes)).await;
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn parts_never_overlap_nor_leave_the_reservation_and_an_upload_has_at_most_max_parts() {
        let backend = Backend::directory();
        let cache = backend.cache(roomy());
        let scope = main_branch("acme/app");
        let (_, id, _) = reserve(&cache, &scope, "k", 10).await;
        let id = id.unwrap();
        let table: &[(u64, &'static [u8], u16, &str)] = &[
            (0, b"hello", 204, "a part"),
            (0, b"HELLO", 204, "the same range again (a retry)"),
            (3, b"xyz", 416, "overlapping the first"),
            (8, b"abc", 416, "past the reservation of 10"),
            (5, b"world", 204, "the rest"),
        ];
        for (start, bytes, status, case) in table {
            assert_eq!(patch(&cache, &scope, id, *start, bytes).await.0, *status, "{case}");
        }
        assert_eq!((refusals(&cache, "overlap"), refusals(&cache, "outside_reservation")), (1, 1));
        let (status, _, _) = call(&cache, &scope, "POST", &format!("/_apis/artifactcache/caches/{id}"), &[], r#"{"size":10}"#).await;
        assert_eq!(status, 200);
        assert_eq!(restore_v1(&cache, &scope, &["k"]).await.unwrap().1.as_ref(), b"HELLOworld");

        // One-byte parts: inodes run out before bytes do.
        let (_, id, _) = reserve(&cache, &scope, "many", 2 * cache::scope::MAX_PARTS).await;
        let id = id.unwrap();
        for part in 0..cache::scope::MAX_PARTS {
            assert_eq!(patch(&cache, &scope, id, part, b"x").await.0, 204, "part {part}");
        }
        let (status, body) = patch(&cache, &scope, id, cache::scope::MAX_PARTS, b"x").await;
        assert_eq!(status, 429, "{body}");
        assert!(body.contains("at most 1024 parts"), "{body}");
        assert_eq!(refusals(&cache, "parts"), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn uploads_in_flight_are_bounded_per_job_per_repository_and_in_all_until_swept() {
        let backend = Backend::directory();
        // The largest entry 400: a job and a repository may have 400 in flight, all 800.
        let cache = backend.cache(Limits::new(1000, 400, Duration::from_secs(3600)));
        let (a1, a2) = (main_branch("acme/a"), pull_request("acme/a", 1));
        let (b, c) = (main_branch("acme/b"), main_branch("acme/c"));
        let table: &[(&Scope, &str, u64, u16, &str)] = &[
            (&a1, "a1-one", 300, 200, "within everything"),
            (&a1, "a1-two", 200, 429, "the job would hold 500"),
            (&a2, "a2-one", 100, 200, "another job of the repository"),
            (&a2, "a2-two", 1, 429, "the repository would hold 401"),
            (&b, "b-one", 400, 200, "another repository"),
            (&c, "c-one", 1, 429, "all would hold 801"),
        ];
        let mut ids = Vec::new();
        for (scope, key, size, status, case) in table {
            let (got, id, body) = reserve(&cache, scope, key, *size).await;
            assert_eq!(got, *status, "{case}: {body}");
            ids.extend(id.map(|id| (*scope, id, *size)));
        }
        for reason in ["job_uploading", "repository_uploading", "total_uploading"] {
            assert_eq!(refusals(&cache, reason), 1, "{reason}");
        }
        assert_eq!(cache.metrics().uploading_bytes.get(), 800);
        // Committed: still charged until a sweep has counted the entries.
        for (scope, id, size) in &ids {
            let data = vec![7u8; usize::try_from(*size).unwrap()];
            let range = ("content-range", format!("bytes 0-{}/*", size - 1));
            assert_eq!(call(&cache, scope, "PATCH", &format!("/_apis/artifactcache/caches/{id}"), &[range], data).await.0, 204);
            let commit = format!(r#"{{"size":{size}}}"#);
            assert_eq!(call(&cache, scope, "POST", &format!("/_apis/artifactcache/caches/{id}"), &[], commit).await.0, 200);
        }
        assert_eq!(reserve(&cache, &c, "c-one", 1).await.0, 429, "commits not swept yet");
        cache.sweep().await.unwrap();
        assert_eq!(cache.metrics().uploading_bytes.get(), 0);
        assert_eq!(reserve(&cache, &c, "c-one", 1).await.0, 200, "swept: counted among the committed entries now");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_has_at_most_eight_saves_open_and_unknown_sizes_are_charged_as_they_arrive() {
        let backend = Backend::directory();
        let cache = backend.cache(Limits::new(1 << 20, 1000, Duration::from_secs(3600)));
        let (job, other) = (main_branch("acme/a"), pull_request("acme/a", 2));
        for key in 0..cache::scope::MAX_OPEN_UPLOADS {
            assert_eq!(reserve(&cache, &job, &format!("open-{key}"), 0).await.0, 200);
        }
        let (status, _, body) = reserve(&cache, &job, "one-more", 0).await;
        assert_eq!(status, 429, "{body}");
        assert_eq!(refusals(&cache, "open_uploads"), 1);
        assert_eq!(reserve(&cache, &other, "theirs", 0).await.0, 200, "another job is not held to this one's");

        // v2, whose client announces no size: a PUT charged per frame, refused past the
        // largest entry (1000) at the block list too.
        let twirp = |method: &str| format!("/twirp/github.actions.results.api.v1.CacheService/{method}");
        let scope = main_branch("acme/v2");
        let (_, _, body) = call(&cache, &scope, "POST", &twirp("CreateCacheEntry"), &[], format!(r#"{{"key":"big","version":"{VERSION}"}}"#)).await;
        let upload = json(&body)["signed_upload_url"].as_str().unwrap().strip_prefix(BASE).unwrap().to_owned();
        for (id, status) in [("AAA%3D", 201), ("AAE%3D", 429)] {
            let (got, _, body) = call(&cache, &scope, "PUT", &format!("{upload}?comp=block&blockid={id}"), &[], vec![1u8; 600]).await;
            assert_eq!(got, status, "{}", String::from_utf8_lossy(&body));
        }
        assert_eq!(refusals(&cache, "job_uploading"), 1);
        let (status, _, body) = call(&cache, &scope, "PUT", &upload, &[], vec![1u8; 1001]).await;
        assert!(status == 400 || status == 429, "a single PUT over the largest entry: {status} {}", String::from_utf8_lossy(&body));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_has_at_most_sixteen_requests_in_progress() {
        let backend = Backend::directory();
        let cache = backend.cache(roomy());
        let scope = main_branch("acme/app");
        let data = vec![3u8; 8 << 20];
        assert_eq!(save_v1(&cache, &scope, "big", &data, 4 << 20).await, (200, 200));
        let (_, _, body) = call(&cache, &scope, "GET", &format!("/_apis/artifactcache/cache?keys=big&version={VERSION}"), &[], Bytes::new()).await;
        let path = json(&body)["archiveLocation"].as_str().unwrap().strip_prefix(BASE).unwrap().to_owned();
        let get = || http::Request::builder().method("GET").uri(path.as_str()).body(Full::new(Bytes::new())).unwrap();
        // Downloads left unread hold their place until dropped.
        let mut unread = Vec::new();
        for _ in 0..cache::service::MAX_REQUESTS_PER_JOB {
            let response = cache.handle(&scope, BASE, get()).await;
            assert_eq!(response.status(), 200);
            unread.push(response);
        }
        assert_eq!(cache.handle(&scope, BASE, get()).await.status(), 429);
        assert_eq!(refusals(&cache, "job_requests"), 1);
        assert_eq!(cache.handle(&pull_request("acme/app", 1), BASE, get()).await.status(), 200, "another job is served");
        unread.pop();
        let response = cache.handle(&scope, BASE, get()).await;
        assert_eq!(response.status(), 200, "one done: room again");
        assert_eq!(response.into_body().collect().await.unwrap().to_bytes().len(), data.len());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nothing_is_written_below_the_free_space_the_cache_keeps() {
        let backend = Backend::directory();
        let cache = backend.cache(roomy()).keep_free(KeepFree::Percent(100));
        let (status, _, body) = reserve(&cache, &main_branch("acme/app"), "k", 10).await;
        assert_eq!(status, 507, "{body}");
        assert!(body.contains("cache.keep_free"), "{body}");
        assert_eq!(refusals(&cache, "keep_free"), 1);
    }

    /// F6: an archive is read by the refs that may read its entry, not by anyone who
    /// learns its id; an entry evicted under a restore's mark is gone, not broken.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn archives_follow_ref_scoping_and_an_evicted_entry_can_be_saved_again() {
        let backend = Backend::directory();
        let cache = backend.cache(roomy());
        let (main, pr, sibling) = (main_branch("acme/app"), pull_request("acme/app", 3), pull_request("acme/app", 4));
        assert_eq!(save_v1(&cache, &pr, "secret", b"pull request 3's", 100).await, (200, 200));
        let (_, _, body) = call(&cache, &pr, "GET", &format!("/_apis/artifactcache/cache?keys=secret&version={VERSION}"), &[], Bytes::new()).await;
        let path = json(&body)["archiveLocation"].as_str().unwrap().strip_prefix(BASE).unwrap().to_owned();
        let fresh = backend.cache(roomy());
        for (who, scope, status) in [("its own job", &pr, 200), ("a sibling pull request", &sibling, 404), ("main", &main, 404)] {
            assert_eq!(call(&cache, scope, "GET", &path, &[], Bytes::new()).await.0, status, "{who}");
            assert_eq!(call(&fresh, scope, "GET", &path, &[], Bytes::new()).await.0, status, "{who}, on a controller that never saw the save");
        }
        assert_eq!(refusals(&cache, "unknown_archive"), 2);

        assert!(restore_v1(&cache, &main, &["gone"]).await.is_none());
        assert_eq!(save_v1(&cache, &main, "gone", b"old", 100).await, (200, 200));
        assert!(restore_v1(&cache, &main, &["gone"]).await.is_some(), "the restore marks the entry used");
        let aged = backend.cache(Limits::new(1 << 30, 1 << 28, Duration::ZERO));
        tokio::time::sleep(backend.tick()).await;
        aged.sweep().await.unwrap();
        assert!(restore_v1(&cache, &main, &["gone"]).await.is_none(), "evicted with its mark");
        // The race of the review's F6(a): a restore listed the entry before the sweep took
        // it, and writes its mark after. The mark alone is no entry; the next sweep drops it.
        use object_store::ObjectStoreExt as _;
        let late_mark = cache::store::Storage::used_path("acme/app", "refs/heads/main", VERSION, "gone");
        backend.store().store.put(&late_mark, object_store::PutPayload::default()).await.unwrap();
        assert!(restore_v1(&cache, &main, &["gone"]).await.is_none(), "a mark without its entry restores nothing");
        aged.sweep().await.unwrap();
        assert!(backend.store().store.head(&late_mark).await.is_err(), "the sweep drops a mark whose entry went");
        assert_eq!(save_v1(&cache, &main, "gone", b"new", 100).await, (200, 200), "the key saves again");
        assert_eq!(restore_v1(&cache, &main, &["gone"]).await.unwrap().1.as_ref(), b"new");
    }
}
