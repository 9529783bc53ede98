//! A host-mode job's `services:`. gitea-runner starts a job's service containers only
//! for a `container:` job: its host environment starts none and says nothing. For a job
//! whose steps run on the environment itself, the agent starts them on the job's own
//! dockerd, as GitHub's runner does: on a network of their own where they reach each
//! other by name, each `ports:` entry published on the environment's 127.0.0.1 (where a
//! step reaches it, GitHub's `localhost:<port>`), running — and healthy, when they have
//! a health check — before the first step (the job-started hook waits, see
//! `super::super::ready`). What is read here ([`declared`]) is pure and table-tested;
//! [`start`] is the part that talks to dockerd.
//!
//! A service gets nothing a step could not give itself with `docker run` on the same
//! dockerd: the agent uses no privilege of its own for it.

use std::{collections::HashMap, time::Duration};

use bollard::{
    Docker,
    auth::DockerCredentials,
    models::{ContainerCreateBody, EndpointSettings, HealthConfig, HealthStatusEnum, HostConfig, NetworkCreateRequest, NetworkingConfig, PortBinding},
    query_parameters::CreateImageOptionsBuilder,
};
use futures_util::StreamExt as _;
use serde_yaml_ng::Value;

/// The network the services share (their names resolve there).
pub const NETWORK: &str = "gdr-services";

/// The `options:` a host-mode service may carry: what GitHub's examples use to make a
/// service's readiness known. Anything else needs the runner's own container support.
const SUPPORTED_OPTIONS: &str = "--health-cmd, --health-interval, --health-timeout, --health-retries, --health-start-period, -e/--env";

/// One entry of the job's `services:`, with its values resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    pub name: String,
    pub image: String,
    /// `NAME=value`, from `env:` and `-e` options.
    pub env: Vec<String>,
    pub ports: Vec<Publish>,
    pub health: Option<Health>,
    /// `credentials:` for the image's registry: user and password.
    pub credentials: Option<(String, String)>,
}

/// One `ports:` entry: `host` on the environment's 127.0.0.1 to `container`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Publish {
    pub host: u16,
    pub container: u16,
    pub protocol: String,
}

/// The health check from `--health-*` options (durations in Docker's nanoseconds).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Health {
    pub command: Option<String>,
    pub interval: Option<i64>,
    pub timeout: Option<i64>,
    pub retries: Option<i64>,
    pub start_period: Option<i64>,
}

#[derive(Debug, thiserror::Error)]
pub enum ServicesError {
    #[error("the job's workflow cannot be read: {0}")]
    Workflow(String),
    #[error("service `{service}`: {reason}")]
    Invalid { service: String, reason: String },
    #[error(
        "the job declares services ({names}) but this environment has no Docker to run them: ask the operator for a placement with a job Docker (`job_docker`), or leave `services:` out"
    )]
    NoDocker { names: String },
    #[error("the job's services ({names}) need the job's dockerd, which is not ready: {state}")]
    DockerdDown { names: String, state: String },
    #[error("cannot reach the job's dockerd at {host}: {source}")]
    Connect { host: String, source: bollard::errors::Error },
    #[error("service `{service}`: {action} failed: {source}")]
    Docker { service: String, action: &'static str, source: bollard::errors::Error },
    #[error("service `{service}` did not come up: {state}")]
    NotUp { service: String, state: String },
}

/// The services a host-mode job declares, in the order written, with `${{ secrets.NAME }}`
/// and `${{ vars.NAME }}` values taken from the task; none for a `container:` job (the
/// runner starts those itself) or a job without `services:`.
///
/// # Errors
/// [`ServicesError::Workflow`] when the payload is not a one-job workflow, and
/// [`ServicesError::Invalid`] for a service this cannot start as written, saying why.
pub fn declared(payload: &[u8], secrets: &HashMap<String, String>, vars: &HashMap<String, String>) -> Result<Vec<Service>, ServicesError> {
    let mut workflow: Value = serde_yaml_ng::from_slice(payload).map_err(|e| ServicesError::Workflow(e.to_string()))?;
    workflow.apply_merge().map_err(|e| ServicesError::Workflow(e.to_string()))?;
    let job = match workflow.get("jobs") {
        Some(Value::Mapping(jobs)) if jobs.len() == 1 => jobs.values().next().cloned().unwrap_or(Value::Null),
        _ => return Err(ServicesError::Workflow("it does not hold exactly one job under `jobs:`".to_owned())),
    };
    let in_container = match job.get("container") {
        None | Some(Value::Null) => false,
        Some(Value::String(image)) => !image.is_empty(),
        Some(_) => true,
    };
    let services = match job.get("services") {
        Some(Value::Mapping(services)) if !in_container => services,
        Some(Value::Mapping(_) | Value::Null) | None => return Ok(Vec::new()),
        Some(_) => return Err(ServicesError::Workflow("`services:` is not a mapping".to_owned())),
    };
    let values = Values { secrets, vars };
    services
        .iter()
        .map(|(name, spec)| {
            let name = name.as_str().ok_or_else(|| ServicesError::Workflow(format!("a service's name is not a string: {name:?}")))?;
            service(name, spec, &values).map_err(|reason| ServicesError::Invalid { service: name.to_owned(), reason })
        })
        .collect()
}

/// Where `${{ secrets.NAME }}` and `${{ vars.NAME }}` come from.
struct Values<'a> {
    secrets: &'a HashMap<String, String>,
    vars: &'a HashMap<String, String>,
}

impl Values<'_> {
    /// `value` as written, or the secret or variable it names as a whole. The runner
    /// evaluates every other expression, and only for what it starts itself.
    fn resolve(&self, value: &str) -> Result<String, String> {
        if !value.contains("${{") {
            return Ok(value.to_owned());
        }
        let unsupported = || {
            format!(
                "{value:?}: only a whole `${{{{ secrets.NAME }}}}` or `${{{{ vars.NAME }}}}` is evaluated in a host-mode job's services; write the value, or run the job in a `container:`"
            )
        };
        let inner = value.trim().strip_prefix("${{").and_then(|v| v.strip_suffix("}}")).ok_or_else(unsupported)?.trim();
        let (table, key) = match inner.split_once('.') {
            Some(("secrets", key)) => (self.secrets, key),
            Some(("vars", key)) => (self.vars, key),
            _ => return Err(unsupported()),
        };
        // Names are case-insensitive, as on GitHub; an unknown one is empty there too.
        Ok(table.iter().find(|(name, _)| name.eq_ignore_ascii_case(key)).map(|(_, v)| v.clone()).unwrap_or_default())
    }

    fn text(&self, value: &Value, what: &str) -> Result<String, String> {
        match value {
            Value::String(text) => self.resolve(text),
            Value::Number(number) => Ok(number.to_string()),
            Value::Bool(flag) => Ok(flag.to_string()),
            _ => Err(format!("`{what}` is not a string")),
        }
    }
}

fn service(name: &str, spec: &Value, values: &Values<'_>) -> Result<Service, String> {
    let Value::Mapping(spec) = spec else {
        return Err("is not a mapping with an `image`".to_owned());
    };
    for key in spec.keys() {
        match key.as_str() {
            Some("image" | "env" | "ports" | "options" | "credentials") => {}
            Some("volumes") => return Err("`volumes:` are not supported for a host-mode job's services; run the job in a `container:`".to_owned()),
            _ => return Err(format!("unknown key {key:?}")),
        }
    }
    let image = values.text(spec.get("image").ok_or("has no `image`")?, "image")?;
    if image.is_empty() {
        return Err("its `image` is empty".to_owned());
    }
    let mut service = Service { name: name.to_owned(), image, env: Vec::new(), ports: Vec::new(), health: None, credentials: None };
    match spec.get("env") {
        None | Some(Value::Null) => {}
        Some(Value::Mapping(env)) => {
            for (key, value) in env {
                let key = key.as_str().ok_or("an `env` name is not a string")?;
                service.env.push(format!("{key}={}", values.text(value, key)?));
            }
        }
        Some(_) => return Err("`env` is not a mapping".to_owned()),
    }
    match spec.get("ports") {
        None | Some(Value::Null) => {}
        Some(Value::Sequence(ports)) => {
            for port in ports {
                service.ports.push(publish(&values.text(port, "ports")?)?);
            }
        }
        Some(_) => return Err("`ports` is not a list".to_owned()),
    }
    if let Some(options) = spec.get("options") {
        apply_options(&mut service, &values.text(options, "options")?)?;
    }
    if let Some(credentials) = spec.get("credentials") {
        let field = |key: &str| credentials.get(key).map(|v| values.text(v, key)).transpose();
        match (field("username")?, field("password")?) {
            (Some(user), Some(password)) => service.credentials = Some((user, password)),
            _ => return Err("`credentials` needs both `username` and `password`".to_owned()),
        }
    }
    Ok(service)
}

/// A `ports:` entry: `8080:80`, `80` (the same port on 127.0.0.1), either with `/udp`
/// or `/tcp`. An address in the entry is refused: these ports are the environment's
/// loopback only.
fn publish(entry: &str) -> Result<Publish, String> {
    let (ports, protocol) = match entry.rsplit_once('/') {
        Some((ports, protocol @ ("tcp" | "udp"))) => (ports, protocol),
        Some(_) => return Err(format!("port {entry:?}: the protocol must be tcp or udp")),
        None => (entry, "tcp"),
    };
    let port = |text: &str| text.parse::<u16>().ok().filter(|p| *p != 0);
    let (host, container) = match ports.split(':').collect::<Vec<_>>()[..] {
        [one] => (port(one), port(one)),
        [host, container] => (port(host), port(container)),
        _ => return Err(format!("port {entry:?}: write HOST:CONTAINER or PORT (services are published on 127.0.0.1 only)")),
    };
    match (host, container) {
        (Some(host), Some(container)) => Ok(Publish { host, container, protocol: protocol.to_owned() }),
        _ => Err(format!("port {entry:?}: ports are numbers from 1 to 65535")),
    }
}

/// The `options:` string, split as a shell would: the health check and `-e`.
fn apply_options(service: &mut Service, options: &str) -> Result<(), String> {
    let words = shlex::split(options).ok_or_else(|| format!("`options` {options:?} has an unmatched quote"))?;
    let mut words = words.into_iter();
    let duration = |flag: &str, value: &str| {
        contract::units::parse_duration(value).map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)).map_err(|e| format!("{flag}: {e}"))
    };
    while let Some(word) = words.next() {
        let (flag, inline) = match word.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => (flag.to_owned(), Some(value.to_owned())),
            _ => (word.clone(), None),
        };
        if !flag.starts_with('-') {
            return Err(format!("`options`: {word:?} is not an option"));
        }
        if !matches!(flag.as_str(), "--health-cmd" | "--health-interval" | "--health-timeout" | "--health-retries" | "--health-start-period" | "-e" | "--env") {
            return Err(format!(
                "`options`: {flag} is not supported for a host-mode job's services (supported: {SUPPORTED_OPTIONS}); run the job in a `container:`"
            ));
        }
        let value = inline.or_else(|| words.next()).ok_or_else(|| format!("`options`: {flag} needs a value"))?;
        let health = service.health.get_or_insert_with(Health::default);
        match flag.as_str() {
            "--health-cmd" => health.command = Some(value),
            "--health-interval" => health.interval = Some(duration(&flag, &value)?),
            "--health-timeout" => health.timeout = Some(duration(&flag, &value)?),
            "--health-start-period" => health.start_period = Some(duration(&flag, &value)?),
            "--health-retries" => health.retries = Some(value.parse().map_err(|_| format!("--health-retries: {value:?} is not a number"))?),
            _ => service.env.push(value),
        }
    }
    if service.health.as_ref().is_some_and(|h| *h == Health::default()) {
        service.health = None;
    }
    Ok(())
}

/// An image reference as the pull API takes it: the name and its tag apart (a pull
/// by name alone would fetch every tag), `latest` when none is given.
fn pull_reference(image: &str) -> (String, Option<String>) {
    if image.contains('@') {
        return (image.to_owned(), None);
    }
    let last = image.rsplit('/').next().unwrap_or(image);
    match last.rsplit_once(':') {
        Some((_, tag)) => (image[..image.len() - tag.len() - 1].to_owned(), Some(tag.to_owned())),
        None => (image.to_owned(), Some("latest".to_owned())),
    }
}

/// Names of `services` for messages: `web, db`.
pub fn names(services: &[Service]) -> String {
    services.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join(", ")
}

/// Starts `services` on the dockerd at `docker_host` and waits until each runs (and is
/// healthy, when it has a health check); `progress` hears what it is doing. Returns
/// where each one answers.
///
/// # Errors
/// The first service that cannot be pulled, created, started or come up, saying why.
pub async fn start(docker_host: &str, services: &[Service], mut progress: impl FnMut(String)) -> Result<String, ServicesError> {
    let docker = Docker::connect_with_unix(docker_host, 600, bollard::API_DEFAULT_VERSION)
        .map_err(|source| ServicesError::Connect { host: docker_host.to_owned(), source })?;
    let first = services.first().map_or_else(String::new, |s| s.name.clone());
    let network = NetworkCreateRequest { name: NETWORK.to_owned(), driver: Some("bridge".to_owned()), ..Default::default() };
    match docker.create_network(network).await {
        Ok(_) | Err(bollard::errors::Error::DockerResponseServerError { status_code: 409, .. }) => {}
        Err(source) => return Err(ServicesError::Docker { service: first, action: "creating their network", source }),
    }
    let mut ids = Vec::new();
    for service in services {
        progress(format!("pulling {} for service `{}`", service.image, service.name));
        pull(&docker, service).await?;
        progress(format!("starting service `{}`", service.name));
        let docker_error = |action| move |source| ServicesError::Docker { service: service.name.clone(), action, source };
        let created = docker.create_container(None, body(service)).await.map_err(docker_error("creating its container"))?;
        docker.start_container(&created.id, None::<bollard::query_parameters::StartContainerOptions>).await.map_err(docker_error("starting its container"))?;
        ids.push((service, created.id));
    }
    for (service, id) in &ids {
        progress(format!("waiting for service `{}` to run{}", service.name, if service.health.is_some() { " and be healthy" } else { "" }));
        wait_until_up(&docker, service, id).await?;
    }
    Ok(services.iter().map(summary).collect::<Vec<_>>().join("; "))
}

async fn pull(docker: &Docker, service: &Service) -> Result<(), ServicesError> {
    let (from_image, tag) = pull_reference(&service.image);
    let mut options = CreateImageOptionsBuilder::new().from_image(&from_image);
    if let Some(tag) = &tag {
        options = options.tag(tag);
    }
    let credentials = service.credentials.as_ref().map(|(user, password)| DockerCredentials {
        username: Some(user.clone()),
        password: Some(password.clone()),
        ..Default::default()
    });
    let mut stream = docker.create_image(Some(options.build()), None, credentials);
    while let Some(step) = stream.next().await {
        step.map_err(|source| ServicesError::Docker { service: service.name.clone(), action: "pulling its image", source })?;
    }
    Ok(())
}

fn body(service: &Service) -> ContainerCreateBody {
    let key = |p: &Publish| format!("{}/{}", p.container, p.protocol);
    let mut bindings: HashMap<String, Option<Vec<PortBinding>>> = HashMap::new();
    for port in &service.ports {
        let binding = PortBinding { host_ip: Some("127.0.0.1".to_owned()), host_port: Some(port.host.to_string()) };
        bindings.entry(key(port)).or_insert_with(|| Some(Vec::new())).get_or_insert_with(Vec::new).push(binding);
    }
    let healthcheck = service.health.as_ref().map(|h| HealthConfig {
        test: h.command.as_ref().map(|command| vec!["CMD-SHELL".to_owned(), command.clone()]),
        interval: h.interval,
        timeout: h.timeout,
        retries: h.retries,
        start_period: h.start_period,
        ..Default::default()
    });
    let endpoint = EndpointSettings { aliases: Some(vec![service.name.clone()]), ..Default::default() };
    ContainerCreateBody {
        image: Some(service.image.clone()),
        env: Some(service.env.clone()),
        exposed_ports: Some(service.ports.iter().map(key).collect()),
        healthcheck,
        labels: Some(HashMap::from([("gitea-dynamic-runner.service".to_owned(), service.name.clone())])),
        host_config: Some(HostConfig { network_mode: Some(NETWORK.to_owned()), port_bindings: Some(bindings), ..Default::default() }),
        networking_config: Some(NetworkingConfig { endpoints_config: Some(HashMap::from([(NETWORK.to_owned(), endpoint)])) }),
        ..Default::default()
    }
}

/// Polls the container until it runs (and its health check, if any, passes); a
/// container that exits or turns unhealthy fails the job's start.
async fn wait_until_up(docker: &Docker, service: &Service, id: &str) -> Result<(), ServicesError> {
    loop {
        let inspected = docker
            .inspect_container(id, None::<bollard::query_parameters::InspectContainerOptions>)
            .await
            .map_err(|source| ServicesError::Docker { service: service.name.clone(), action: "inspecting its container", source })?;
        let state = inspected.state.unwrap_or_default();
        let not_up = |state: String| Err(ServicesError::NotUp { service: service.name.clone(), state });
        if state.running != Some(true) {
            if state.status.is_some_and(|s| s != bollard::models::ContainerStateStatusEnum::CREATED) {
                return not_up(format!("its container exited with {} {}", state.exit_code.unwrap_or(-1), state.error.unwrap_or_default()));
            }
        } else {
            match state.health.and_then(|h| h.status) {
                None | Some(HealthStatusEnum::NONE | HealthStatusEnum::EMPTY | HealthStatusEnum::HEALTHY) => return Ok(()),
                Some(HealthStatusEnum::UNHEALTHY) => return not_up("its health check failed".to_owned()),
                Some(HealthStatusEnum::STARTING) => {}
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// `web (nginx:1) on 127.0.0.1:8080->80/tcp`.
fn summary(service: &Service) -> String {
    let ports: Vec<String> = service.ports.iter().map(|p| format!("127.0.0.1:{}->{}/{}", p.host, p.container, p.protocol)).collect();
    match ports.is_empty() {
        true => format!("{} ({})", service.name, service.image),
        false => format!("{} ({}) on {}", service.name, service.image, ports.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn declared_in(job: &str) -> Result<Vec<Service>, String> {
        let secrets = HashMap::from([("DB_PASSWORD".to_owned(), "s3cret".to_owned())]);
        let vars = HashMap::from([("pg".to_owned(), "postgres:16".to_owned())]);
        let payload = format!("name: w\non: push\njobs:\n  j:\n    runs-on: x\n{job}");
        declared(payload.as_bytes(), &secrets, &vars).map_err(|e| e.to_string())
    }

    #[test]
    fn which_jobs_get_services_from_the_agent() {
        let none: &[&str] = &[
            "    steps: []\n",
            "    services:\n",
            "    container: node:22\n    services:\n      web:\n        image: nginx\n",
            "    container:\n      image: node:22\n    services:\n      web:\n        image: nginx\n",
        ];
        for job in none {
            assert_eq!(declared_in(job), Ok(Vec::new()), "{job}");
        }
        let host = declared_in("    container: ''\n    services:\n      web:\n        image: nginx\n").unwrap();
        assert_eq!(host.iter().map(|s| s.image.as_str()).collect::<Vec<_>>(), ["nginx"]);
    }

    #[test]
    fn a_service_as_written() {
        let job = "    services:\n      db:\n        image: ${{ vars.PG }}\n        env:\n          POSTGRES_PASSWORD: ${{ secrets.db_password }}\n          PORT: 5432\n        ports: ['15432:5432', 6379, 53/udp]\n        options: >-\n          --health-cmd \"pg_isready -U postgres\" --health-interval=2s --health-retries 5 -e EXTRA=1\n      web:\n        image: nginx\n";
        let got = declared_in(job).unwrap();
        assert_eq!(
            got[0],
            Service {
                name: "db".into(),
                image: "postgres:16".into(),
                env: vec!["POSTGRES_PASSWORD=s3cret".into(), "PORT=5432".into(), "EXTRA=1".into()],
                ports: vec![
                    Publish { host: 15432, container: 5432, protocol: "tcp".into() },
                    Publish { host: 6379, container: 6379, protocol: "tcp".into() },
                    Publish { host: 53, container: 53, protocol: "udp".into() },
                ],
                health: Some(Health { command: Some("pg_isready -U postgres".into()), interval: Some(2_000_000_000), retries: Some(5), ..Default::default() }),
                credentials: None,
            }
        );
        assert_eq!(got[1].name, "web");
        assert_eq!(summary(&got[0]), "db (postgres:16) on 127.0.0.1:15432->5432/tcp, 127.0.0.1:6379->6379/tcp, 127.0.0.1:53->53/udp");
    }

    #[test]
    fn what_is_refused_and_why() {
        let table: &[(&str, &str)] = &[
            ("      web: nginx\n", "service `web`: is not a mapping"),
            ("      web:\n        env: {}\n", "service `web`: has no `image`"),
            ("      web:\n        image: nginx\n        volumes: [/a:/b]\n", "`volumes:` are not supported"),
            ("      web:\n        image: nginx\n        ports: ['0.0.0.0:80:80']\n", "published on 127.0.0.1 only"),
            ("      web:\n        image: nginx\n        ports: ['80:99999']\n", "from 1 to 65535"),
            ("      web:\n        image: nginx\n        ports: ['80/sctp']\n", "tcp or udp"),
            ("      web:\n        image: nginx\n        options: --privileged\n", "--privileged is not supported"),
            ("      web:\n        image: nginx\n        options: --health-cmd\n", "--health-cmd needs a value"),
            ("      web:\n        image: nginx\n        options: --health-interval soon\n", "--health-interval: \"soon\" is not a duration"),
            ("      web:\n        image: nginx:${{ matrix.v }}\n", "only a whole `${{ secrets.NAME }}`"),
            ("      web:\n        image: nginx\n        credentials:\n          username: u\n", "needs both"),
            ("      web:\n        image: nginx\n        network: x\n", "unknown key"),
        ];
        for (services, want) in table {
            let got = declared_in(&format!("    services:\n{services}")).unwrap_err();
            assert!(got.contains(want), "{services}: {got}");
        }
        let payload = b"jobs:\n  a: {runs-on: x}\n  b: {runs-on: x}\n";
        assert!(declared(payload, &HashMap::new(), &HashMap::new()).unwrap_err().to_string().contains("exactly one job"));
    }

    #[test]
    fn pull_references() {
        let table: &[(&str, (&str, Option<&str>))] = &[
            ("nginx", ("nginx", Some("latest"))),
            ("nginx:1.27", ("nginx", Some("1.27"))),
            ("registry.local:5000/team/db", ("registry.local:5000/team/db", Some("latest"))),
            ("registry.local:5000/team/db:16", ("registry.local:5000/team/db", Some("16"))),
            ("nginx@sha256:abc", ("nginx@sha256:abc", None)),
        ];
        for (image, (name, tag)) in table {
            assert_eq!(pull_reference(image), ((*name).to_owned(), tag.map(str::to_owned)), "{image}");
        }
    }
}
