//! Which committed entry a restore gets, by GitHub's rules: the scopes are searched in
//! order (the job's own ref, then its pull request's base branch, then the default
//! branch); within a scope, the primary key exactly, then the primary key as a prefix,
//! then each restore key as a prefix, the newest entry of a prefix winning. The version
//! (paths and compression) must match exactly; the caller lists only that version.

use crate::store::EntryMeta;

/// The entry `keys` (the primary key first, then the restore keys) restore, from the
/// committed entries of each scope in the order the scopes are searched.
pub fn choose<'a>(scopes: &'a [Vec<EntryMeta>], keys: &[String]) -> Option<&'a EntryMeta> {
    let (primary, _) = keys.split_first()?;
    scopes.iter().find_map(|entries| {
        entries
            .iter()
            .find(|entry| entry.key == *primary)
            .or_else(|| keys.iter().find_map(|key| newest(entries.iter().filter(|entry| entry.key.starts_with(key.as_str())))))
    })
}

fn newest<'a>(entries: impl Iterator<Item = &'a EntryMeta>) -> Option<&'a EntryMeta> {
    entries.max_by_key(|entry| (entry.created_ms, entry.id))
}

/// What a key must be: GitHub's rules (`@actions/cache` checks them before it asks).
///
/// # Errors
/// What is wrong with it.
pub fn check_key(key: &str) -> Result<(), String> {
    if key.is_empty() {
        return Err("a key must not be empty".to_owned());
    }
    if key.len() > 512 {
        return Err(format!("a key is at most 512 characters; this one has {}", key.len()));
    }
    if key.contains(',') {
        return Err(format!("a key must not contain a comma: {key:?}"));
    }
    Ok(())
}

/// What a version must be: the toolkit sends a sha256 in hex; anything printable and
/// short is taken (other clients), nothing that could escape a path.
///
/// # Errors
/// What is wrong with it.
pub fn check_version(version: &str) -> Result<(), String> {
    if version.is_empty() || version.len() > 128 || !version.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.') {
        return Err(format!("the version {version:?} must be 1 to 128 letters, digits, '-', '_' or '.'"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: u64, key: &str, created_ms: i64) -> EntryMeta {
        EntryMeta { id, key: key.to_owned(), version: "v".into(), repository: "o/r".into(), git_ref: "refs/heads/main".into(), size: 1, created_ms }
    }

    fn keys(list: &[&str]) -> Vec<String> {
        list.iter().map(|k| (*k).to_owned()).collect()
    }

    /// (entries of each scope, keys) → the id restored.
    #[test]
    fn scopes_then_exact_then_prefixes_newest_first() {
        let own = vec![entry(1, "deps-linux-aaa", 10), entry(2, "deps-linux-bbb", 20), entry(3, "deps-mac", 30)];
        let base = vec![entry(11, "deps-linux-ccc", 40), entry(12, "tools", 5)];
        let scopes = vec![own.clone(), base.clone()];
        let table: &[(&[&str], Option<u64>)] = &[
            (&["deps-linux-aaa"], Some(1)),
            // The primary key as a prefix: the newest of the scope.
            (&["deps-linux"], Some(2)),
            // An exact match wins over a newer prefix match.
            (&["deps-linux-aaa", "deps-"], Some(1)),
            // Restore keys in order, each newest first.
            (&["nothing", "deps-mac", "deps-"], Some(3)),
            (&["nothing", "deps-"], Some(3)),
            // The own scope is searched through before the base.
            (&["deps-linux-ccc", "deps-linux"], Some(2)),
            (&["tools"], Some(12)),
            (&["tool"], Some(12)),
            (&["nothing", "also-nothing"], None),
            (&[], None),
        ];
        for (keys_given, expected) in table {
            assert_eq!(choose(&scopes, &keys(keys_given)).map(|e| e.id), *expected, "{keys_given:?}");
        }
        assert_eq!(choose(&[Vec::new(), base], &keys(&["deps-linux-ccc"])).map(|e| e.id), Some(11), "an empty own scope falls through");
    }

    #[test]
    fn keys_and_versions_are_checked() {
        assert!(check_key("node-modules-abc").is_ok());
        for bad in ["", "a,b"] {
            assert!(check_key(bad).is_err(), "{bad:?}");
        }
        assert!(check_key(&"k".repeat(513)).is_err());
        assert!(check_version("4a12dc7233002e19937c6dadb33c15edb28fbb956a35e586003f83acdc591d39").is_ok());
        for bad in ["", "../x", "a/b", "a b"] {
            assert!(check_version(bad).is_err(), "{bad:?}");
        }
    }
}
