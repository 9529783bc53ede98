//! The state file (L8): what `prepare` created, so a restarted supervisor can clean it up.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::*;

/// The on-disk form of the state file (L8).
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct StateFile {
    pub(super) version: u32,
    #[serde(flatten)]
    pub(super) prepared: Prepared,
}

// ---- state file ----------------------------------------------------------------------

/// Reads a state file written by [`prepare`] (for `doctor`).
///
/// # Errors
/// Unreadable or not valid state.
pub fn read_state(path: &Path) -> Result<Prepared, StorageError> {
    let text = std::fs::read(path).map_err(|source| StorageError::ReadState { path: path.to_path_buf(), source })?;
    let state: StateFile = serde_json::from_slice(&text).map_err(|source| StorageError::DecodeState { path: path.to_path_buf(), source })?;
    Ok(state.prepared)
}

/// Atomically (write + rename) records `prepared`.
pub(super) fn write_state(path: &Path, prepared: &Prepared) -> Result<(), StorageError> {
    let write_error = |source| StorageError::WriteState { path: path.to_path_buf(), source };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(write_error)?;
    }
    let state = StateFile { version: STATE_VERSION, prepared: prepared.clone() };
    let mut json = serde_json::to_vec_pretty(&state).map_err(|e| write_error(e.into()))?;
    json.push(b'\n');
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, json).map_err(write_error)?;
    std::fs::rename(&tmp, path).map_err(write_error)
}

/// The state file is advisory (doctor, re-runs): storage works without it, so failing
/// to write it is logged, not fatal. `cleanup` leaves it in place (`Prepared` does not
/// carry its path); readers must confirm it against sysfs/mountinfo, as `adopt` does.
pub(super) fn record_state(config: &StorageConfig, prepared: &Prepared) {
    if let Err(error) = write_state(&config.state_file, prepared) {
        tracing::warn!(error = %error, cause = %error_source(&error), "storage state not recorded");
    }
}

pub(super) fn error_source(error: &dyn std::error::Error) -> String {
    error.source().map(ToString::to_string).unwrap_or_default()
}
