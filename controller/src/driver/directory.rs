//! A test driver (feature `test-driver`, never in release builds): environments are
//! JSON files in a directory, so a crash-safety test running the real controller
//! process can see what was created and play the environment itself. The real drivers
//! (docker, kubernetes, opensandbox) are separate.

use std::{collections::BTreeMap, path::PathBuf};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::{
    assignment::Placement,
    driver::{Driver, DriverError, Environment, EnvironmentSpec, Phase},
};

#[derive(Debug, Clone)]
pub struct DirectoryDriver {
    pub placement: Placement,
    pub dir: PathBuf,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Stored {
    pub name: String,
    pub assignment_id: String,
    pub labels: BTreeMap<String, String>,
    pub env: BTreeMap<String, String>,
    pub terminal: bool,
    pub creates: u32,
}

impl DirectoryDriver {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.json"))
    }

    fn read(&self, name: &str) -> Result<Option<Stored>, DriverError> {
        match std::fs::read(self.path(name)) {
            Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| self.unavailable(e.to_string())),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(error) => Err(self.unavailable(error.to_string())),
        }
    }

    fn write(&self, stored: &Stored) -> Result<(), DriverError> {
        let temporary = self.dir.join(format!(".{}.tmp", stored.name));
        let bytes = serde_json::to_vec_pretty(stored).map_err(|e| self.unavailable(e.to_string()))?;
        std::fs::write(&temporary, bytes).map_err(|e| self.unavailable(e.to_string()))?;
        std::fs::rename(&temporary, self.path(&stored.name)).map_err(|e| self.unavailable(e.to_string()))
    }

    fn unavailable(&self, detail: String) -> DriverError {
        DriverError::Unavailable { placement: self.placement.to_string(), detail }
    }
}

fn environment(stored: &Stored) -> Environment {
    Environment {
        name: stored.name.clone(),
        assignment_id: stored.assignment_id.clone(),
        labels: stored.labels.clone(),
        phase: if stored.terminal { Phase::Terminal } else { Phase::Running },
        detail: String::new(),
        exit_code: None,
    }
}

#[async_trait]
impl Driver for DirectoryDriver {
    fn placement(&self) -> Placement {
        self.placement
    }

    async fn create(&self, spec: &EnvironmentSpec) -> Result<Environment, DriverError> {
        std::fs::create_dir_all(&self.dir).map_err(|e| self.unavailable(e.to_string()))?;
        let mut stored = self.read(&spec.name)?.unwrap_or(Stored {
            name: spec.name.clone(),
            assignment_id: spec.assignment_id.clone(),
            labels: spec.labels.clone(),
            env: spec.env.clone(),
            terminal: false,
            creates: 0,
        });
        // Counted, so tests can see that a retried create found the first environment.
        stored.creates += 1;
        self.write(&stored)?;
        Ok(environment(&stored))
    }

    async fn get(&self, name: &str) -> Result<Option<Environment>, DriverError> {
        Ok(self.read(name)?.as_ref().map(environment))
    }

    async fn list(&self, selector: &BTreeMap<String, String>) -> Result<Vec<Environment>, DriverError> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return Ok(Vec::new()) };
        let mut found = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(name) = name.strip_suffix(".json")
                && let Some(stored) = self.read(name)?
                && selector.iter().all(|(k, v)| stored.labels.get(k) == Some(v))
            {
                found.push(environment(&stored));
            }
        }
        Ok(found)
    }

    async fn stop(&self, name: &str) -> Result<(), DriverError> {
        if let Some(mut stored) = self.read(name)? {
            stored.terminal = true;
            self.write(&stored)?;
        }
        Ok(())
    }

    async fn delete(&self, name: &str) -> Result<(), DriverError> {
        match std::fs::remove_file(self.path(name)) {
            Ok(()) => Ok(()),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(error) => Err(self.unavailable(error.to_string())),
        }
    }
}
