//! What a setting is to the part that owns it: an invalid setting, named by its full
//! path (`kubernetes.namespace`) with what to write instead, and how durations are
//! written. Each section of the configuration checks itself into [`Problems`], so a
//! file with several mistakes names them all at once instead of one per start.
//!
//! The ground floor of the configuration: the sections' owners (drivers, the store, the
//! facade) use it without knowing the file they are read from.

use std::fmt;

/// One setting that is wrong, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{setting}: {message}")]
pub struct Invalid {
    /// Its full name, e.g. `docker.memory`.
    pub setting: String,
    /// What is wrong and what to write instead.
    pub message: String,
}

impl Invalid {
    pub fn new(setting: impl Into<String>, message: impl Into<String>) -> Invalid {
        Invalid { setting: setting.into(), message: message.into() }
    }
}

/// Every invalid setting found, in the order the checks ran.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Problems(Vec<Invalid>);

impl Problems {
    /// Runs `check` and gives back what it found.
    ///
    /// # Errors
    /// Every problem `check` reported.
    pub fn check(check: impl FnOnce(&mut Problems)) -> Result<(), Problems> {
        let mut problems = Problems::default();
        check(&mut problems);
        if problems.0.is_empty() { Ok(()) } else { Err(problems) }
    }

    /// `setting` is wrong: `message` says why and what to write instead.
    pub fn add(&mut self, setting: impl Into<String>, message: impl Into<String>) {
        self.0.push(Invalid::new(setting, message));
    }

    pub fn push(&mut self, invalid: Invalid) {
        self.0.push(invalid);
    }

    /// The problems of `result`, if any.
    pub fn take<T>(&mut self, result: Result<T, Invalid>) -> Option<T> {
        result.map_err(|invalid| self.0.push(invalid)).ok()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Invalid> {
        self.0.iter()
    }

    /// The settings named, in order (for tests and summaries).
    pub fn settings(&self) -> Vec<&str> {
        self.0.iter().map(|invalid| invalid.setting.as_str()).collect()
    }
}

impl fmt::Display for Problems {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.as_slice() {
            [one] => write!(f, "{one}"),
            many => {
                write!(f, "{} settings are wrong", many.len())?;
                for invalid in many {
                    write!(f, "; {invalid}")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for Problems {}

/// `"90s"`, `"3h"` … for `#[serde(with = "crate::setting::duration")]`.
pub mod duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer};

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(deserializer)?;
        contract::units::parse_duration(&text).map_err(serde::de::Error::custom)
    }
}

/// An http(s) URL, as every URL setting of the controller must be; `what` ends the
/// message ("of the Gitea instance").
///
/// # Errors
/// The setting, and what it must be.
pub fn http_url(setting: &str, url: &str, what: &str) -> Result<(), Invalid> {
    if url.starts_with("http://") || url.starts_with("https://") {
        Ok(())
    } else {
        Err(Invalid::new(setting, format!("{url:?} must be an http(s) URL {what}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_are_reported_together_in_order() {
        assert_eq!(Problems::check(|_| {}), Ok(()));
        let problems = Problems::check(|p| {
            p.add("a.b", "is wrong");
            p.take(http_url("c.url", "gitea:3000", "of the Gitea instance"));
            p.take(http_url("d.url", "https://gitea", "of the Gitea instance"));
        })
        .unwrap_err();
        assert_eq!(problems.settings(), ["a.b", "c.url"]);
        assert_eq!(problems.to_string(), "2 settings are wrong; a.b: is wrong; c.url: \"gitea:3000\" must be an http(s) URL of the Gitea instance");
        let one = Problems::check(|p| p.add("a.b", "is wrong")).unwrap_err();
        assert_eq!(one.to_string(), "a.b: is wrong");
    }
}
