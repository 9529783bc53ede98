//! The assignment capability: a short bearer token the controller gives one
//! environment (env [`ENV`]) so that it may act for exactly its own assignment until
//! an expiry time.
//!
//! Format: `v1.<assignment id>.<expires at, Unix seconds>.<mac>`, where `mac` is the
//! unpadded base64url HMAC-SHA256 over `"v1\n<assignment id>\n<expires at>"`. The
//! expiry is a canonical decimal (no sign, no leading zeros), so each capability has
//! one spelling. Verification checks, in order: the format, the MAC (constant time),
//! the assignment it is bound to, then the expiry (expired once `now ≥ expires at`).
//! Checking the MAC first means a "wrong assignment" or "expired" answer is only ever
//! given for a capability this controller really issued.
//!
//! Neither the key nor a capability is ever printed: `Debug` of the key is
//! `CapabilityKey(..)` and no error message carries capability text.

use std::fmt;
use std::fs::File;
use std::io::Read as _;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::hmac;

/// The environment variable that carries the capability into an environment.
pub const ENV: &str = "CI_RUNNER_CAPABILITY";
/// Fewest bytes of key material accepted.
pub const MIN_KEY_LEN: usize = 32;
/// Largest key file read (a larger file is surely the wrong file).
const MAX_KEY_FILE: u64 = 64 * 1024;
/// Longest capability looked at.
const MAX_CAPABILITY: usize = 1024;
const PREFIX: &str = "v1.";
/// Bytes of an HMAC-SHA256 tag.
const MAC_LEN: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum CapabilityError {
    #[error("cannot read the capability key file {}: check that it exists and that this process may read it", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("capability key {} is not a regular file: point the setting at the file that holds the key", .path.display())]
    NotAFile { path: PathBuf },

    #[error("capability key file {} has mode {mode:04o}, which lets group or others access it: run `chmod 600 {}` (in Kubernetes set `defaultMode: 0400` on the secret volume)", .path.display(), .path.display())]
    Permissions { path: PathBuf, mode: u32 },

    #[error("capability key file {} is larger than {limit} bytes: point the setting at the file that holds only the key", .path.display())]
    KeyFileTooLarge { path: PathBuf, limit: u64 },

    #[error("capability key has {len} bytes but needs at least {MIN_KEY_LEN}: generate one with `head -c 32 /dev/urandom | base64 -w0 > key && chmod 600 key`")]
    KeyTooShort { len: usize },

    #[error("capability is malformed ({reason}): the environment must pass `{ENV}` on exactly as it received it")]
    Malformed { reason: &'static str },

    #[error("capability signature does not verify: it was altered or issued with another key; the environment must use the capability it was given")]
    BadSignature,

    #[error("capability was issued for assignment {found:?}, not {expected:?}: an environment may only act for its own assignment")]
    WrongAssignment { expected: String, found: String },

    #[error("capability expired at {expires_at} (Unix seconds; now {now}): the assignment outlived its capability and must be ended")]
    Expired { expires_at: u64, now: u64 },
}

/// 24 random bytes, hex: a token of no other meaning (run-local's job token).
///
/// # Errors
/// When the system has no randomness to offer.
pub fn random_token() -> Result<String, ring::error::Unspecified> {
    use ring::rand::SecureRandom as _;
    let mut bytes = [0u8; 24];
    ring::rand::SystemRandom::new().fill(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The HMAC key that signs capabilities.
#[derive(Clone)]
pub struct CapabilityKey {
    key: hmac::Key,
}

impl fmt::Debug for CapabilityKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CapabilityKey(..)")
    }
}

impl CapabilityKey {
    /// A key from raw key material.
    ///
    /// # Errors
    /// [`CapabilityError::KeyTooShort`] below [`MIN_KEY_LEN`] bytes.
    pub fn from_bytes(material: &[u8]) -> Result<CapabilityKey, CapabilityError> {
        if material.len() < MIN_KEY_LEN {
            return Err(CapabilityError::KeyTooShort { len: material.len() });
        }
        Ok(CapabilityKey { key: hmac::Key::new(hmac::HMAC_SHA256, material) })
    }

    /// A fresh random key, for a controller that signs and verifies in one process
    /// (`run-local`).
    ///
    /// # Errors
    /// When the system has no randomness to offer.
    pub fn random() -> Result<CapabilityKey, ring::error::Unspecified> {
        use ring::rand::SecureRandom as _;
        let mut material = [0u8; 48];
        ring::rand::SystemRandom::new().fill(&mut material)?;
        Ok(CapabilityKey { key: hmac::Key::new(hmac::HMAC_SHA256, &material) })
    }

    /// A key from a file: its bytes, less one trailing `\n` (or `\r\n`), are the key
    /// material (so `base64 > key` files work; the text itself is the key). The file
    /// must be a regular file (symlinks are followed) with no group or other permission
    /// bits, and at most 64 KiB. Mode and content are read from the same open file.
    ///
    /// # Errors
    /// [`CapabilityError::Io`], [`CapabilityError::NotAFile`],
    /// [`CapabilityError::Permissions`], [`CapabilityError::KeyFileTooLarge`] or
    /// [`CapabilityError::KeyTooShort`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<CapabilityKey, CapabilityError> {
        let path = path.as_ref();
        let io = |source| CapabilityError::Io { path: path.to_owned(), source };
        let file = File::open(path).map_err(io)?;
        let metadata = file.metadata().map_err(io)?;
        if !metadata.is_file() {
            return Err(CapabilityError::NotAFile { path: path.to_owned() });
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = metadata.permissions().mode() & 0o7777;
            if mode & 0o077 != 0 {
                return Err(CapabilityError::Permissions { path: path.to_owned(), mode });
            }
        }
        let mut material = Vec::new();
        file.take(MAX_KEY_FILE + 1).read_to_end(&mut material).map_err(io)?;
        if material.len() as u64 > MAX_KEY_FILE {
            return Err(CapabilityError::KeyFileTooLarge { path: path.to_owned(), limit: MAX_KEY_FILE });
        }
        let material = material.strip_suffix(b"\n").map_or(material.as_slice(), |m| m.strip_suffix(b"\r").unwrap_or(m));
        CapabilityKey::from_bytes(material)
    }

    /// A capability for `assignment_id` (non-empty) valid until `expires_at_unix`
    /// (exclusive).
    pub fn issue(&self, assignment_id: &str, expires_at_unix: u64) -> String {
        let expires = expires_at_unix.to_string();
        let tag = hmac::sign(&self.key, signed_message(assignment_id, &expires).as_bytes());
        format!("{PREFIX}{assignment_id}.{expires}.{}", URL_SAFE_NO_PAD.encode(tag.as_ref()))
    }

    /// Accepts `capability` iff this key issued it for `assignment_id` and it has not
    /// expired at `now_unix`.
    ///
    /// # Errors
    /// [`CapabilityError::Malformed`], [`CapabilityError::BadSignature`],
    /// [`CapabilityError::WrongAssignment`] or [`CapabilityError::Expired`].
    pub fn verify(&self, capability: &str, assignment_id: &str, now_unix: u64) -> Result<(), CapabilityError> {
        let malformed = |reason| CapabilityError::Malformed { reason };
        if capability.len() > MAX_CAPABILITY {
            return Err(malformed("longer than 1024 bytes"));
        }
        let rest = capability.strip_prefix(PREFIX).ok_or(malformed("it does not start with `v1.`"))?;
        let (rest, mac) = rest.rsplit_once('.').ok_or(malformed("it lacks the expiry and signature"))?;
        let (id, expires) = rest.rsplit_once('.').ok_or(malformed("it lacks the assignment id or expiry"))?;
        if id.is_empty() {
            return Err(malformed("the assignment id is empty"));
        }
        let canonical = !expires.is_empty() && expires.bytes().all(|b| b.is_ascii_digit()) && (expires == "0" || !expires.starts_with('0'));
        let expires_at: u64 = match expires.parse() {
            Ok(n) if canonical => n,
            _ => return Err(malformed("the expiry is not a canonical decimal number")),
        };
        let mac = URL_SAFE_NO_PAD.decode(mac).map_err(|_| malformed("the signature is not unpadded base64url"))?;
        if mac.len() != MAC_LEN {
            return Err(malformed("the signature has the wrong length"));
        }
        hmac::verify(&self.key, signed_message(id, expires).as_bytes(), &mac).map_err(|_| CapabilityError::BadSignature)?;
        if id != assignment_id {
            return Err(CapabilityError::WrongAssignment { expected: assignment_id.to_owned(), found: id.to_owned() });
        }
        if now_unix >= expires_at {
            return Err(CapabilityError::Expired { expires_at, now: now_unix });
        }
        Ok(())
    }
}

impl CapabilityKey {
    /// The proof that this key's installation made the environment `name` (the value of
    /// `driver::LABEL_PROOF`): 32 hex digits of MAC — hex, because label values of
    /// Kubernetes and OpenSandbox must start and end with a letter or digit.
    pub fn prove(&self, name: &str) -> String {
        let tag = hmac::sign(&self.key, format!("environment\n{name}").as_bytes());
        tag.as_ref()[..16].iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Whether `proof` is this key's proof for `name`.
    pub fn proves(&self, name: &str, proof: &str) -> bool {
        let expected = self.prove(name);
        // Constant time: every byte is compared whatever the first difference.
        expected.len() == proof.len() && expected.bytes().zip(proof.bytes()).fold(0u8, |differs, (a, b)| differs | (a ^ b)) == 0
    }
}

/// What a session capability is bound to: the assignment id and a scope no assignment
/// id can spell (ids are `[A-Za-z0-9._-]`), so the capability an environment was given
/// never verifies as a session and a session never claims.
pub fn session_scope(assignment_id: &str) -> String {
    format!("{assignment_id}/session")
}

fn signed_message(assignment_id: &str, expires: &str) -> String {
    format!("v1\n{assignment_id}\n{expires}")
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    const ID: &str = "gitea-task-1";
    const EXP: u64 = 1_700_000_000;

    fn key() -> CapabilityKey {
        CapabilityKey::from_bytes(&[b'k'; 32]).unwrap()
    }

    /// Every capability that differs from a valid one in one character — at every
    /// position, by every printable ASCII character and a few others — is refused.
    #[test]
    fn every_one_character_mutation_is_refused() {
        let key = key();
        let capability = key.issue(ID, EXP + 3600);
        key.verify(&capability, ID, EXP).unwrap();
        let replacements: Vec<char> = (0x20u8..0x7f).map(char::from).chain(['\0', '\n', 'é', '\u{202e}']).collect();
        let chars: Vec<char> = capability.chars().collect();
        let (mut tried, mut by_error) = (0usize, std::collections::BTreeMap::<&str, usize>::new());
        for position in 0..chars.len() {
            for replacement in &replacements {
                if *replacement == chars[position] {
                    continue;
                }
                let mut mutated = chars.clone();
                mutated[position] = *replacement;
                let mutated: String = mutated.into_iter().collect();
                tried += 1;
                let class = match key.verify(&mutated, ID, EXP) {
                    Ok(()) => panic!("{mutated:?} (position {position}) was accepted"),
                    Err(CapabilityError::Malformed { .. }) => "malformed",
                    Err(CapabilityError::BadSignature) => "bad signature",
                    Err(CapabilityError::WrongAssignment { .. }) => "wrong assignment",
                    Err(CapabilityError::Expired { .. }) => "expired",
                    Err(other) => panic!("unexpected {other:?}"),
                };
                *by_error.entry(class).or_default() += 1;
            }
        }
        println!("capability of {} characters: {tried} one-character mutations refused: {by_error:?}", chars.len());
        assert!(tried > 5000);
    }

    #[test]
    fn known_answer() {
        assert_eq!(key().issue(ID, EXP), "v1.gitea-task-1.1700000000.sv22Job9JwRJyt0p3XEtI3MDwYGe-ejJre20MWhXQUg");
    }

    #[test]
    fn round_trip_and_expiry() {
        let key = key();
        let cap = key.issue(ID, EXP);
        let rows: Vec<(&str, u64, Result<(), &str>)> = vec![
            (ID, 0, Ok(())),
            (ID, EXP - 1, Ok(())),
            (ID, EXP, Err("expired")),
            (ID, EXP + 1, Err("expired")),
            (ID, u64::MAX, Err("expired")),
            ("gitea-task-2", 0, Err("wrong")),
            ("gitea-task-10", 0, Err("wrong")),
            ("", 0, Err("wrong")),
        ];
        for (id, now, want) in rows {
            let got = key.verify(&cap, id, now);
            match (want, &got) {
                (Ok(()), Ok(())) => {}
                (Err("expired"), Err(CapabilityError::Expired { expires_at: EXP, now: n })) if *n == now => {}
                (Err("wrong"), Err(CapabilityError::WrongAssignment { expected, found })) if expected == id && found == ID => {}
                _ => panic!("{id} {now}: {got:?}"),
            }
        }
        // Ids with dots and expiries at the edges.
        for (id, exp) in [("a.b.c", 5), ("gitea-task-9223372036854775807", u64::MAX), ("x", 1)] {
            assert!(key.verify(&key.issue(id, exp), id, exp - 1).is_ok(), "{id}");
        }
        assert!(matches!(key.verify(&key.issue(ID, 0), ID, 0), Err(CapabilityError::Expired { expires_at: 0, now: 0 })));
    }

    #[test]
    fn a_proof_names_one_environment_of_one_key() {
        let (key, other) = (key(), CapabilityKey::from_bytes(&[b'o'; 32]).unwrap());
        let proof = key.prove("gdr-abc-gitea-task-1");
        assert_eq!(proof.len(), 32);
        assert!(proof.bytes().all(|b| b.is_ascii_hexdigit()), "not a valid label value: {proof}");
        assert!(key.proves("gdr-abc-gitea-task-1", &proof));
        assert!(!key.proves("gdr-abc-gitea-task-2", &proof));
        assert!(!other.proves("gdr-abc-gitea-task-1", &proof));
        assert!(!key.proves("gdr-abc-gitea-task-1", ""));
    }

    #[test]
    fn a_session_and_the_environments_capability_never_stand_in_for_each_other() {
        let key = key();
        let given = key.issue(ID, EXP);
        let session = key.issue(&session_scope(ID), EXP);
        assert!(key.verify(&given, ID, 0).is_ok() && key.verify(&session, &session_scope(ID), 0).is_ok());
        assert!(matches!(key.verify(&given, &session_scope(ID), 0), Err(CapabilityError::WrongAssignment { .. })));
        assert!(matches!(key.verify(&session, ID, 0), Err(CapabilityError::WrongAssignment { .. })));
        assert!(key.verify(&session, &session_scope("gitea-task-2"), 0).is_err());
    }

    #[test]
    fn tampering_table() {
        let key = key();
        let cap = key.issue(ID, EXP);
        let mac = cap.rsplit('.').next().unwrap().to_owned();
        let other_key = CapabilityKey::from_bytes(&[b'j'; 32]).unwrap();
        let flipped = format!("{}{}", if mac.starts_with('A') { 'B' } else { 'A' }, &mac[1..]);
        type Check = fn(&CapabilityError) -> bool;
        let rows: Vec<(String, Check)> = vec![
            // Tampered expiry, id and MAC.
            (cap.replace(".1700000000.", ".1800000000."), |e| matches!(e, CapabilityError::BadSignature)),
            (cap.replace(".1700000000.", ".1699999999."), |e| matches!(e, CapabilityError::BadSignature)),
            (cap.replace("gitea-task-1", "gitea-task-2"), |e| matches!(e, CapabilityError::BadSignature)),
            (cap.replace(&mac, &flipped), |e| matches!(e, CapabilityError::BadSignature)),
            (other_key.issue(ID, EXP), |e| matches!(e, CapabilityError::BadSignature)),
            (cap.replace(&mac, &URL_SAFE_NO_PAD.encode([0u8; 32])), |e| matches!(e, CapabilityError::BadSignature)),
            // Malformed.
            (String::new(), |e| matches!(e, CapabilityError::Malformed { .. })),
            ("v1".into(), |e| matches!(e, CapabilityError::Malformed { .. })),
            ("v1.".into(), |e| matches!(e, CapabilityError::Malformed { .. })),
            ("v1...".into(), |e| matches!(e, CapabilityError::Malformed { .. })),
            (cap.replacen("v1.", "v2.", 1), |e| matches!(e, CapabilityError::Malformed { .. })),
            (cap.replacen("v1.", "V1.", 1), |e| matches!(e, CapabilityError::Malformed { .. })),
            (format!(" {cap}"), |e| matches!(e, CapabilityError::Malformed { .. })),
            (format!("{cap} "), |e| matches!(e, CapabilityError::Malformed { .. })),
            (format!("{cap}="), |e| matches!(e, CapabilityError::Malformed { .. })),
            (format!("{cap}A"), |e| matches!(e, CapabilityError::Malformed { .. })),
            (cap.replace(".1700000000.", ".01700000000."), |e| matches!(e, CapabilityError::Malformed { .. })),
            (cap.replace(".1700000000.", ".+1700000000."), |e| matches!(e, CapabilityError::Malformed { .. })),
            (cap.replace(".1700000000.", ".-1."), |e| matches!(e, CapabilityError::Malformed { .. })),
            (cap.replace(".1700000000.", ".."), |e| matches!(e, CapabilityError::Malformed { .. })),
            (cap.replace(".1700000000.", ".18446744073709551616."), |e| matches!(e, CapabilityError::Malformed { .. })),
            (cap.replace("gitea-task-1.", "."), |e| matches!(e, CapabilityError::Malformed { .. })),
            (cap.replace(&mac, &mac.replace(['-', '_'], "+")), |e| matches!(e, CapabilityError::Malformed { .. })),
            (format!("v1.{}.1.{mac}", "a".repeat(1100)), |e| matches!(e, CapabilityError::Malformed { .. })),
        ];
        for (tampered, want) in rows {
            let got = key.verify(&tampered, ID, 0);
            assert!(got.as_ref().is_err_and(want), "{tampered:?}: {got:?}");
            let text = got.unwrap_err().to_string();
            assert!(!text.contains(&mac), "{text}");
            if tampered.len() > 10 {
                assert!(!text.contains(&tampered), "{text}");
            }
        }
    }

    #[test]
    fn every_truncation_is_refused() {
        let key = key();
        let cap = key.issue(ID, EXP);
        for len in 0..cap.len() {
            let got = key.verify(&cap[..len], ID, 0);
            assert!(matches!(got, Err(CapabilityError::Malformed { .. } | CapabilityError::BadSignature)), "{len}: {got:?}");
        }
    }

    #[test]
    fn key_length_table() {
        for (len, ok) in [(0, false), (1, false), (31, false), (32, true), (33, true), (1024, true)] {
            let got = CapabilityKey::from_bytes(&vec![7u8; len]);
            assert_eq!(got.is_ok(), ok, "{len}");
            if let Err(e) = got {
                assert!(matches!(e, CapabilityError::KeyTooShort { len: l } if l == len));
                assert!(e.to_string().contains("at least 32"));
            }
        }
    }

    fn write_key(dir: &Path, name: &str, content: &[u8], mode: u32) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, content).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    #[test]
    fn key_file_table() {
        let dir = tempfile::tempdir().unwrap();
        let material = [b'k'; 32];
        let with_newline = [&material[..], b"\n"].concat();
        let with_crlf = [&material[..], b"\r\n"].concat();
        let two_newlines = [&material[..31], b"\n\n"].concat();
        let short_newline = [&material[..31], b"\n"].concat();
        let big = vec![b'k'; 64 * 1024 + 1];
        type Check = fn(&Result<CapabilityKey, CapabilityError>) -> bool;
        let rows: Vec<(&str, &[u8], u32, Check)> = vec![
            ("plain", &material, 0o600, |r| r.is_ok()),
            ("newline", &with_newline, 0o600, |r| r.is_ok()),
            ("crlf", &with_crlf, 0o600, |r| r.is_ok()),
            ("readonly", &material, 0o400, |r| r.is_ok()),
            ("short", &material[..31], 0o600, |r| matches!(r, Err(CapabilityError::KeyTooShort { len: 31 }))),
            ("short-newline", &short_newline, 0o600, |r| matches!(r, Err(CapabilityError::KeyTooShort { len: 31 }))),
            // Only one newline is trimmed: 31 bytes + "\n" is 32 bytes of key material.
            ("two-newlines", &two_newlines, 0o600, |r| r.is_ok()),
            ("empty", b"", 0o600, |r| matches!(r, Err(CapabilityError::KeyTooShort { len: 0 }))),
            ("big", &big, 0o600, |r| matches!(r, Err(CapabilityError::KeyFileTooLarge { .. }))),
            ("world", &material, 0o644, |r| matches!(r, Err(CapabilityError::Permissions { mode: 0o644, .. }))),
            ("group", &material, 0o640, |r| matches!(r, Err(CapabilityError::Permissions { mode: 0o640, .. }))),
            ("group-write", &material, 0o620, |r| matches!(r, Err(CapabilityError::Permissions { .. }))),
            ("other-exec", &material, 0o601, |r| matches!(r, Err(CapabilityError::Permissions { .. }))),
        ];
        for (name, content, mode, want) in rows {
            let path = write_key(dir.path(), name, content, mode);
            let got = CapabilityKey::from_file(&path);
            assert!(want(&got), "{name}: {got:?}");
        }
        // The trimmed file key equals the raw key.
        let from_file = CapabilityKey::from_file(dir.path().join("newline")).unwrap();
        assert!(from_file.verify(&key().issue(ID, EXP), ID, 0).is_ok());

        let refused = CapabilityKey::from_file(dir.path().join("world")).unwrap_err().to_string();
        assert!(refused.contains("chmod 600") && refused.contains("0644"), "{refused}");
        assert!(matches!(CapabilityKey::from_file(dir.path().join("missing")), Err(CapabilityError::Io { .. })));
        assert!(matches!(CapabilityKey::from_file(dir.path()), Err(CapabilityError::NotAFile { .. })));
        std::os::unix::fs::symlink(dir.path().join("plain"), dir.path().join("link")).unwrap();
        assert!(CapabilityKey::from_file(dir.path().join("link")).is_ok());
    }

    #[test]
    fn key_is_never_printed() {
        let material = "a-very-secret-key-material-0123456789";
        let key = CapabilityKey::from_bytes(material.as_bytes()).unwrap();
        assert_eq!(format!("{key:?}"), "CapabilityKey(..)");
        assert_eq!(format!("{:?}", Some(&key)), "Some(CapabilityKey(..))");
    }
}
