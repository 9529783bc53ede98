//! The controller's configuration for a test, built as a TOML document instead of
//! written out by hand: the settings every test controller shares are set once here,
//! and a test names only what it changes (its store, pool, driver, intervals). Values go
//! through the `toml` crate, so paths and strings are quoted correctly.

use std::path::{Path, PathBuf};

use toml::{Table, Value};

#[derive(Debug, Clone)]
pub struct ControllerConfig {
    dir: PathBuf,
    doc: Table,
}

impl ControllerConfig {
    /// A controller of Gitea at `gitea_url` whose files live in `dir`: the registration
    /// token (written there now), a capability key (written once, 0600, so a restarted
    /// controller keeps it), the runners' credentials, an embedded store, trust domain
    /// example.org, the facade's environment sockets in `dir/environments`, HTTP on a
    /// free port, the jobs' cache in `dir/cache`, and FetchTask every 100 ms. No pool and no driver yet.
    pub fn new(dir: &Path, gitea_url: &str, registration_token: &str) -> ControllerConfig {
        std::fs::write(dir.join("registration-token"), registration_token).unwrap();
        let key = dir.join("capability.key");
        if !key.exists() {
            write_secret(&key, "0123456789abcdef0123456789abcdef-test-capability-key\n");
        }
        let file = |name: &str| dir.join(name).display().to_string();
        ControllerConfig { dir: dir.to_owned(), doc: Table::new() }
            .set("gitea.url", gitea_url)
            .set("gitea.registration_token_file", file("registration-token"))
            .set("gitea.credential_dir", file("runners"))
            .set("gitea.fetch_interval", "100ms")
            .set("gitea.fetch_interval_max", "100ms")
            .set("identity.trust_domain", "example.org")
            .set("store.kind", "embedded")
            .set("store.path", file("store.redb"))
            .set("facade.capability_key_file", file("capability.key"))
            .set("facade.environment_socket_dir", file("environments"))
            .set("http.listen", "127.0.0.1:0")
            .set("cache.dir", file("cache"))
    }

    /// Sets `section.key` (or a deeper dotted path), making the tables on the way.
    #[must_use]
    pub fn set(mut self, path: &str, value: impl Into<Value>) -> ControllerConfig {
        let (tables, key) = path.rsplit_once('.').map_or(("", path), |(tables, key)| (tables, key));
        let mut table = &mut self.doc;
        for name in tables.split('.').filter(|n| !n.is_empty()) {
            table = table.entry(name).or_insert_with(|| Value::Table(Table::new())).as_table_mut().unwrap_or_else(|| panic!("{name} in {path} is not a table"));
        }
        table.insert(key.to_owned(), value.into());
        self
    }

    /// Removes `section.key`.
    #[must_use]
    pub fn unset(mut self, path: &str) -> ControllerConfig {
        if let Some((section, key)) = path.split_once('.')
            && let Some(table) = self.doc.get_mut(section).and_then(Value::as_table_mut)
        {
            table.remove(key);
        }
        self
    }

    /// The JetStream store at `url` instead of the embedded one (and, as several
    /// controllers on one store would need a directory they all see, no cache).
    #[must_use]
    pub fn jetstream(mut self, url: &str) -> ControllerConfig {
        self.doc.insert("store".into(), Value::Table(Table::new()));
        self.set("store.kind", "jetstream").set("store.url", url).unset("cache.dir")
    }

    /// Adds a `[[pool]]`.
    #[must_use]
    pub fn pool(mut self, placement: &str, capacity: usize) -> ControllerConfig {
        let mut pool = Table::new();
        pool.insert("placement".into(), placement.into());
        pool.insert("capacity".into(), Value::Integer(i64::try_from(capacity).unwrap()));
        let pools = self.doc.entry("pool").or_insert_with(|| Value::Array(Vec::new()));
        pools.as_array_mut().unwrap().push(Value::Table(pool));
        self
    }

    /// Merges a TOML document (whole sections, e.g. a driver's `[docker]` or a
    /// `[kubernetes]` with its sub-tables) into this one; its values win.
    #[must_use]
    pub fn merge(mut self, text: &str) -> ControllerConfig {
        let other: Table = text.parse().unwrap_or_else(|e| panic!("not TOML ({e}):\n{text}"));
        merge(&mut self.doc, other);
        self
    }

    /// Merges TOML key lines into `section` (e.g. a test's extra `[gitea]` settings).
    #[must_use]
    pub fn merge_into(self, section: &str, lines: &str) -> ControllerConfig {
        let text = format!("[{section}]\n{lines}");
        self.merge(&text)
    }

    /// Replaces `section` with TOML key lines (e.g. a test's own `[store]`).
    #[must_use]
    pub fn replace(mut self, section: &str, lines: &str) -> ControllerConfig {
        self.doc.remove(section);
        self.merge_into(section, lines)
    }

    pub fn text(&self) -> String {
        toml::to_string(&self.doc).unwrap()
    }

    /// Writes it as `dir/<name>` and returns the path.
    pub fn write(&self, name: &str) -> PathBuf {
        let path = self.dir.join(name);
        std::fs::write(&path, self.text()).unwrap();
        path
    }
}

fn merge(into: &mut Table, from: Table) {
    for (key, value) in from {
        match (into.get_mut(&key), value) {
            (Some(Value::Table(mine)), Value::Table(theirs)) => merge(mine, theirs),
            (_, value) => {
                into.insert(key, value);
            }
        }
    }
}

/// Writes a secret file as the controller wants it: readable by its owner only.
pub fn write_secret(path: &Path, content: &str) {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path).unwrap();
    std::io::Write::write_all(&mut file, content.as_bytes()).unwrap();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_test_names_only_what_it_changes() {
        let dir = tempfile::tempdir().unwrap();
        let config = ControllerConfig::new(dir.path(), "http://127.0.0.1:3000", "token")
            .jetstream("nats://127.0.0.1:4222")
            .set("store.ack_wait", "2s")
            .set("gitea.lease_ttl", "2s")
            .pool("container.docker", 4)
            .merge("[docker]\nimage = \"busybox\"\ncap_add = [\"ALL\"]\n")
            .merge_into("gitea", "installation = \"crash\"");
        let doc: Table = config.text().parse().unwrap();
        assert_eq!(doc["gitea"]["url"].as_str(), Some("http://127.0.0.1:3000"));
        assert_eq!(doc["gitea"]["installation"].as_str(), Some("crash"));
        assert_eq!(doc["gitea"]["fetch_interval"].as_str(), Some("100ms"), "the shared settings stay");
        assert_eq!(doc["store"].as_table().unwrap().len(), 3, "no embedded path left: {}", doc["store"]);
        assert_eq!(doc["pool"][0]["capacity"].as_integer(), Some(4));
        assert_eq!(doc["docker"]["cap_add"][0].as_str(), Some("ALL"));
        assert_eq!(std::fs::read_to_string(dir.path().join("registration-token")).unwrap(), "token");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(dir.path().join("capability.key")).unwrap().permissions().mode() & 0o777, 0o600);
    }
}
