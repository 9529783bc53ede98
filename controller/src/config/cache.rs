//! `[cache]`: the cache that survives the job (`actions/cache`) — where it keeps its
//! entries (a directory on this host, or an S3-compatible bucket several controllers
//! share), how much, and for how long.

use std::{path::PathBuf, time::Duration};

use serde::Deserialize;

use crate::setting::{Problems, duration, http_url};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheConfig {
    /// Off: jobs' `actions/cache` saves nothing and restores nothing (each is told why).
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// A directory of this host. No default: where jobs' uploads go is the operator's
    /// choice, best a filesystem apart from the store's (a full cache must never stop the
    /// store's writes); several controllers need `[cache.s3]`, or one directory they all
    /// share.
    pub dir: Option<PathBuf>,
    /// An S3-compatible bucket instead of `dir`.
    pub s3: Option<S3Config>,
    /// All repositories' entries together, e.g. `50G`.
    #[serde(default = "default_max_size")]
    pub max_size: String,
    /// One repository's entries together (the largest entry too), e.g. `10G`.
    #[serde(default = "default_max_repository_size")]
    pub max_repository_size: String,
    /// An entry not restored for this long goes.
    #[serde(default = "default_max_age", with = "duration")]
    pub max_age: Duration,
    /// What saves not yet committed (and commits the sweep has not counted yet) may hold
    /// beyond `max_size`, all jobs together; a job and a repository at most one largest
    /// entry of it. Default: twice `max_repository_size` (the least it may be).
    #[serde(default)]
    pub max_uploading: Option<String>,
    /// The free space the cache leaves on `dir`'s filesystem: a size (`2G`) or a share of
    /// the filesystem (`10%`); below it, saves are refused (507) and restores go on.
    #[serde(default = "default_keep_free")]
    pub keep_free: String,
    /// How often old and excess entries are removed (and soon after each save).
    #[serde(default = "default_sweep_interval", with = "duration")]
    pub sweep_interval: Duration,
}

/// `[cache.s3]`: the bucket, and its credentials from files.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3Config {
    pub bucket: String,
    /// The service's URL, e.g. `https://s3.example.com` (default: AWS for `region`).
    pub endpoint: Option<String>,
    #[serde(default = "default_region")]
    pub region: String,
    /// Objects under this prefix of the bucket (e.g. `gitea-dynamic-runner/`).
    #[serde(default)]
    pub prefix: String,
    pub access_key_id_file: PathBuf,
    pub secret_access_key_file: PathBuf,
    /// Path-style URLs (`endpoint/bucket/key`), as most S3-compatible servers want.
    #[serde(default = "default_true")]
    pub path_style: bool,
}

fn default_true() -> bool {
    true
}
fn default_max_size() -> String {
    "50G".into()
}
fn default_max_repository_size() -> String {
    "10G".into()
}
fn default_keep_free() -> String {
    "2G".into()
}
fn default_max_age() -> Duration {
    Duration::from_secs(7 * 24 * 3600)
}
fn default_sweep_interval() -> Duration {
    Duration::from_secs(600)
}
fn default_region() -> String {
    "us-east-1".into()
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            enabled: true,
            dir: None,
            s3: None,
            max_size: default_max_size(),
            max_repository_size: default_max_repository_size(),
            max_age: default_max_age(),
            max_uploading: None,
            keep_free: default_keep_free(),
            sweep_interval: default_sweep_interval(),
        }
    }
}

/// Where the cache keeps its entries, once the configuration is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheStorage {
    Directory(PathBuf),
    S3(Box<S3Settings>),
}

/// `[cache.s3]` resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Settings {
    pub bucket: String,
    pub endpoint: Option<String>,
    pub region: String,
    pub prefix: String,
    pub access_key_id_file: PathBuf,
    pub secret_access_key_file: PathBuf,
    pub path_style: bool,
}

impl CacheConfig {
    /// The limits, once validated.
    pub fn limits(&self) -> cache::Limits {
        let mut limits = cache::Limits::new(
            contract::units::parse_size(&self.max_size).unwrap_or(50 << 30),
            contract::units::parse_size(&self.max_repository_size).unwrap_or(10 << 30),
            self.max_age,
        );
        if let Some(max_uploading) = self.max_uploading.as_deref().and_then(|value| contract::units::parse_size(value).ok()) {
            limits.max_uploading = max_uploading;
        }
        limits
    }

    /// The free space kept on the cache's filesystem, once validated.
    pub fn keep_free(&self) -> cache::KeepFree {
        parse_keep_free(&self.keep_free).unwrap_or(cache::KeepFree::Bytes(2 << 30))
    }

    /// Where entries go: `[cache.s3]` or `dir`; `None` when the cache is off or has
    /// nowhere to go.
    pub fn storage(&self) -> Option<CacheStorage> {
        if !self.enabled {
            return None;
        }
        if let Some(s3) = &self.s3 {
            return Some(CacheStorage::S3(Box::new(S3Settings {
                bucket: s3.bucket.clone(),
                endpoint: s3.endpoint.clone(),
                region: s3.region.clone(),
                prefix: s3.prefix.clone(),
                access_key_id_file: s3.access_key_id_file.clone(),
                secret_access_key_file: s3.secret_access_key_file.clone(),
                path_style: s3.path_style,
            })));
        }
        self.dir.clone().map(CacheStorage::Directory)
    }

    pub fn validate(&self, problems: &mut Problems) {
        for (setting, value) in [("cache.max_size", &self.max_size), ("cache.max_repository_size", &self.max_repository_size)] {
            if let Err(message) = contract::units::parse_size(value) {
                problems.add(setting, message);
            }
        }
        let limits = self.limits();
        if limits.max_repository > limits.max_total {
            problems.add("cache.max_repository_size", format!("{} is more than cache.max_size ({})", self.max_repository_size, self.max_size));
        }
        if let Some(max_uploading) = &self.max_uploading {
            match contract::units::parse_size(max_uploading) {
                Err(message) => problems.add("cache.max_uploading", message),
                Ok(bytes) if bytes < 2 * limits.max_entry() => problems.add(
                    "cache.max_uploading",
                    format!(
                        "{max_uploading} is less than twice the largest entry ({} MB, the lesser of cache.max_size and cache.max_repository_size): \
                         one job could not save its largest entry",
                        limits.max_entry() >> 20
                    ),
                ),
                Ok(_) => {}
            }
        }
        if let Err(message) = parse_keep_free(&self.keep_free) {
            problems.add("cache.keep_free", message);
        }
        if self.max_age < Duration::from_secs(3600) {
            problems.add("cache.max_age", "must be at least 1h (entries of a day's jobs should survive the day)");
        }
        if self.sweep_interval < Duration::from_secs(10) {
            problems.add("cache.sweep_interval", "must be at least 10s");
        }
        if let Some(dir) = &self.dir
            && !dir.is_absolute()
        {
            problems.add("cache.dir", format!("{} must be an absolute path", dir.display()));
        }
        if let Some(s3) = &self.s3 {
            if self.dir.is_some() {
                problems.add("cache.dir", "set either cache.dir or [cache.s3], not both");
            }
            s3.validate(problems);
        }
    }
}

/// `2G` or `10%`.
fn parse_keep_free(value: &str) -> Result<cache::KeepFree, String> {
    if let Some(percent) = value.trim().strip_suffix('%') {
        return match percent.trim().parse::<u8>() {
            Ok(percent) if percent < 100 => Ok(cache::KeepFree::Percent(percent)),
            _ => Err(format!("{value:?} is not a share of the filesystem: use 0% to 99%")),
        };
    }
    contract::units::parse_size(value).map(cache::KeepFree::Bytes).map_err(|message| format!("{message}, or a share such as 10%"))
}

impl S3Config {
    fn validate(&self, problems: &mut Problems) {
        let bucket = &self.bucket;
        if bucket.len() < 3 || bucket.len() > 63 || !bucket.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.') {
            problems.add("cache.s3.bucket", format!("{bucket:?} is not a bucket name (3 to 63 lower-case letters, digits, '-' and '.')"));
        }
        if let Some(endpoint) = &self.endpoint {
            problems.take(http_url("cache.s3.endpoint", endpoint, "of the S3-compatible service"));
        }
        for (setting, path) in [("cache.s3.access_key_id_file", &self.access_key_id_file), ("cache.s3.secret_access_key_file", &self.secret_access_key_file)] {
            if !path.is_absolute() {
                problems.add(setting, format!("{} must be an absolute path (secrets are read from files only)", path.display()));
            }
        }
        if self.prefix.starts_with('/') {
            problems.add("cache.s3.prefix", format!("{:?} must not start with '/'", self.prefix));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_saves_may_hold_and_the_room_they_leave_are_checked() {
        // (max_uploading, keep_free, the setting refused, or none)
        let table: &[(Option<&str>, &str, Option<&str>)] = &[
            (None, "2G", None),
            (Some("20G"), "10%", None),
            (Some("19G"), "2G", Some("cache.max_uploading")),
            (Some("lots"), "2G", Some("cache.max_uploading")),
            (None, "100%", Some("cache.keep_free")),
            (None, "half", Some("cache.keep_free")),
            (None, "0%", None),
        ];
        for (max_uploading, keep_free, refused) in table {
            let config = CacheConfig { max_uploading: max_uploading.map(str::to_owned), keep_free: (*keep_free).to_owned(), ..CacheConfig::default() };
            let checked = Problems::check(|problems| config.validate(problems));
            match refused {
                None => assert!(checked.is_ok(), "{max_uploading:?} {keep_free}: {checked:?}"),
                Some(setting) => assert!(format!("{:?}", checked.unwrap_err()).contains(setting), "{max_uploading:?} {keep_free}"),
            }
        }
        let config = CacheConfig { max_uploading: Some("30G".into()), keep_free: "10%".into(), ..CacheConfig::default() };
        assert_eq!(config.limits().max_uploading, 30 << 30);
        assert_eq!(config.keep_free(), cache::KeepFree::Percent(10));
        assert_eq!(CacheConfig::default().limits().max_uploading, 20 << 30, "twice the largest entry");
        assert_eq!(CacheConfig::default().storage(), None, "no directory unless the operator names one");
    }
}
