//! Directory watching (inotify on Linux, kqueue on FreeBSD, via `notify`),
//! reported in envd's terms: CREATE / WRITE / REMOVE / RENAME / CHMOD with
//! names relative to the watched directory. A rename shows up as RENAME of
//! the old name plus CREATE of the new one, as fsnotify reports it.
//!
//! Two consumers: the `WatchDir` stream, and the polled watchers
//! (`CreateWatcher`/`GetWatcherEvents`/`RemoveWatcher`) the sync SDK uses.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use notify::event::{ModifyKind, RenameMode};
use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;

use crate::connect::RpcError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum EventType {
    #[serde(rename = "EVENT_TYPE_CREATE")]
    Create,
    #[serde(rename = "EVENT_TYPE_WRITE")]
    Write,
    #[serde(rename = "EVENT_TYPE_REMOVE")]
    Remove,
    #[serde(rename = "EVENT_TYPE_RENAME")]
    Rename,
    #[serde(rename = "EVENT_TYPE_CHMOD")]
    Chmod,
}

/// One change below a watched directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsEvent {
    /// Relative to the watched directory.
    pub name: String,
    pub kind: EventType,
    pub path: PathBuf,
}

/// Translates one `notify` event into envd events.
fn translate(root: &Path, event: &notify::Event) -> Vec<FsEvent> {
    let kind = match event.kind {
        EventKind::Create(_) | EventKind::Modify(ModifyKind::Name(RenameMode::To)) => EventType::Create,
        EventKind::Modify(ModifyKind::Name(RenameMode::Both)) => return Vec::new(),
        EventKind::Modify(ModifyKind::Name(_)) => EventType::Rename,
        EventKind::Modify(ModifyKind::Metadata(_)) => EventType::Chmod,
        EventKind::Modify(_) => EventType::Write,
        EventKind::Remove(_) => EventType::Remove,
        EventKind::Access(_) | EventKind::Any | EventKind::Other => return Vec::new(),
    };
    event
        .paths
        .iter()
        .map(|p| FsEvent { name: p.strip_prefix(root).unwrap_or(p).display().to_string(), kind, path: p.clone() })
        .collect()
}

/// Checks `path` is a watchable directory (envd: not_found / invalid_argument).
fn check_dir(path: &Path) -> Result<(), RpcError> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(RpcError::invalid(format!("path {} not a directory", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(RpcError::not_found(format!("path {} not found", path.display())))
        }
        Err(e) => Err(RpcError::from_io(&e, "error statting path")),
    }
}

/// Starts watching `root`, handing each event (or the watcher's error) to `sink`.
fn start<F>(root: &Path, recursive: bool, mut sink: F) -> Result<RecommendedWatcher, RpcError>
where
    F: FnMut(Result<FsEvent, String>) + Send + 'static,
{
    check_dir(root)?;
    let owned_root = root.to_path_buf();
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| match res {
        Ok(ev) => translate(&owned_root, &ev).into_iter().for_each(|e| sink(Ok(e))),
        Err(e) => sink(Err(format!("watcher error: {e}"))),
    })
    .map_err(|e| RpcError::internal(format!("error creating watcher: {e}")))?;
    let mode = if recursive { RecursiveMode::Recursive } else { RecursiveMode::NonRecursive };
    watcher
        .watch(root, mode)
        .map_err(|e| RpcError::internal(format!("error adding path {} to watcher: {e}", root.display())))?;
    Ok(watcher)
}

/// A live watch feeding a channel; dropping it stops the watch.
pub struct WatchStream {
    _watcher: RecommendedWatcher,
    events: mpsc::UnboundedReceiver<Result<FsEvent, String>>,
}

impl WatchStream {
    /// The next change, or the watcher's failure.
    pub async fn next(&mut self) -> Option<Result<FsEvent, String>> {
        self.events.recv().await
    }
}

pub fn stream(root: &Path, recursive: bool) -> Result<WatchStream, RpcError> {
    let (tx, events) = mpsc::unbounded_channel();
    let watcher = start(root, recursive, move |e| {
        let _ = tx.send(e);
    })?;
    Ok(WatchStream { _watcher: watcher, events })
}

/// A polled watcher: events accumulate until fetched.
struct Polled {
    _watcher: RecommendedWatcher,
    root: PathBuf,
    buffer: Arc<Mutex<Buffer>>,
}

#[derive(Default)]
struct Buffer {
    events: Vec<FsEvent>,
    error: Option<String>,
}

/// The polled watchers by id.
#[derive(Default)]
pub struct Watchers {
    inner: Mutex<HashMap<String, Polled>>,
    next: AtomicU64,
}

impl Watchers {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Polled>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn create(&self, root: &Path, recursive: bool) -> Result<String, RpcError> {
        let buffer = Arc::new(Mutex::new(Buffer::default()));
        let sink = buffer.clone();
        let watcher = start(root, recursive, move |e| {
            let mut b = sink.lock().unwrap_or_else(|e| e.into_inner());
            match e {
                Ok(ev) => b.events.push(ev),
                Err(msg) => b.error = Some(msg),
            }
        })?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let id = format!("w{:x}{:x}", nanos, self.next.fetch_add(1, Ordering::Relaxed));
        self.map().insert(id.clone(), Polled { _watcher: watcher, root: root.to_path_buf(), buffer });
        Ok(id)
    }

    /// Takes the events gathered since the last call, with the watched root.
    pub fn take(&self, id: &str) -> Result<(PathBuf, Vec<FsEvent>), RpcError> {
        let map = self.map();
        let w = map.get(id).ok_or_else(|| RpcError::not_found(format!("watcher with id {id} not found")))?;
        let mut b = w.buffer.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(err) = &b.error {
            return Err(RpcError::internal(err.clone()));
        }
        Ok((w.root.clone(), std::mem::take(&mut b.events)))
    }

    pub fn remove(&self, id: &str) -> Result<(), RpcError> {
        self.map().remove(id).map(drop).ok_or_else(|| RpcError::not_found(format!("watcher with id {id} not found")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use notify::event::{CreateKind, DataChange, MetadataKind, RemoveKind};

    fn ev(kind: EventKind, p: &str) -> notify::Event {
        notify::Event::new(kind).add_path(PathBuf::from(p))
    }

    #[test]
    fn maps_notify_kinds_to_envd_types() {
        let root = Path::new("/w");
        let t = |k| translate(root, &ev(k, "/w/sub/f")).first().map(|e| e.kind);
        assert_eq!(t(EventKind::Create(CreateKind::File)), Some(EventType::Create));
        assert_eq!(t(EventKind::Modify(ModifyKind::Data(DataChange::Any))), Some(EventType::Write));
        assert_eq!(t(EventKind::Modify(ModifyKind::Metadata(MetadataKind::Permissions))), Some(EventType::Chmod));
        assert_eq!(t(EventKind::Modify(ModifyKind::Name(RenameMode::From))), Some(EventType::Rename));
        assert_eq!(t(EventKind::Modify(ModifyKind::Name(RenameMode::To))), Some(EventType::Create));
        assert_eq!(t(EventKind::Modify(ModifyKind::Name(RenameMode::Both))), None);
        assert_eq!(t(EventKind::Remove(RemoveKind::File)), Some(EventType::Remove));
        assert_eq!(t(EventKind::Access(notify::event::AccessKind::Any)), None);
        assert_eq!(translate(root, &ev(EventKind::Create(CreateKind::File), "/w/sub/f"))[0].name, "sub/f");
    }

    #[test]
    fn polled_watcher_sees_new_files() {
        let tmp = tempfile::tempdir().unwrap();
        let watchers = Watchers::default();
        let id = watchers.create(tmp.path(), false).unwrap();
        std::fs::write(tmp.path().join("hello.txt"), b"hi").unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
        let mut seen = Vec::new();
        while std::time::Instant::now() < deadline && !seen.iter().any(|e: &FsEvent| e.kind == EventType::Write) {
            seen.extend(watchers.take(&id).unwrap().1);
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(seen.iter().any(|e| e.name == "hello.txt" && e.kind == EventType::Create), "{seen:?}");
        assert!(seen.iter().any(|e| e.name == "hello.txt" && e.kind == EventType::Write), "{seen:?}");
        watchers.remove(&id).unwrap();
        assert_eq!(watchers.take(&id).unwrap_err().code, crate::connect::Code::NotFound);
    }
}
