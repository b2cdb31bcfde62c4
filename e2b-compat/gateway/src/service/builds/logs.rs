//! `GET /templates/{id}/builds/{buildID}/logs`: a window of a build's log
//! by time, as E2B pages it (a millisecond cursor, a direction, a minimum
//! level).

use crate::model::{BuildLine, Result, SandboxError};

/// At most this many lines per call.
pub const MAX_LOG_LIMIT: usize = 100;

#[derive(Debug, Default)]
pub struct LogWindow<'a> {
    /// Milliseconds since the epoch: forward, lines at or after it;
    /// backward, lines at or before it.
    pub cursor: Option<i64>,
    pub limit: Option<usize>,
    pub direction: Option<&'a str>,
    /// The least severe level returned.
    pub level: Option<&'a str>,
}

fn severity(level: &str) -> Option<u8> {
    match level {
        "debug" => Some(0),
        "info" => Some(1),
        "warn" => Some(2),
        "error" => Some(3),
        _ => None,
    }
}

/// The lines the window selects, oldest first going forward and newest
/// first going backward.
pub fn window<'l>(log: &'l [BuildLine], query: &LogWindow) -> Result<Vec<&'l BuildLine>> {
    let limit = query.limit.unwrap_or(MAX_LOG_LIMIT).min(MAX_LOG_LIMIT);
    let least = match query.level {
        None => 0,
        Some(level) => severity(level)
            .ok_or_else(|| SandboxError::Invalid(format!("invalid level {level:?}: debug, info, warn or error")))?,
    };
    let kept = |line: &&BuildLine| severity(&line.level).unwrap_or(1) >= least;
    Ok(match query.direction.unwrap_or("forward") {
        "forward" => {
            let from = query.cursor.unwrap_or(i64::MIN);
            log.iter().filter(|l| l.at_ms >= from).filter(kept).take(limit).collect()
        }
        "backward" => {
            let until = query.cursor.unwrap_or(i64::MAX);
            log.iter().rev().filter(|l| l.at_ms <= until).filter(kept).take(limit).collect()
        }
        other => return Err(SandboxError::Invalid(format!("invalid direction {other:?}: forward or backward"))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log() -> Vec<BuildLine> {
        [(10, "info", "a"), (20, "debug", "b"), (30, "error", "c"), (40, "warn", "d")]
            .into_iter()
            .map(|(at_ms, level, m)| BuildLine { at_ms, level: level.into(), message: m.into(), step: None })
            .collect()
    }

    fn messages(lines: Vec<&BuildLine>) -> String {
        lines.iter().map(|l| l.message.as_str()).collect()
    }

    #[test]
    fn forward_from_a_cursor_with_a_limit() {
        let log = log();
        let q = LogWindow { cursor: Some(20), limit: Some(2), ..Default::default() };
        assert_eq!(messages(window(&log, &q).unwrap()), "bc");
    }

    #[test]
    fn backward_is_newest_first() {
        let log = log();
        let q = LogWindow { cursor: Some(30), direction: Some("backward"), ..Default::default() };
        assert_eq!(messages(window(&log, &q).unwrap()), "cba");
    }

    #[test]
    fn level_is_a_minimum() {
        let log = log();
        let q = LogWindow { level: Some("warn"), ..Default::default() };
        assert_eq!(messages(window(&log, &q).unwrap()), "cd");
        assert!(window(&log, &LogWindow { level: Some("loud"), ..Default::default() }).is_err());
        assert!(window(&log, &LogWindow { direction: Some("up"), ..Default::default() }).is_err());
    }
}
