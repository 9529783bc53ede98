//! Store benchmark (run by `scripts/bench store`): for each backend, persist 1,000
//! assignments with ~4 KiB envelopes one after another (throughput, p50/p99 latency of
//! `persist`), then 1,000 more with 16 persists in flight, then consume and acknowledge
//! all of one placement's queue. Prints figures; asserts nothing about timing.
//!
//! Backends:
//! - `embedded`: redb on a temporary file (fsync on every commit).
//! - `jetstream`: a real nats-server with its default file store settings, which do NOT
//!   fsync per write (JetStream syncs every 2 minutes by default and relies on
//!   replication for durability).
//! - `jetstream-sync`: the same with `sync_interval: always`, the durability that
//!   matches redb's on a single server.

use testkit::nats;

use std::error::Error;
use std::time::{Duration, Instant};

use controller::assignment::Placement;
use controller::store::{Record, Store, embedded::Embedded, jetstream::JetStream};
use futures_util::StreamExt;

const N: u64 = 1_000;
const ENVELOPE_BYTES: usize = 4 * 1024;
const CONCURRENCY: usize = 16;
const SEQUENTIAL: Placement = Placement::CONTAINER_DOCKER;
const CONCURRENT: Placement = Placement::VM_OPENSANDBOX;

type BenchResult<T> = Result<T, Box<dyn Error>>;

/// Incompressible-looking bytes, like a serialized task with its secrets and payload.
fn envelope(seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..ENVELOPE_BYTES)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()[0]
        })
        .collect()
}

fn record(n: u64, placement: Placement) -> Record {
    Record::pending(&format!("gitea-task-{n}"), placement, "", envelope(n), controller::store::now_ms())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn rate(n: u64, d: Duration) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    let n = n as f64;
    n / d.as_secs_f64()
}

fn percentile(sorted: &[Duration], p: usize) -> Duration {
    sorted.get((sorted.len() * p / 100).min(sorted.len().saturating_sub(1))).copied().unwrap_or_default()
}

async fn run(name: &str, store: &dyn Store) -> BenchResult<()> {
    // 1. Sequential persists: the scheduler's pattern (persist, then fetch again).
    let records: Vec<Record> = (0..N).map(|n| record(n, SEQUENTIAL)).collect();
    let mut latencies = Vec::with_capacity(records.len());
    let started = Instant::now();
    for record in &records {
        let t = Instant::now();
        store.persist(record).await?;
        latencies.push(t.elapsed());
    }
    let sequential = started.elapsed();
    latencies.sort_unstable();

    // 2. Persists with CONCURRENCY in flight (several fetch loops at once).
    let records: Vec<Record> = (N..2 * N).map(|n| record(n, CONCURRENT)).collect();
    let started = Instant::now();
    let results: Vec<_> = futures_util::stream::iter(&records).map(|r| store.persist(r)).buffer_unordered(CONCURRENCY).collect().await;
    let concurrent = started.elapsed();
    for result in results {
        result?;
    }

    // 3. Consume + ack the sequential placement's 1,000, one worker, one at a time.
    let mut consumer = store.consumer(SEQUENTIAL, 64).await?;
    let started = Instant::now();
    for _ in 0..N {
        let delivery = consumer.next(Duration::from_secs(10)).await?.ok_or("queue ran dry before 1,000 deliveries")?;
        delivery.ack().await?;
    }
    let consumed = started.elapsed();

    println!(
        "{name:<16} {:>10.0} {:>8.2} {:>8.2} {:>8.2} {:>14.0} {:>14.0}",
        rate(N, sequential),
        ms(percentile(&latencies, 50)),
        ms(percentile(&latencies, 99)),
        ms(latencies.last().copied().unwrap_or_default()),
        rate(N, concurrent),
        rate(N, consumed),
    );
    Ok(())
}

#[tokio::main]
async fn main() -> BenchResult<()> {
    println!(
        "{N} assignments per run, {ENVELOPE_BYTES} B envelopes; persist/s and latencies sequential; \
         x{CONCURRENCY} = {CONCURRENCY} persists in flight; consume+ack sequential"
    );
    println!("{:<16} {:>10} {:>8} {:>8} {:>8} {:>14} {:>14}", "backend", "persist/s", "p50 ms", "p99 ms", "max ms", "persist/s x16", "consume+ack/s");

    let dir = tempfile::tempdir()?;
    let embedded = Embedded::open(&dir.path().join("bench.redb"))?;
    run("embedded", &embedded).await?;
    drop(embedded);

    let ack_wait = Duration::from_secs(30);
    let server = nats::NatsServer::start();
    let jetstream = JetStream::connect(&server.url, "ci.assignments", "assignments", ack_wait).await?;
    run("jetstream", &jetstream).await?;
    drop(jetstream);
    drop(server);

    let server = nats::NatsServer::start_with_config(Some("jetstream { sync_interval: always }\n"));
    let jetstream = JetStream::connect(&server.url, "ci.assignments", "assignments", ack_wait).await?;
    run("jetstream-sync", &jetstream).await?;
    Ok(())
}
