//! The cost of one reconciler sweep's store read against the history a controller has
//! accumulated (run by `scripts/bench sweep`): for each backend, 20 live assignments,
//! then `BENCH_HISTORY` (default 100,000) finished ones written through the store as the
//! lifecycle writes them (persist, then terminal — secrets removed, moved to the finished
//! records). Measured with and without that history, in the same run:
//!
//! - `list()`: what every sweep, keep-alive round, lease take and facade socket sync reads;
//! - the whole history read (`list()` and `list_finished()`): what each of them read
//!   before finished records were kept apart.
//!
//! Prints medians and their ratio to the same measure without history.

use std::{
    error::Error,
    time::{Duration, Instant},
};

use controller::{
    assignment::Placement,
    store::{Record, Store, embedded::Embedded, jetstream::JetStream, now_ms},
};
use futures_util::StreamExt as _;
use testkit::nats;

const LIVE: u64 = 20;
const SAMPLES: usize = 30;
const CONCURRENCY: usize = 32;
const PLACEMENT: Placement = Placement::CONTAINER_DOCKER;

type BenchResult<T> = Result<T, Box<dyn Error>>;

/// A realistic envelope: ~3 KiB of JSON text (redacted at the end, as the lifecycle does).
fn envelope(n: u64) -> Vec<u8> {
    format!(r#"{{"version":2,"id":"gitea-task-{n}","task":"{}"}}"#, "A".repeat(3000)).into_bytes()
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

async fn time_list(store: &dyn Store, whole: bool) -> BenchResult<Duration> {
    let mut samples = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        let started = Instant::now();
        let live = store.list().await?;
        assert_eq!(live.len() as u64, LIVE);
        if whole {
            store.list_finished().await?;
        }
        samples.push(started.elapsed());
    }
    Ok(median(samples))
}

async fn bench(name: &str, store: &dyn Store, history: u64) -> BenchResult<()> {
    for n in 0..LIVE {
        store.persist(&Record::pending(&format!("gitea-task-live-{n}"), PLACEMENT, "", envelope(n), now_ms())).await?;
    }
    let live_empty = time_list(store, false).await?;
    let whole_empty = time_list(store, true).await?;
    let started = Instant::now();
    let written: Vec<BenchResult<()>> = futures_util::stream::iter(0..history)
        .map(|n| async move {
            let id = format!("gitea-task-{n}");
            store.persist(&Record::pending(&id, PLACEMENT, "", envelope(n), now_ms())).await?;
            let current = store.get(&id).await?.ok_or("the record vanished")?;
            store.update(&current.value.ended("RESULT_SUCCESS".into(), None), current.revision).await?;
            Ok(())
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    for result in written {
        result?;
    }
    let writing = started.elapsed();
    let live_full = time_list(store, false).await?;
    let whole_full = time_list(store, true).await?;
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-9);
    println!("{name}: {history} finished records written in {:.1} s ({:.0}/s)", writing.as_secs_f64(), history as f64 / writing.as_secs_f64());
    println!(
        "  list() (one sweep's read), {LIVE} live: {:.2} ms without history, {:.2} ms with {history} finished: ratio {:.2}",
        live_empty.as_secs_f64() * 1000.0,
        live_full.as_secs_f64() * 1000.0,
        ratio(live_full, live_empty)
    );
    println!(
        "  the whole history (what each sweep read before): {:.2} ms without history, {:.2} ms with {history}: ratio {:.1}",
        whole_empty.as_secs_f64() * 1000.0,
        whole_full.as_secs_f64() * 1000.0,
        ratio(whole_full, whole_empty)
    );
    Ok(())
}

fn main() -> BenchResult<()> {
    let history: u64 = std::env::var("BENCH_HISTORY").ok().and_then(|v| v.parse().ok()).unwrap_or(100_000);
    // BENCH_STORES: `embedded`, `jetstream` or both (default).
    let stores = std::env::var("BENCH_STORES").unwrap_or_else(|_| "embedded,jetstream".into());
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async {
        if stores.contains("embedded") {
            let dir = tempfile::tempdir()?;
            let embedded = Embedded::open(&dir.path().join("store.redb"))?;
            bench("embedded (redb)", &embedded, history).await?;
        }
        if !stores.contains("jetstream") {
            return Ok(());
        }
        let server = nats::NatsServer::start();
        let jetstream = JetStream::connect(&server.url, "ci.assignments", "ci-assignments", Duration::from_secs(30)).await?;
        bench("jetstream (nats-server)", &jetstream, history).await
    })
}
