//! A REAL S3-compatible server for the cache's S3 backend: versitygw (Versity's
//! production S3 gateway, from the Go module proxy by scripts/install test-peers) serving a
//! directory of its own on a free port of 127.0.0.1, with static credentials and one
//! bucket; stopped when dropped.

use std::{path::PathBuf, process::Stdio, time::Duration};

pub const ACCESS_KEY_ID: &str = "gdr-test-access-key";
pub const SECRET_ACCESS_KEY: &str = "gdr-test-secret-access-key";

#[derive(Debug)]
pub struct S3Server {
    _process: crate::KillOnDrop,
    dir: tempfile::TempDir,
    /// e.g. `http://127.0.0.1:20123`
    pub endpoint: String,
    pub bucket: String,
}

impl S3Server {
    /// Starts versitygw with the bucket `bucket` and waits (up to 30 s) until it answers.
    pub fn start(bucket: &str) -> S3Server {
        let binary = crate::peer("versitygw");
        let dir = tempfile::Builder::new().prefix("gdr-test-s3-").tempdir().unwrap();
        // The posix backend's buckets are its directory's subdirectories.
        std::fs::create_dir(dir.path().join(bucket)).unwrap();
        let port = crate::free_local_port();
        let log = std::fs::File::create(dir.path().join("versitygw.log")).unwrap();
        let child = std::process::Command::new(&binary)
            .arg("--port")
            .arg(format!("127.0.0.1:{port}"))
            .arg("posix")
            .arg(dir.path())
            .env("ROOT_ACCESS_KEY_ID", ACCESS_KEY_ID)
            .env("ROOT_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("{} cannot start: {e}: run scripts/install test-peers", binary.display()));
        let server = S3Server { _process: crate::KillOnDrop(child), dir, endpoint: format!("http://127.0.0.1:{port}"), bucket: bucket.to_owned() };
        crate::wait_until_blocking("versitygw answers", Duration::from_secs(30), || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
        server
    }

    /// What it wrote about itself.
    pub fn log(&self) -> String {
        crate::log_tail(&self.dir.path().join("versitygw.log"), 40).unwrap_or_default()
    }

    /// Where the bucket's objects are on disk.
    pub fn bucket_dir(&self) -> PathBuf {
        self.dir.path().join(&self.bucket)
    }
}
