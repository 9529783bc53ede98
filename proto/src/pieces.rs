//! Cutting a runner's large reports into smaller calls that mean the same to Gitea.
//!
//! gitea-runner sends its whole unacknowledged log backlog in one UpdateLog and all its
//! unsent outputs in one UpdateTask; after an outage that can be far more than the
//! limits between it and Gitea (the facade's, a proxy's in front of Gitea). Gitea's
//! semantics allow cutting both:
//! - UpdateLog appends rows at `index` and acknowledges how many it holds, so rows can
//!   go in consecutive pieces, `no_more` only on the last;
//! - UpdateTask stores outputs on any call (first write wins) and only a result other
//!   than unspecified ends the task, so outputs can go ahead in calls carrying a
//!   running state, and the real state goes last.

use prost::Message as _;

use crate::runner::v1::{Result as TaskResult, TaskState, UpdateLogRequest, UpdateLogResponse, UpdateTaskRequest};

/// Framing overhead of one repeated element (tag and length), an upper bound.
const ELEMENT_OVERHEAD: usize = 11;

/// Cuts `request` into consecutive pieces whose encoding stays under `max_bytes`
/// (a single larger row goes alone). One piece when it already fits. Every piece
/// carries the task id and its own start index; only the last carries `no_more`. The
/// rows move into the pieces: the common one-piece call copies nothing.
pub fn log_pieces(request: UpdateLogRequest, max_bytes: usize) -> Vec<UpdateLogRequest> {
    if request.encoded_len() <= max_bytes || request.rows.len() <= 1 {
        return vec![request];
    }
    let UpdateLogRequest { task_id, index, rows, no_more } = request;
    let mut pieces = Vec::new();
    let mut current = Vec::new();
    let mut start = 0usize;
    let mut size = 32;
    for (n, row) in rows.into_iter().enumerate() {
        let bytes = row.encoded_len() + ELEMENT_OVERHEAD;
        if !current.is_empty() && size + bytes > max_bytes {
            let index = index + i64::try_from(start).unwrap_or(i64::MAX);
            pieces.push(UpdateLogRequest { task_id, index, rows: std::mem::take(&mut current), no_more: false });
            start = n;
            size = 32;
        }
        size += bytes;
        current.push(row);
    }
    pieces.push(UpdateLogRequest { task_id, index: index + i64::try_from(start).unwrap_or(i64::MAX), rows: current, no_more });
    pieces
}

/// Sends `request` through `send` in consecutive pieces under `max_bytes` (see
/// [`log_pieces`]), no more pieces once `budget` has passed, and answers what went
/// through: the runner sends the rest again on its next tick. A piece refused after
/// others went through ends the call with their acknowledgement, not the error: sent
/// again whole, a backlog beyond a rate limit's burst would never get through, and one
/// slower than the runner's timeout never be acknowledged. A refused first piece is the
/// error.
///
/// # Errors
/// What `send` answered for the first piece.
pub async fn send_log_in_pieces<E, F, Fut>(
    request: UpdateLogRequest,
    max_bytes: usize,
    budget: std::time::Duration,
    mut send: F,
) -> Result<UpdateLogResponse, E>
where
    F: FnMut(UpdateLogRequest) -> Fut,
    Fut: std::future::Future<Output = Result<UpdateLogResponse, E>>,
{
    let started = std::time::Instant::now();
    let first_index = request.index;
    let mut last = None;
    for piece in log_pieces(request, max_bytes) {
        let expected = piece.index + i64::try_from(piece.rows.len()).unwrap_or(i64::MAX);
        let answer = match send(piece).await {
            Ok(answer) => answer,
            Err(error) if last.is_none() => return Err(error),
            Err(_) => break,
        };
        let short = answer.ack_index < expected;
        last = Some(answer);
        if short || started.elapsed() >= budget {
            break;
        }
    }
    Ok(last.unwrap_or(UpdateLogResponse { ack_index: first_index }))
}

/// Cuts `request` so that each call stays under `max_bytes`: the outputs that do not
/// fit go ahead in calls with a running state of the same task (no steps), and the
/// real state goes in the last call with the remaining outputs. One call when it fits.
pub fn task_pieces(request: &UpdateTaskRequest, max_bytes: usize) -> Vec<UpdateTaskRequest> {
    if request.encoded_len() <= max_bytes || request.outputs.len() <= 1 {
        return vec![request.clone()];
    }
    let id = request.state.as_ref().map_or(0, |s| s.id);
    let running = TaskState { id, result: TaskResult::Unspecified as i32, ..Default::default() };
    let state_size = request.state.as_ref().map_or(0, prost::Message::encoded_len) + ELEMENT_OVERHEAD;
    let mut outputs: Vec<(&String, &String)> = request.outputs.iter().collect();
    outputs.sort();
    let mut pieces = Vec::new();
    let mut current = UpdateTaskRequest { state: Some(running.clone()), outputs: Default::default() };
    let mut size = 32;
    for (key, value) in outputs {
        let entry = key.len() + value.len() + 3 * ELEMENT_OVERHEAD;
        if !current.outputs.is_empty() && size + entry > max_bytes.saturating_sub(state_size) {
            pieces.push(std::mem::replace(&mut current, UpdateTaskRequest { state: Some(running.clone()), outputs: Default::default() }));
            size = 32;
        }
        size += entry;
        current.outputs.insert(key.clone(), value.clone());
    }
    current.state = request.state.clone();
    pieces.push(current);
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner::v1::LogRow;

    fn rows(n: usize, size: usize) -> Vec<LogRow> {
        (0..n).map(|i| LogRow { time: None, content: format!("{i:06}{}", "x".repeat(size)) }).collect()
    }

    #[test]
    fn small_logs_stay_whole() {
        let request = UpdateLogRequest { task_id: 7, index: 3, rows: rows(10, 10), no_more: true };
        assert_eq!(log_pieces(request.clone(), 1 << 20), vec![request]);
    }

    #[test]
    fn large_logs_become_consecutive_pieces() {
        let request = UpdateLogRequest { task_id: 7, index: 100, rows: rows(1000, 1000), no_more: true };
        let pieces = log_pieces(request.clone(), 64 << 10);
        assert!(pieces.len() > 10, "{}", pieces.len());
        let mut next = 100;
        for (i, piece) in pieces.iter().enumerate() {
            assert!(piece.encoded_len() <= 64 << 10, "piece {i} is {} bytes", piece.encoded_len());
            assert_eq!(piece.index, next);
            assert_eq!(piece.task_id, 7);
            assert_eq!(piece.no_more, i == pieces.len() - 1);
            next += i64::try_from(piece.rows.len()).unwrap();
        }
        let joined: Vec<LogRow> = pieces.into_iter().flat_map(|p| p.rows).collect();
        assert_eq!(joined, request.rows);
        let open = UpdateLogRequest { no_more: false, ..request };
        assert!(log_pieces(open, 64 << 10).iter().all(|p| !p.no_more));
    }

    /// What went through stays acknowledged when a later piece is refused or the budget
    /// is spent; a refused first piece is the error.
    #[tokio::test]
    async fn sending_in_pieces_answers_what_went_through() {
        let request = UpdateLogRequest { task_id: 7, index: 100, rows: rows(1000, 100), no_more: true };
        let pieces = log_pieces(request.clone(), 10_000);
        let ends: Vec<i64> = pieces.iter().map(|p| p.index + p.rows.len() as i64).collect();
        let enough = std::time::Duration::from_secs(60);
        // Gitea's rule: the acknowledgement is where the rows sent end.
        let gitea = |refuse: Option<usize>| {
            let calls = std::cell::Cell::new(0);
            move |piece: UpdateLogRequest| {
                let call = calls.replace(calls.get() + 1);
                let answer = if Some(call) == refuse { Err("slow down") } else { Ok(UpdateLogResponse { ack_index: piece.index + piece.rows.len() as i64 }) };
                std::future::ready(answer)
            }
        };
        // (the piece refused, the budget, the answer, the case)
        type Case = (Option<usize>, std::time::Duration, Result<i64, &'static str>, &'static str);
        let table: &[Case] = &[
            (None, enough, Ok(1100), "every piece"),
            (Some(3), enough, Ok(ends[2]), "the fourth refused: three acknowledged"),
            (Some(0), enough, Err("slow down"), "the first refused: the error"),
            (None, std::time::Duration::ZERO, Ok(ends[0]), "the budget spent after the first"),
        ];
        for (refuse, budget, expected, case) in table {
            let answer = send_log_in_pieces(request.clone(), 10_000, *budget, gitea(*refuse)).await.map(|a| a.ack_index);
            assert_eq!(answer, *expected, "{case}");
        }
    }

    #[test]
    fn a_row_larger_than_the_limit_goes_alone() {
        let mut all = rows(3, 10);
        all.insert(1, LogRow { time: None, content: "y".repeat(100_000) });
        let request = UpdateLogRequest { task_id: 1, index: 0, rows: all, no_more: false };
        let pieces = log_pieces(request, 10_000);
        assert_eq!(pieces.iter().map(|p| p.rows.len()).collect::<Vec<_>>(), [1, 1, 2]);
        assert_eq!(pieces.iter().map(|p| p.index).collect::<Vec<_>>(), [0, 1, 2]);
    }

    #[test]
    fn outputs_go_ahead_and_the_state_goes_last() {
        let state = TaskState { id: 9, result: TaskResult::Success as i32, ..Default::default() };
        let outputs = (0..50).map(|i| (format!("key{i:02}"), "v".repeat(10_000))).collect();
        let request = UpdateTaskRequest { state: Some(state.clone()), outputs };
        let pieces = task_pieces(&request, 64 << 10);
        assert!(pieces.len() > 5);
        for piece in &pieces[..pieces.len() - 1] {
            assert_eq!(piece.state.as_ref().map(|s| (s.id, s.result)), Some((9, TaskResult::Unspecified as i32)));
            assert!(piece.encoded_len() <= 64 << 10);
        }
        assert_eq!(pieces.last().unwrap().state, Some(state));
        let mut keys: Vec<String> = pieces.iter().flat_map(|p| p.outputs.keys().cloned()).collect();
        keys.sort();
        let mut want: Vec<String> = request.outputs.keys().cloned().collect();
        want.sort();
        assert_eq!(keys, want);
        let small = UpdateTaskRequest { state: request.state.clone(), outputs: Default::default() };
        assert_eq!(task_pieces(&small, 64 << 10), vec![small]);
    }
}
