//! The Kubernetes driver (placement `container.kubernetes`): one Pod per assignment in
//! one namespace, from the shared runner image with the supervisor as PID 1.
//!
//! - **Names.** The Pod's name is the environment's name (derived from the assignment),
//!   so a create repeated after a crash gets `AlreadyExists` and adopts the first Pod.
//! - **Contract.** The environment contract as env, `restartPolicy: Never` (a job runs
//!   once), no service-account token, no service links, `emptyDir` volumes for the loop
//!   image and the runner's work (they go with the Pod), the job's ceiling as
//!   `activeDeadlineSeconds`. Privileged by default; clusters whose nodes refuse it get
//!   an explicit capability list.
//! - **Ends.** A Pod that fails or cannot start reports why in the kubelet's words
//!   (image pull errors, `OOMKilled`, eviction, `DeadlineExceeded`, deletion by someone
//!   else); the worker fails the task with that as its last log line.
//! - **Deletion** is graceful (the supervisor drains within the grace period) and waits
//!   until the Pod is gone. A Pod counts against its placement's capacity until its job
//!   container has ended; the kubelet then needs a few seconds to tear down the rest.

//!
//! Layout: [`config`] (the `[kubernetes]` settings and their checks), [`spec`] (the Pod
//! made for an assignment), [`phase`] (what a Pod's status means for its job); this
//! module is the driver that creates, watches and deletes the Pods.

mod config;
mod phase;
mod spec;

use std::{collections::BTreeMap, time::Duration};

use async_trait::async_trait;
use k8s_openapi::api::core::v1::Pod;
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, PostParams},
};

pub use self::{
    config::{KubernetesConfig, WorkloadApiVolume},
    phase::{PULL_PATIENCE, environment_of},
    spec::ANNOTATION_SPIFFE_ID,
};
use super::{Driver, DriverError, Environment, EnvironmentSpec, LABEL_MANAGED, LABEL_PLACEMENT, Phase};
use crate::assignment::placement::Placement;

/// The container's name in every job Pod.
const CONTAINER: &str = "job";

#[derive(Clone)]
pub struct KubernetesDriver {
    placement: Placement,
    pods: Api<Pod>,
    config: KubernetesConfig,
}

impl std::fmt::Debug for KubernetesDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubernetesDriver").field("placement", &self.placement).field("namespace", &self.config.namespace).finish_non_exhaustive()
    }
}

impl KubernetesDriver {
    /// Connects with the configured kubeconfig (or the in-cluster ServiceAccount) and
    /// checks that Pods in the namespace can be listed.
    ///
    /// # Errors
    /// An invalid configuration, no usable credentials, an API server that does not
    /// answer, or no permission to list Pods.
    pub async fn connect(config: KubernetesConfig) -> Result<Self, DriverError> {
        let placement = Placement::CONTAINER_KUBERNETES;
        let unavailable = |detail: String| DriverError::Unavailable { placement: placement.to_string(), detail };
        crate::setting::Problems::check(|problems| config.validate(problems)).map_err(|problems| unavailable(problems.to_string()))?;
        let client_config = match &config.kubeconfig {
            Some(path) => {
                let kubeconfig =
                    kube::config::Kubeconfig::read_from(path).map_err(|e| unavailable(format!("kubernetes.kubeconfig {}: {e}", path.display())))?;
                kube::Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default())
                    .await
                    .map_err(|e| unavailable(format!("kubernetes.kubeconfig {}: {e}", path.display())))?
            }
            None => kube::Config::infer()
                .await
                .map_err(|e| unavailable(format!("no Kubernetes credentials (not in a cluster, no KUBECONFIG; set kubernetes.kubeconfig): {e}")))?,
        };
        let client = Client::try_from(client_config).map_err(|e| unavailable(format!("cannot build the Kubernetes client: {e}")))?;
        let pods: Api<Pod> = Api::namespaced(client, &config.namespace);
        let driver = KubernetesDriver { placement, pods, config };
        driver.pods.list_metadata(&ListParams::default().limit(1)).await.map_err(|e| driver.api_error("listing Pods in", &driver.config.namespace, &e))?;
        Ok(driver)
    }

    fn unavailable(&self, detail: impl Into<String>) -> DriverError {
        DriverError::Unavailable { placement: self.placement.to_string(), detail: detail.into() }
    }

    /// What the API server said, with what to check; `Refused` only where the Pod
    /// itself is invalid (a retry cannot help), `Unavailable` otherwise (the assignment
    /// waits: RBAC, quota or the server can be fixed meanwhile).
    fn api_error(&self, doing: &str, name: &str, error: &kube::Error) -> DriverError {
        match error {
            kube::Error::Api(status) => {
                let hint = match status.code {
                    403 if status.message.contains("exceeded quota") => " (the namespace's ResourceQuota is full; retrying later)".to_owned(),
                    401 | 403 => {
                        format!(" (check the controller's RBAC: it needs get, list, watch, create and delete on pods in namespace {})", self.config.namespace)
                    }
                    404 if doing.starts_with("listing") => format!(" (does namespace {} exist?)", self.config.namespace),
                    _ => String::new(),
                };
                let detail = format!("{doing} {name}: {} ({}){hint}", status.message, status.reason);
                if matches!(status.code, 400 | 422) {
                    DriverError::Refused { placement: self.placement.to_string(), name: name.to_owned(), detail }
                } else {
                    self.unavailable(detail)
                }
            }
            other => self.unavailable(format!("{doing} {name}: {}", crate::error_chain(other))),
        }
    }

    /// Deletes `name` gracefully and waits (up to its grace period and a minute more)
    /// until it is gone.
    async fn delete_and_wait(&self, name: &str) -> Result<(), DriverError> {
        match self.pods.delete(name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => return Ok(()),
            Err(error) => return Err(self.api_error("deleting", name, &error)),
        }
        let deadline = tokio::time::Instant::now() + self.config.termination_grace + Duration::from_secs(60);
        loop {
            match self.pods.get_opt(name).await {
                Ok(None) => return Ok(()),
                Ok(Some(_)) if tokio::time::Instant::now() >= deadline => {
                    return Err(self.unavailable(format!("Pod {name} is still terminating after its grace period; is its node reachable?")));
                }
                Ok(Some(_)) => tokio::time::sleep(Duration::from_millis(500)).await,
                Err(error) => return Err(self.api_error("waiting for the deletion of", name, &error)),
            }
        }
    }

    fn label_selector(selector: &BTreeMap<String, String>) -> String {
        std::iter::once(format!("{LABEL_MANAGED}=true")).chain(selector.iter().map(|(k, v)| format!("{k}={v}"))).collect::<Vec<_>>().join(",")
    }
}

#[async_trait]
impl Driver for KubernetesDriver {
    fn placement(&self) -> Placement {
        self.placement
    }

    async fn create(&self, spec: &EnvironmentSpec) -> Result<Environment, DriverError> {
        match self.pods.create(&PostParams::default(), &self.pod(spec)).await {
            Ok(pod) => Ok(environment_of(&pod)),
            // An earlier attempt created it: that one is the environment.
            Err(kube::Error::Api(status)) if status.code == 409 => {
                self.get(&spec.name).await?.ok_or_else(|| self.unavailable(format!("Pod {} exists and vanished at once; retrying", spec.name)))
            }
            Err(error) => Err(self.api_error("creating Pod", &spec.name, &error)),
        }
    }

    async fn get(&self, name: &str) -> Result<Option<Environment>, DriverError> {
        let pod = self.pods.get_opt(name).await.map_err(|e| self.api_error("reading Pod", name, &e))?;
        Ok(pod.as_ref().map(environment_of))
    }

    async fn list(&self, selector: &BTreeMap<String, String>) -> Result<Vec<Environment>, DriverError> {
        let params = ListParams::default().labels(&Self::label_selector(selector));
        let pods = self.pods.list(&params).await.map_err(|e| self.api_error("listing Pods in", &self.config.namespace, &e))?;
        Ok(pods.items.iter().map(environment_of).collect())
    }

    async fn stop(&self, name: &str) -> Result<(), DriverError> {
        // A graceful delete is a stop: SIGTERM, the supervisor drains, then SIGKILL.
        self.delete_and_wait(name).await
    }

    async fn delete(&self, name: &str) -> Result<(), DriverError> {
        self.delete_and_wait(name).await
    }

    async fn changes(&self) -> Result<Option<super::Changes>, DriverError> {
        use futures_util::StreamExt as _;
        use kube::runtime::{WatchStreamExt as _, watcher};
        let selector = format!("{LABEL_MANAGED}=true,{LABEL_PLACEMENT}={}", self.placement);
        let events = watcher(self.pods.clone(), watcher::Config::default().labels(&selector)).default_backoff();
        // Every status update of an ending Pod is an event: report each Pod's end once.
        let reported = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashSet::<String>::new()));
        let changes = events
            .filter_map(move |event| {
                let reported = std::sync::Arc::clone(&reported);
                async move {
                    let mut reported = reported.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    match event {
                        Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => {
                            let environment = environment_of(&pod);
                            (environment.phase != Phase::Running && reported.insert(environment.name.clone())).then_some(environment)
                        }
                        Ok(watcher::Event::Delete(pod)) => {
                            let mut environment = environment_of(&pod);
                            if reported.remove(&environment.name) {
                                return None;
                            }
                            if environment.phase == Phase::Running {
                                environment.phase = Phase::Exited;
                                environment.detail = format!("the job container did not report its end{}", phase::DELETED);
                            }
                            Some(environment)
                        }
                        Ok(_) => None,
                        Err(error) => {
                            tracing::debug!(%error, "watching Pods (the watcher retries)");
                            None
                        }
                    }
                }
            })
            .boxed();
        Ok(Some(changes))
    }
}
