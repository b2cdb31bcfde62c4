//! Each sandbox's own log, E2B's "sandbox logs": what happened to it
//! (created, paused, resumed, snapshotted, ended, and why) and the envd
//! calls the gateway forwarded to it (processes started, files moved).
//!
//! Durable and the gateway's alone: one JSON line per entry in
//! `DATA_DIR/logs/<id>.jsonl` (0600, in a 0700 directory nothing of a
//! sandbox can reach), appended under a lock, rotated once past
//! [`MAX_BYTES`] (one older file kept), and kept [`RETENTION`] after the
//! sandbox ends so its logs can still be read after a kill, as on E2B.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::model::now_ms;

/// A sandbox's log file is rotated past this size; with the one older file
/// kept, a sandbox holds at most twice this on disk.
pub const MAX_BYTES: u64 = 1 << 20;
/// How long the log of a sandbox that ended is kept.
pub const RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// E2B's levels, least severe first (the order the `level` filter uses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    Debug,
    Info,
    Warn,
    Error,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub at_ms: i64,
    pub level: Level,
    pub message: String,
    #[serde(default)]
    pub fields: BTreeMap<String, String>,
}

/// Which entries a reader asked for (E2B's v2 query; v1's is forward only).
#[derive(Debug, Clone, Default)]
pub struct Query {
    /// Unix milliseconds: forward from it (inclusive) or backward from it.
    pub cursor_ms: Option<i64>,
    pub limit: usize,
    /// Newest first, from `cursor_ms` (default now) back.
    pub backward: bool,
    /// Entries below this level are left out.
    pub min_level: Option<Level>,
    /// Case-sensitive substring of the message.
    pub search: Option<String>,
}

pub struct SandboxLog {
    /// `None`: logging off (unit tests of the service).
    dir: Option<PathBuf>,
    /// One append (and its rotation) at a time.
    writing: Mutex<()>,
}

impl SandboxLog {
    pub fn disabled() -> Self {
        Self { dir: None, writing: Mutex::new(()) }
    }

    /// Logs in `dir`, made private to the gateway's user.
    pub fn open(dir: PathBuf) -> anyhow::Result<Self> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self { dir: Some(dir), writing: Mutex::new(()) })
    }

    /// Appends one entry to sandbox `id`'s log. A failure is logged, never
    /// returned: a full disk must not fail the verb being logged.
    pub fn append(&self, id: &str, level: Level, message: &str, fields: &[(&str, String)]) {
        let Some(path) = self.path(id, "") else { return };
        let entry = Entry {
            at_ms: now_ms(),
            level,
            message: message.to_string(),
            fields: fields.iter().map(|(k, v)| (k.to_string(), v.clone())).collect(),
        };
        let mut line = serde_json::to_vec(&entry).expect("an entry serialises");
        line.push(b'\n');
        let _one_writer = self.writing.lock().unwrap_or_else(|p| p.into_inner());
        if std::fs::metadata(&path).is_ok_and(|m| m.len() + line.len() as u64 > MAX_BYTES)
            && let Some(older) = self.path(id, ".1")
            && let Err(e) = std::fs::rename(&path, &older)
        {
            tracing::warn!(sandbox_id = id, "rotating the sandbox log: {e}");
        }
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .and_then(|mut f| f.write_all(&line));
        if let Err(e) = written {
            tracing::warn!(sandbox_id = id, "writing the sandbox log {}: {e}", path.display());
        }
    }

    /// Every entry of sandbox `id`'s log, oldest first; `None` if it has
    /// none (never had, or it was swept). A line that does not parse (a
    /// write cut short by a crash) is skipped.
    pub fn read(&self, id: &str) -> anyhow::Result<Option<Vec<Entry>>> {
        let (Some(older), Some(current)) = (self.path(id, ".1"), self.path(id, "")) else { return Ok(None) };
        let mut entries = Vec::new();
        let mut found = false;
        for path in [older, current] {
            let file = match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(&path) {
                Ok(file) => file,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
            };
            found = true;
            for line in BufReader::new(file).lines() {
                if let Ok(entry) = serde_json::from_str::<Entry>(&line?) {
                    entries.push(entry);
                }
            }
        }
        Ok(found.then_some(entries))
    }

    /// Deletes the logs of sandboxes `live` does not name that were last
    /// written more than `retention` ago.
    pub fn sweep(&self, live: &dyn Fn(&str) -> bool, retention: Duration) {
        let Some(dir) = &self.dir else { return };
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(id) = name.strip_suffix(".jsonl").or_else(|| name.strip_suffix(".jsonl.1")) else { continue };
            let stale =
                entry.metadata().and_then(|m| m.modified()).is_ok_and(|t| t.elapsed().unwrap_or_default() > retention);
            if stale && !live(id) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    /// The file of sandbox `id`; `None` when logging is off or `id` is not
    /// a sandbox id (it names a file: letters and digits only).
    fn path(&self, id: &str, suffix: &str) -> Option<PathBuf> {
        let valid = !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_alphanumeric());
        Some(self.dir.as_ref()?.join(format!("{id}.jsonl{suffix}"))).filter(|_| valid)
    }
}

/// One page of `entries` (oldest first) as `query` asks.
pub fn page(entries: Vec<Entry>, query: &Query) -> Vec<Entry> {
    let wanted = |e: &Entry| {
        query.min_level.is_none_or(|min| e.level >= min)
            && query.search.as_deref().is_none_or(|s| e.message.contains(s))
    };
    if query.backward {
        let cursor = query.cursor_ms.unwrap_or(i64::MAX);
        entries.into_iter().rev().filter(|e| e.at_ms <= cursor && wanted(e)).take(query.limit).collect()
    } else {
        let cursor = query.cursor_ms.unwrap_or(0);
        entries.into_iter().filter(|e| e.at_ms >= cursor && wanted(e)).take(query.limit).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(at_ms: i64, level: Level, message: &str) -> Entry {
        Entry { at_ms, level, message: message.into(), fields: BTreeMap::new() }
    }

    #[test]
    fn entries_survive_a_reopen_and_names_that_are_not_ids_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let log = SandboxLog::open(dir.path().join("logs")).unwrap();
        log.append("abc123", Level::Info, "created", &[("template", "base".into())]);
        log.append("../evil", Level::Info, "x", &[]);
        let reopened = SandboxLog::open(dir.path().join("logs")).unwrap();
        let entries = reopened.read("abc123").unwrap().unwrap();
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].fields["template"], "base");
        assert!(reopened.read("../evil").unwrap().is_none());
        assert!(reopened.read("other").unwrap().is_none());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "nothing written outside the log dir");
    }

    #[test]
    fn a_full_log_rotates_keeping_one_older_file() {
        let dir = tempfile::tempdir().unwrap();
        let log = SandboxLog::open(dir.path().to_path_buf()).unwrap();
        let long = "x".repeat(4096);
        let lines = (MAX_BYTES as usize / 4096) * 3;
        for _ in 0..lines {
            log.append("a", Level::Info, &long, &[]);
        }
        let kept = log.read("a").unwrap().unwrap().len();
        assert!(kept < lines && kept > lines / 3, "kept {kept} of {lines}");
        let on_disk: u64 = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
        assert!(on_disk <= 2 * MAX_BYTES);
    }

    #[test]
    fn a_symlink_planted_for_a_log_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        std::fs::write(&target, "").unwrap();
        let logs = dir.path().join("logs");
        let log = SandboxLog::open(logs.clone()).unwrap();
        std::os::unix::fs::symlink(&target, logs.join("a.jsonl")).unwrap();
        log.append("a", Level::Info, "x", &[]);
        assert_eq!(std::fs::read(&target).unwrap(), b"");
    }

    #[test]
    fn pages_go_forward_or_backward_from_the_cursor_with_filters() {
        let all = vec![
            entry(10, Level::Info, "created"),
            entry(20, Level::Debug, "process started"),
            entry(30, Level::Warn, "paused"),
            entry(40, Level::Info, "killed"),
        ];
        let at = |q: Query| page(all.clone(), &q).iter().map(|e| e.at_ms).collect::<Vec<_>>();
        assert_eq!(at(Query { limit: 2, ..Default::default() }), [10, 20]);
        assert_eq!(at(Query { limit: 10, cursor_ms: Some(20), ..Default::default() }), [20, 30, 40]);
        assert_eq!(at(Query { limit: 2, backward: true, ..Default::default() }), [40, 30]);
        assert_eq!(at(Query { limit: 10, backward: true, cursor_ms: Some(25), ..Default::default() }), [20, 10]);
        assert_eq!(at(Query { limit: 10, min_level: Some(Level::Info), ..Default::default() }), [10, 30, 40]);
        assert_eq!(at(Query { limit: 10, search: Some("ill".into()), ..Default::default() }), [40]);
    }

    #[test]
    fn sweeping_keeps_live_and_recent_logs() {
        let dir = tempfile::tempdir().unwrap();
        let log = SandboxLog::open(dir.path().to_path_buf()).unwrap();
        for id in ["live", "gone", "recent"] {
            log.append(id, Level::Info, "x", &[]);
        }
        log.sweep(&|id| id == "live", Duration::from_secs(3600));
        assert!(log.read("recent").unwrap().is_some(), "recent logs stay");
        std::thread::sleep(Duration::from_millis(20));
        log.sweep(&|id| id == "live", Duration::from_millis(1));
        assert!(log.read("live").unwrap().is_some());
        assert!(log.read("gone").unwrap().is_none());
    }
}
