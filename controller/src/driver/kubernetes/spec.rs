//! The Pod made for an assignment: the environment contract as env, the runner image
//! with the supervisor as PID 1, the job's volumes, limits and deadline.

use std::collections::BTreeMap;

use contract::environment::supervisor;
use k8s_openapi::{
    api::core::v1::{
        CSIVolumeSource, Capabilities, Container, EmptyDirVolumeSource, EnvVar, HostPathVolumeSource, Pod, PodSpec, ResourceRequirements, SecurityContext,
        Volume, VolumeMount,
    },
    apimachinery::pkg::api::resource::Quantity,
};
use kube::api::ObjectMeta;

use super::{CONTAINER, KubernetesDriver};
use crate::driver::EnvironmentSpec;

/// The annotation naming the job's SPIFFE ID (for people reading the Pod).
pub const ANNOTATION_SPIFFE_ID: &str = "gitea-dynamic-runner/spiffe-id";

/// What the supervisor needs without a job-local dockerd: start the agent as the runner
/// uid and own its directories.
const SUPERVISOR_CAPABILITIES: [&str; 6] = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL", "SETGID", "SETUID"];

impl KubernetesDriver {
    /// The Pod for `spec`.
    pub fn pod(&self, spec: &EnvironmentSpec) -> Pod {
        let config = &self.config;
        let (volumes, mounts) = self.volumes();
        let mut annotations = BTreeMap::new();
        if let Some(id) = spec.env.get(contract::environment::SPIFFE_ID) {
            annotations.insert(ANNOTATION_SPIFFE_ID.to_owned(), id.clone());
        }
        let resources = self.resources();
        Pod {
            metadata: ObjectMeta {
                name: Some(spec.name.clone()),
                namespace: Some(config.namespace.clone()),
                labels: Some(spec.labels.clone()),
                annotations: (!annotations.is_empty()).then_some(annotations),
                ..Default::default()
            },
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: CONTAINER.into(),
                    image: Some(config.image.clone()),
                    image_pull_policy: Some(config.image_pull_policy.clone()),
                    command: Some(config.command.clone()),
                    env: Some(self.env(spec)),
                    security_context: Some(self.security_context()),
                    resources: (!resources.is_empty()).then(|| ResourceRequirements {
                        requests: Some(resources.clone()),
                        limits: Some(resources),
                        ..Default::default()
                    }),
                    volume_mounts: Some(mounts),
                    ..Default::default()
                }],
                volumes: Some(volumes),
                restart_policy: Some("Never".into()),
                automount_service_account_token: Some(false),
                share_process_namespace: Some(false),
                enable_service_links: Some(false),
                active_deadline_seconds: Some(i64::try_from(config.active_deadline.as_secs()).unwrap_or(i64::MAX)),
                termination_grace_period_seconds: Some(i64::try_from(config.termination_grace.as_secs()).unwrap_or(i64::MAX)),
                runtime_class_name: config.runtime_class.clone(),
                node_selector: (!config.node_selector.is_empty()).then(|| config.node_selector.clone()),
                tolerations: (!config.tolerations.is_empty()).then(|| config.tolerations.clone()),
                service_account_name: config.service_account.clone(),
                ..Default::default()
            }),
            status: None,
        }
    }

    /// The operator's extra variables, then the environment contract (which wins).
    fn env(&self, spec: &EnvironmentSpec) -> Vec<EnvVar> {
        let variable = |(name, value): (&String, &String)| EnvVar { name: name.clone(), value: Some(value.clone()), ..Default::default() };
        let mut env: Vec<EnvVar> = self.config.env.iter().map(variable).collect();
        let mode = self.config.job_docker();
        let named = |name: &str, value: String| EnvVar { name: name.to_owned(), value: Some(value), ..Default::default() };
        env.extend(mode.supervisor_vars().iter().map(|(name, value)| named(name, (*value).to_owned())));
        if mode.runs_dockerd() && !self.config.registry_mirrors.is_empty() {
            env.push(named(supervisor::REGISTRY_MIRRORS, self.config.registry_mirrors.join(",")));
        }
        env.extend(spec.env.iter().map(variable));
        env
    }

    /// Without a job-local dockerd: no privilege, the supervisor's few capabilities, the
    /// runtime's seccomp profile. With one: privileged, or the configured capabilities
    /// unconfined (trusted code only).
    fn security_context(&self) -> SecurityContext {
        let config = &self.config;
        if !config.job_docker().runs_dockerd() {
            SecurityContext {
                privileged: Some(false),
                allow_privilege_escalation: Some(false),
                capabilities: Some(Capabilities {
                    add: Some(SUPERVISOR_CAPABILITIES.iter().map(|c| (*c).to_owned()).collect()),
                    drop: Some(vec!["ALL".into()]),
                }),
                seccomp_profile: Some(k8s_openapi::api::core::v1::SeccompProfile { type_: "RuntimeDefault".into(), localhost_profile: None }),
                ..Default::default()
            }
        } else if config.privileged {
            SecurityContext { privileged: Some(true), ..Default::default() }
        } else {
            SecurityContext {
                capabilities: Some(Capabilities { add: Some(config.capabilities.clone()), drop: None }),
                allow_privilege_escalation: Some(true),
                seccomp_profile: Some(k8s_openapi::api::core::v1::SeccompProfile { type_: "Unconfined".into(), localhost_profile: None }),
                ..Default::default()
            }
        }
    }

    /// Requests equal to limits, for what is configured.
    fn resources(&self) -> BTreeMap<String, Quantity> {
        let mut resources = BTreeMap::new();
        if let Some(cpu) = &self.config.cpu {
            resources.insert("cpu".to_owned(), Quantity(cpu.clone()));
        }
        if let Some(memory) = &self.config.memory {
            resources.insert("memory".to_owned(), Quantity(memory.clone()));
        }
        resources
    }

    /// The supervisor's storage and the runner's work as emptyDirs, and the SPIRE agent's
    /// socket when configured.
    fn volumes(&self) -> (Vec<Volume>, Vec<VolumeMount>) {
        let config = &self.config;
        let mut volumes = vec![
            Volume {
                name: "storage".into(),
                empty_dir: Some(EmptyDirVolumeSource { size_limit: config.work_size_limit.clone().map(Quantity), medium: None }),
                ..Default::default()
            },
            Volume { name: "work".into(), empty_dir: Some(EmptyDirVolumeSource::default()), ..Default::default() },
        ];
        let mut mounts = vec![
            // The supervisor's loop image (SUPERVISOR_STORAGE_IMAGE's directory).
            VolumeMount { name: "storage".into(), mount_path: "/var/lib/supervisor".into(), ..Default::default() },
            VolumeMount { name: "work".into(), mount_path: "/home/runner/work".into(), ..Default::default() },
        ];
        if let Some(workload) = &config.workload_api {
            let mut volume = Volume { name: "spire-agent-socket".into(), ..Default::default() };
            if let Some(path) = &workload.host_path {
                volume.host_path = Some(HostPathVolumeSource { path: path.clone(), type_: Some("Directory".into()) });
            }
            if let Some(driver) = &workload.csi_driver {
                volume.csi = Some(CSIVolumeSource { driver: driver.clone(), read_only: Some(true), ..Default::default() });
            }
            volumes.push(volume);
            mounts.push(VolumeMount {
                name: "spire-agent-socket".into(),
                mount_path: workload.mount_path.clone(),
                read_only: Some(true),
                ..Default::default()
            });
        }
        (volumes, mounts)
    }
}

#[cfg(test)]
mod tests {
    use kube::{Api, Client};

    use super::*;
    use crate::{
        assignment::placement::Placement,
        driver::kubernetes::{KubernetesConfig, WorkloadApiVolume},
    };

    fn config() -> KubernetesConfig {
        toml::from_str("namespace = \"ci-jobs\"\nimage = \"runner:1\"").unwrap()
    }

    /// The Pod a driver makes, field by field (the real cluster accepts it: see
    /// tests/e2e/tests/e2e/kubernetes.rs).
    // A client needs a runtime (its request buffer is a task); nothing is sent.
    #[tokio::test]
    async fn the_pod_carries_the_contract_and_the_jobs_shape() {
        let mut config = config();
        config.cpu = Some("2".into());
        config.runtime_class = Some("kata".into());
        config.node_selector = BTreeMap::from([("pool".to_owned(), "ci".to_owned())]);
        config.workload_api =
            Some(WorkloadApiVolume { host_path: Some("/run/spire/agent-sockets".into()), csi_driver: None, mount_path: "/run/spire/sockets".into() });
        config.env = BTreeMap::from([(supervisor::LOG.to_owned(), "debug".to_owned())]);
        let spec = EnvironmentSpec {
            assignment_id: "gitea-task-9".into(),
            name: "gdr-x-gitea-task-9".into(),
            labels: crate::driver::labels_for("x", "gitea-task-9", Placement::CONTAINER_KUBERNETES),
            env: BTreeMap::from([
                (contract::environment::ASSIGNMENT_ID.to_owned(), "gitea-task-9".to_owned()),
                (contract::environment::SPIFFE_ID.to_owned(), "spiffe://example.org/ci/o/r/build".to_owned()),
            ]),
            ..EnvironmentSpec::default()
        };
        let pods: Api<Pod> = Api::namespaced(Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap())).unwrap(), "ci-jobs");
        // By default: no job-local dockerd, nothing of the supervisor's but what it needs.
        let unprivileged = KubernetesDriver { placement: Placement::CONTAINER_KUBERNETES, pods: pods.clone(), config: config.clone() };
        let pod = serde_json::to_value(unprivileged.pod(&spec)).unwrap();
        let context = &pod["spec"]["containers"][0]["securityContext"];
        assert_eq!(context["privileged"], false);
        assert_eq!(context["allowPrivilegeEscalation"], false);
        assert_eq!(context["capabilities"]["drop"], serde_json::json!(["ALL"]));
        assert_eq!(context["seccompProfile"]["type"], "RuntimeDefault");
        let env: Vec<&str> = pod["spec"]["containers"][0]["env"].as_array().unwrap().iter().map(|e| e["name"].as_str().unwrap()).collect();
        assert_eq!(env, ["SUPERVISOR_LOG", "SUPERVISOR_DOCKER", "CI_ASSIGNMENT_ID", "CI_SPIFFE_ID"]);
        assert!(unprivileged.config.trust_notice().is_none());

        config.job_dockerd = true;
        let driver = KubernetesDriver { placement: Placement::CONTAINER_KUBERNETES, pods, config };
        assert!(driver.config.trust_notice().unwrap().contains("run only trusted code"));
        let pod = serde_json::to_value(driver.pod(&spec)).unwrap();
        assert_eq!(pod["metadata"]["name"], "gdr-x-gitea-task-9");
        assert_eq!(pod["metadata"]["namespace"], "ci-jobs");
        assert_eq!(pod["metadata"]["labels"]["gitea-dynamic-runner/assignment-id"], "gitea-task-9");
        assert_eq!(pod["metadata"]["annotations"][ANNOTATION_SPIFFE_ID], "spiffe://example.org/ci/o/r/build");
        let spec = &pod["spec"];
        assert_eq!(spec["restartPolicy"], "Never");
        assert_eq!(spec["automountServiceAccountToken"], false);
        assert_eq!(spec["shareProcessNamespace"], false);
        assert_eq!(spec["enableServiceLinks"], false);
        assert_eq!(spec["activeDeadlineSeconds"], 3 * 3600);
        assert_eq!(spec["terminationGracePeriodSeconds"], 30);
        assert_eq!(spec["runtimeClassName"], "kata");
        assert_eq!(spec["nodeSelector"]["pool"], "ci");
        let container = &spec["containers"][0];
        assert_eq!(container["securityContext"]["privileged"], true);
        assert_eq!(container["resources"]["limits"]["cpu"], "2");
        assert_eq!(container["resources"]["requests"]["cpu"], "2");
        let env: Vec<&str> = container["env"].as_array().unwrap().iter().map(|e| e["name"].as_str().unwrap()).collect();
        assert_eq!(env, ["SUPERVISOR_LOG", "CI_ASSIGNMENT_ID", "CI_SPIFFE_ID"]);
        let mounts: Vec<&str> = container["volumeMounts"].as_array().unwrap().iter().map(|m| m["mountPath"].as_str().unwrap()).collect();
        assert_eq!(mounts, ["/var/lib/supervisor", "/home/runner/work", "/run/spire/sockets"]);
        assert_eq!(spec["volumes"][2]["hostPath"]["path"], "/run/spire/agent-sockets");
        assert!(spec["volumes"][0]["emptyDir"].is_object());
    }
}
