//! The filesystem operations behind `filesystem.Filesystem`, with envd's
//! error codes. Paths are already resolved for the requesting user, and
//! every operation runs with that user's credentials (`as_user`).

use std::path::Path;

use super::entry::{EntryInfo, FileType, entry_info};
use crate::connect::{Code, RpcError};
use crate::paths;
use crate::users::{OwnerNames, User};

pub fn stat(path: &Path, names: &OwnerNames) -> Result<EntryInfo, RpcError> {
    entry_info(path, names)
}

/// Entries below `dir` down to `depth` levels (0 counts as 1). Symlinked
/// directories are listed but not descended into. Directories first, then
/// by name.
pub fn list_dir(dir: &Path, depth: u32, names: &OwnerNames) -> Result<Vec<EntryInfo>, RpcError> {
    let depth = depth.max(1);
    let meta = std::fs::metadata(dir).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            RpcError::not_found(format!("directory not found: {}", dir.display()))
        } else {
            RpcError::from_io(&e, "error getting file info")
        }
    })?;
    if !meta.is_dir() {
        return Err(RpcError::invalid(format!("path is not a directory: {}", dir.display())));
    }
    let mut entries = Vec::new();
    walk(dir, 1, depth, names, &mut entries)?;
    entries.sort_by(|a, b| {
        let rank = |e: &EntryInfo| if e.file_type == FileType::Directory && !e.is_symlink { 0 } else { 1 };
        rank(a).cmp(&rank(b)).then_with(|| a.path.to_lowercase().cmp(&b.path.to_lowercase()))
    });
    Ok(entries)
}

fn walk(dir: &Path, level: u32, depth: u32, names: &OwnerNames, out: &mut Vec<EntryInfo>) -> Result<(), RpcError> {
    let read = std::fs::read_dir(dir).map_err(|e| RpcError::from_io(&e, "error reading directory"))?;
    for item in read {
        let item = item.map_err(|e| RpcError::from_io(&e, "error reading directory"))?;
        let path = item.path();
        // Entries can vanish between readdir and lstat.
        let Ok(info) = entry_info(&path, names) else { continue };
        let descend = level < depth && info.file_type == FileType::Directory && !info.is_symlink;
        out.push(info);
        if descend {
            walk(&path, level + 1, depth, names, out)?;
        }
    }
    Ok(())
}

/// Creates `path` and missing parents, owned by `user`.
pub fn make_dir(path: &Path, user: &User, names: &OwnerNames) -> Result<EntryInfo, RpcError> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => {
            return Err(RpcError::new(Code::AlreadyExists, format!("directory already exists: {}", path.display())));
        }
        Ok(_) => {
            return Err(RpcError::invalid(format!(
                "path already exists but it is not a directory: {}",
                path.display()
            )));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(RpcError::from_io(&e, "error getting file info")),
    }
    paths::ensure_dirs(path, user.uid, user.gid).map_err(|e| RpcError::from_io(&e, "error creating directory"))?;
    entry_info(path, names)
}

/// Renames `source` to `destination`, creating the destination's parents.
pub fn rename(source: &Path, destination: &Path, user: &User, names: &OwnerNames) -> Result<EntryInfo, RpcError> {
    if std::fs::symlink_metadata(source).is_err() {
        return Err(RpcError::not_found(format!("source file not found: {}", source.display())));
    }
    if let Some(parent) = destination.parent() {
        paths::ensure_dirs(parent, user.uid, user.gid)
            .map_err(|e| RpcError::from_io(&e, "error creating destination directory"))?;
    }
    std::fs::rename(source, destination).map_err(|e| RpcError::from_io(&e, "error renaming"))?;
    entry_info(destination, names)
}

/// Removes `path` recursively; a missing path is not an error (`os.RemoveAll`).
pub fn remove(path: &Path) -> Result<(), RpcError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(RpcError::from_io(&e, "error removing")),
    };
    let result = if meta.is_dir() { std::fs::remove_dir_all(path) } else { std::fs::remove_file(path) };
    match result {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(RpcError::from_io(&e, "error removing")),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me(home: &Path) -> User {
        User {
            name: "me".into(),
            uid: nix::unistd::getuid().as_raw(),
            gid: nix::unistd::getgid().as_raw(),
            home: home.into(),
            groups: vec![],
        }
    }

    #[test]
    fn list_dir_respects_depth_and_orders_dirs_first() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        std::fs::create_dir_all(root.join("b/inner")).unwrap();
        std::fs::write(root.join("a.txt"), b"x").unwrap();
        std::fs::write(root.join("b/inner/deep.txt"), b"x").unwrap();
        let names = OwnerNames::default();
        let one: Vec<_> = list_dir(root, 1, &names).unwrap().into_iter().map(|e| e.name).collect();
        assert_eq!(one, ["b", "a.txt"]);
        let three: Vec<_> = list_dir(root, 3, &names).unwrap().into_iter().map(|e| e.name).collect();
        assert_eq!(three, ["b", "inner", "a.txt", "deep.txt"]);
        assert_eq!(list_dir(&root.join("nope"), 1, &names).unwrap_err().code, Code::NotFound);
        assert_eq!(list_dir(&root.join("a.txt"), 1, &names).unwrap_err().code, Code::InvalidArgument);
    }

    #[test]
    fn make_dir_reports_existing_paths() {
        let tmp = tempfile::tempdir().unwrap();
        let u = me(tmp.path());
        let names = OwnerNames::default();
        let e = make_dir(&tmp.path().join("x/y"), &u, &names).unwrap();
        assert_eq!(e.file_type, FileType::Directory);
        assert_eq!(make_dir(&tmp.path().join("x/y"), &u, &names).unwrap_err().code, Code::AlreadyExists);
        std::fs::write(tmp.path().join("f"), b"").unwrap();
        assert_eq!(make_dir(&tmp.path().join("f"), &u, &names).unwrap_err().code, Code::InvalidArgument);
    }

    #[test]
    fn rename_and_remove() {
        let tmp = tempfile::tempdir().unwrap();
        let u = me(tmp.path());
        let names = OwnerNames::default();
        std::fs::write(tmp.path().join("a"), b"1").unwrap();
        let e = rename(&tmp.path().join("a"), &tmp.path().join("sub/b"), &u, &names).unwrap();
        assert_eq!(e.name, "b");
        assert_eq!(rename(&tmp.path().join("a"), &tmp.path().join("c"), &u, &names).unwrap_err().code, Code::NotFound);
        remove(&tmp.path().join("sub")).unwrap();
        assert!(!tmp.path().join("sub").exists());
        remove(&tmp.path().join("sub")).unwrap();
    }
}
