//! The journal: one intent per state change that touches both the store
//! and the host, written before the host is touched and removed once the
//! store says what the host now holds. An intent still there at start is
//! a change a crash cut short; `service::recover` finishes it or undoes it.

use serde::{Deserialize, Serialize};

/// A state change under way on one sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Intent {
    /// Unique per intent: one sandbox may have a snapshot and a fork under
    /// way at once.
    pub id: String,
    pub sandbox: String,
    pub change: Change,
    pub started_at_ms: i64,
    /// The node whose host the change touches, on a shared database
    /// (`model::node`); `None` on a single host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

/// What was being done, with every name the host may already hold for it
/// (chosen before the host is touched, so recovery can find it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Change {
    /// Freezing in place (`files: None`) or keeping only the files in
    /// substrate snapshot `files` and ending the processes.
    Pause { files: Option<String> },
    /// Thawing (`files: None`), or booting again from substrate snapshot
    /// `files`.
    Resume { files: Option<String> },
    /// Taking substrate snapshot `key` (the sandbox is held still while it
    /// is taken).
    Snapshot { key: String },
    /// Taking substrate snapshot `key` and booting children from it.
    Fork { key: String },
    /// Putting substrate snapshot `key` in place of the sandbox's files.
    Rollback { key: String },
    /// Destroying the sandbox, its files kept in `files` if paused so.
    Kill { files: Option<String> },
}

impl Change {
    /// The operation's name in log lines and fault points.
    pub fn name(&self) -> &'static str {
        match self {
            Change::Pause { .. } => "pause",
            Change::Resume { .. } => "resume",
            Change::Snapshot { .. } => "snapshot",
            Change::Fork { .. } => "fork",
            Change::Rollback { .. } => "rollback",
            Change::Kill { .. } => "kill",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_intent_reads_back_as_written() {
        let intent = Intent {
            id: "i1".into(),
            sandbox: "s1".into(),
            change: Change::Pause { files: Some("k".into()) },
            started_at_ms: 5,
            node: Some("n".into()),
        };
        let json = serde_json::to_string(&intent).unwrap();
        assert!(json.contains(r#""op":"pause""#), "{json}");
        assert_eq!(serde_json::from_str::<Intent>(&json).unwrap(), intent);
    }
}
