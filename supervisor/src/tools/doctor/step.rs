//! `doctor --step`: what a job's steps reach, checked from where a step runs — in the
//! environment, or in a `container:` job's container, where the job-started hook
//! brought the loopback in (`agent::relay`). Each URL gitea-runner hands the steps must
//! answer HTTP; a connection the relay takes but nothing answers behind is a failure too.

use std::{net::ToSocketAddrs as _, time::Duration};

use super::Outcome;

/// The variables a step gets, what each is, and the check's name.
const REACHED: [(&str, &str, &str); 4] = [
    ("server", "GITHUB_SERVER_URL", "the loopback \"Gitea\" (checkout, actions' API calls)"),
    ("runtime", "ACTIONS_RUNTIME_URL", "the runtime service (artifacts v3)"),
    ("results", "ACTIONS_RESULTS_URL", "the results service (artifacts v4, cache v2)"),
    ("cache", "ACTIONS_CACHE_URL", "the jobs' cache"),
];

const HINT: &str = "in a `container:` job the job-started hook relays the environment's 127.0.0.1 into the container: \
                    its line in the job's log says whether it did; /run/supervisor/agent must be mounted (the runner's container.options)";

/// Every check, with the step's variables read through `var`.
pub fn all(var: &dyn Fn(&str) -> Option<String>) -> Vec<Outcome> {
    REACHED
        .iter()
        .map(|&(id, name, what)| match var(name).filter(|v| !v.is_empty()) {
            None => Outcome::skip(id, format!("{name} is not set: not run as a job's step")),
            Some(url) => reach(id, name, what, &url),
        })
        .collect()
}

fn reach(id: &'static str, name: &str, what: &str, url: &str) -> Outcome {
    let Some((authority, path)) = url.strip_prefix("http://").map(|rest| rest.split_once('/').map_or((rest, "/".to_owned()), |(a, p)| (a, format!("/{p}"))))
    else {
        return Outcome::fail(
            id,
            format!("{name}={url:?} is not an http:// URL"),
            "the runner takes it from .runner and its config; do not set it in the workflow",
        );
    };
    let authority = if authority.contains(':') { authority.to_owned() } else { format!("{authority}:80") };
    let Some(address) = authority.to_socket_addrs().ok().and_then(|mut a| a.next()) else {
        return Outcome::fail(id, format!("{name}: cannot resolve {authority}"), HINT);
    };
    let answer = std::net::TcpStream::connect_timeout(&address, Duration::from_secs(3)).and_then(|stream| {
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        crate::http1::get(stream, &authority, &path)
    });
    match answer {
        Ok(answer) if answer.status().is_some() => Outcome::pass(id, format!("{what} answers at {url}: {}", answer.status_line)),
        Ok(_) => Outcome::fail(id, format!("{what} at {url} took the connection but nothing answered behind it"), HINT),
        Err(error) => Outcome::fail(id, format!("{what} at {url} does not answer: {error}"), HINT),
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read as _, Write as _};

    use super::*;
    use crate::tools::doctor::Status;

    /// One HTTP server answering 204 to every request, and a port nothing listens on.
    fn server() -> (u16, u16) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let mut stream = stream.unwrap();
                let mut request = [0u8; 1024];
                let _ = stream.read(&mut request);
                let _ = stream.write_all(b"HTTP/1.1 204 No Content\r\n\r\n");
            }
        });
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        (port, closed)
    }

    #[test]
    fn each_url_a_step_gets_must_answer() {
        let (open, closed) = server();
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        // Takes connections (like a relay whose socket has nobody behind it) and closes them.
        let silent_port = silent.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for stream in silent.incoming() {
                drop(stream);
            }
        });
        let table: Vec<(Option<String>, Status)> = vec![
            (Some(format!("http://127.0.0.1:{open}/")), Status::Pass),
            (Some(format!("http://127.0.0.1:{open}/api/actions_pipeline/")), Status::Pass),
            (Some(format!("http://127.0.0.1:{closed}/")), Status::Fail),
            (Some(format!("http://127.0.0.1:{silent_port}")), Status::Fail),
            (Some("https://gitea.example/".into()), Status::Fail),
            (None, Status::Skip),
            (Some(String::new()), Status::Skip),
        ];
        for (value, expected) in table {
            let outcomes = all(&|name| (name == "ACTIONS_CACHE_URL").then(|| value.clone()).flatten());
            let cache = outcomes.iter().find(|o| o.id == "cache").unwrap();
            assert_eq!(cache.status, expected, "{value:?}: {cache:?}");
            assert!(outcomes.iter().filter(|o| o.id != "cache").all(|o| o.status == Status::Skip));
        }
    }
}
