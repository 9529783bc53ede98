//! SIGTERM and SIGINT, the two signals the controller answers, as the two things its
//! commands make of them: a graceful stop of `run`, or messages that `run-local`
//! interprets itself.

use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// SIGTERM and SIGINT as one stream; `None` if a handler cannot be installed (the
/// process then stops the default way, at once).
struct Interrupts {
    term: Signal,
    int: Signal,
}

impl Interrupts {
    fn new() -> Option<Interrupts> {
        match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
            (Ok(term), Ok(int)) => Some(Interrupts { term, int }),
            (Err(error), _) | (_, Err(error)) => {
                tracing::warn!(%error, "cannot handle SIGTERM and SIGINT; a signal stops the controller without draining");
                None
            }
        }
    }

    async fn recv(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}

/// Every SIGINT and SIGTERM, as a message (run-local decides what each means).
pub async fn forward_interrupts(interrupts: tokio::sync::mpsc::UnboundedSender<()>) {
    let Some(mut signals) = Interrupts::new() else { return };
    loop {
        signals.recv().await;
        if interrupts.send(()).is_err() {
            return;
        }
    }
}

/// The first SIGTERM or SIGINT starts a graceful stop; a second one ends the process now.
pub async fn stop_on_signals(shutdown: CancellationToken) {
    let Some(mut signals) = Interrupts::new() else { return };
    signals.recv().await;
    tracing::info!("stopping: finishing in-flight work (signal again to stop at once)");
    shutdown.cancel();
    signals.recv().await;
    tracing::warn!("second signal: exiting now");
    std::process::abort();
}
