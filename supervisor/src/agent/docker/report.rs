//! PID 1's reports to the agent about the job-local dockerd: one line each on the
//! agent's fd [`DOCKER_FD`], written by PID 1 (`pid1::run`'s `docker`) and read by the agent
//! ([`crate::agent::ready::read_docker_reports`]). Both sides go through [`DockerReport`], so
//! the words on the wire are written down here alone.
//!
//! `listening <detail>` (dockerd's socket takes connections; dockerd starts behind it),
//! then one final `ready <detail>` or `failed <detail>`.

/// The agent's fd on which PID 1 writes its [`DockerReport`]s.
pub const DOCKER_FD: i32 = 3;

/// One report of PID 1 about dockerd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DockerReport {
    /// dockerd's socket takes connections and dockerd starts behind it: a `docker` call
    /// already waits for dockerd instead of failing.
    Listening(String),
    /// dockerd answered `/_ping` (the last report).
    Ready(String),
    /// dockerd cannot be used: why (the last report).
    Failed(String),
}

/// A line that is none of the reports.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unreadable dockerd report {0:?}")]
pub struct UnreadableReport(pub String);

impl DockerReport {
    /// The report as PID 1 writes it: one line, ending in a newline.
    ///
    /// Only the detail's first line goes on the wire: the reader takes one line per
    /// report, and the agent passes the detail on to the facade, which refuses details
    /// over 4096 bytes. The rest (such as dockerd's log tail) stays in PID 1's own log.
    pub fn to_line(&self) -> String {
        let (word, detail) = match self {
            DockerReport::Listening(detail) => ("listening", detail),
            DockerReport::Ready(detail) => ("ready", detail),
            DockerReport::Failed(detail) => ("failed", detail),
        };
        match detail.lines().next() {
            Some(first) if !first.is_empty() => format!("{word} {first}\n"),
            _ => format!("{word}\n"),
        }
    }

    /// Reads one line written by [`DockerReport::to_line`] (its newline optional).
    ///
    /// # Errors
    /// [`UnreadableReport`] for a line that starts with none of the words.
    pub fn parse(line: &str) -> Result<DockerReport, UnreadableReport> {
        let line = line.trim_end();
        match line.split_once(' ').unwrap_or((line, "")) {
            ("listening", detail) => Ok(DockerReport::Listening(detail.to_owned())),
            ("ready", detail) => Ok(DockerReport::Ready(detail.to_owned())),
            ("failed", detail) => Ok(DockerReport::Failed(detail.to_owned())),
            _ => Err(UnreadableReport(line.to_owned())),
        }
    }

    /// Whether no report follows this one.
    pub fn is_final(&self) -> bool {
        !matches!(self, DockerReport::Listening(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every report reads back as it was written.
    #[test]
    fn round_trip() {
        let table = [
            (
                DockerReport::Listening("/var/run/docker.sock takes connections; dockerd starts behind it".into()),
                "listening /var/run/docker.sock takes connections; dockerd starts behind it\n",
            ),
            (
                DockerReport::Ready("/var/run/docker.sock answered /_ping 412 ms after dockerd started".into()),
                "ready /var/run/docker.sock answered /_ping 412 ms after dockerd started\n",
            ),
            (DockerReport::Failed("dockerd is off".into()), "failed dockerd is off\n"),
            (DockerReport::Failed("the supervisor is shutting down".into()), "failed the supervisor is shutting down\n"),
            (DockerReport::Ready(String::new()), "ready\n"),
            (DockerReport::Listening(String::new()), "listening\n"),
        ];
        for (report, line) in table {
            assert_eq!(report.to_line(), line, "{report:?}");
            assert_eq!(DockerReport::parse(line), Ok(report.clone()), "{line:?}");
            assert_eq!(DockerReport::parse(&report.to_line()).map(|r| r.is_final()), Ok(!matches!(report, DockerReport::Listening(_))));
        }
    }

    /// A detail of several lines (dockerd's log tail) goes on the wire as its first
    /// line, so that one report stays one line.
    #[test]
    fn a_detail_of_several_lines_is_sent_as_its_first() {
        let report = DockerReport::Failed("dockerd exited while starting; its log ends with:\nunknown flag --bogus\n".into());
        assert_eq!(report.to_line(), "failed dockerd exited while starting; its log ends with:\n");
        assert_eq!(DockerReport::parse(&report.to_line()), Ok(DockerReport::Failed("dockerd exited while starting; its log ends with:".into())));
    }

    #[test]
    fn lines_as_read() {
        let table: &[(&str, Result<DockerReport, UnreadableReport>)] = &[
            ("ready /var/run/docker.sock answered in 412ms\n", Ok(DockerReport::Ready("/var/run/docker.sock answered in 412ms".into()))),
            ("failed dockerd exited with 1\n", Ok(DockerReport::Failed("dockerd exited with 1".into()))),
            ("ready \n", Ok(DockerReport::Ready(String::new()))),
            ("listening /var/run/docker.sock", Ok(DockerReport::Listening("/var/run/docker.sock".into()))),
            ("bogus\n", Err(UnreadableReport("bogus".into()))),
            ("", Err(UnreadableReport(String::new()))),
        ];
        for (line, want) in table {
            assert_eq!(&DockerReport::parse(line), want, "{line:?}");
        }
        assert_eq!(UnreadableReport("bogus".into()).to_string(), "unreadable dockerd report \"bogus\"");
    }
}
