#![allow(dead_code, unused_imports)]

pub use testkit::fake_gitea;
pub mod counting_store;
pub mod dockerd;
pub mod memory_driver;

/// The fetch loops' settings of these tests: a steady 50 ms poll (no backoff), FetchTask's
/// deadline 5 s, up to 8 loops.
pub fn scheduler_config(rules: controller::assignment::Rules) -> controller::scheduler::SchedulerConfig {
    let interval = std::time::Duration::from_millis(50);
    controller::scheduler::SchedulerConfig {
        rules,
        fetch_interval: interval,
        fetch_interval_max: interval,
        fetch_timeout: std::time::Duration::from_secs(5),
        max_loops: 8,
    }
}

/// A controller's `gdr_pool_in_use` gauge, read from its `/metrics` at `metrics`
/// (`host:port`); `None` while it does not answer.
pub async fn pool_in_use(metrics: &str) -> Option<u64> {
    let mut stream = tokio::net::TcpStream::connect(metrics).await.ok()?;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream.write_all(format!("GET /metrics HTTP/1.0\r\nHost: {metrics}\r\n\r\n").as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    response.lines().find(|l| l.starts_with("gdr_pool_in_use{")).and_then(|l| l.rsplit(' ').next()).and_then(|v| v.parse::<f64>().ok()).map(|v| v as u64)
}
