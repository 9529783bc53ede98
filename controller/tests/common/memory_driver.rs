//! An in-memory environment driver for the controller's tests — the real drivers
//! (docker, kubernetes, opensandbox) are separate; this one only records what it was
//! asked, so tests can count environments and check idempotency.

#![allow(dead_code, clippy::unwrap_used)]

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use async_trait::async_trait;
use controller::{
    assignment::Placement,
    driver::{Driver, DriverError, Environment, EnvironmentSpec, Phase},
};

#[derive(Debug, Default)]
pub struct Recorded {
    pub environments: BTreeMap<String, (EnvironmentSpec, Phase)>,
    pub creates: usize,
    pub deletes: usize,
}

#[derive(Debug, Clone)]
pub struct MemoryDriver {
    pub placement: Placement,
    pub recorded: Arc<Mutex<Recorded>>,
}

impl MemoryDriver {
    pub fn new(placement: &str) -> Self {
        MemoryDriver { placement: placement.parse().unwrap(), recorded: Arc::default() }
    }

    pub fn live(&self) -> usize {
        self.recorded.lock().unwrap().environments.values().filter(|(_, phase)| *phase == Phase::Running).count()
    }
}

fn environment(spec: &EnvironmentSpec, phase: Phase) -> Environment {
    Environment {
        name: spec.name.clone(),
        assignment_id: spec.assignment_id.clone(),
        labels: spec.labels.clone(),
        phase,
        detail: String::new(),
        exit_code: None,
    }
}

#[async_trait]
impl Driver for MemoryDriver {
    fn placement(&self) -> Placement {
        self.placement
    }

    async fn create(&self, spec: &EnvironmentSpec) -> Result<Environment, DriverError> {
        let mut recorded = self.recorded.lock().unwrap();
        recorded.creates += 1;
        let (spec, phase) = recorded.environments.entry(spec.name.clone()).or_insert_with(|| (spec.clone(), Phase::Running)).clone();
        Ok(environment(&spec, phase))
    }

    async fn get(&self, name: &str) -> Result<Option<Environment>, DriverError> {
        Ok(self.recorded.lock().unwrap().environments.get(name).map(|(spec, phase)| environment(spec, *phase)))
    }

    async fn list(&self, selector: &BTreeMap<String, String>) -> Result<Vec<Environment>, DriverError> {
        Ok(self
            .recorded
            .lock()
            .unwrap()
            .environments
            .values()
            .filter(|(spec, _)| selector.iter().all(|(k, v)| spec.labels.get(k) == Some(v)))
            .map(|(spec, phase)| environment(spec, *phase))
            .collect())
    }

    /// Like the real drivers: stops it and deletes it.
    async fn stop(&self, name: &str) -> Result<(), DriverError> {
        self.delete(name).await
    }

    async fn delete(&self, name: &str) -> Result<(), DriverError> {
        let mut recorded = self.recorded.lock().unwrap();
        recorded.deletes += 1;
        recorded.environments.remove(name);
        Ok(())
    }
}
