//! Path resolution as envd does it (`permissions/path.go`): `~` and relative
//! paths resolve against the user's home, and directories the agent creates
//! on a user's behalf belong to that user.

use std::io;
use std::path::{Component, Path, PathBuf};

use crate::users::User;

/// Resolves a client-supplied path for `user`. An empty path means the
/// home directory. `~other/...` is refused like envd does.
pub fn resolve(path: &str, user: &User) -> Result<PathBuf, String> {
    let expanded: PathBuf = if path.is_empty() {
        user.home.clone()
    } else if let Some(rest) = path.strip_prefix('~') {
        if !rest.is_empty() && !rest.starts_with('/') {
            return Err(format!("cannot expand user-specific home dir in '{path}'"));
        }
        user.home.join(rest.trim_start_matches('/'))
    } else if path.starts_with('/') {
        PathBuf::from(path)
    } else {
        user.home.join(path)
    };
    Ok(normalize(&expanded))
}

/// Lexical clean-up (`a/./b/../c` → `a/c`) without touching the disk, like
/// Go's `filepath.Clean`.
pub fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(s) => out.push(s),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// Creates every missing directory of `dir` (mode 0755) and hands each one it
/// created to `uid:gid`. Fails if a component exists but is not a directory.
pub fn ensure_dirs(dir: &Path, uid: u32, gid: u32) -> io::Result<()> {
    let mut missing = Vec::new();
    let mut cur = Some(dir);
    while let Some(p) = cur {
        match std::fs::metadata(p) {
            Ok(m) if m.is_dir() => break,
            Ok(_) => {
                return Err(io::Error::new(io::ErrorKind::NotADirectory, format!("path is a file: {}", p.display())));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => missing.push(p),
            Err(e) => return Err(e),
        }
        cur = p.parent();
    }
    for p in missing.into_iter().rev() {
        match std::fs::create_dir(p) {
            Ok(()) => chown(p, uid, gid)?,
            // Somebody else created it meanwhile: fine, but not ours to chown.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `chown` that does not follow a final symlink.
pub fn chown(path: &Path, uid: u32, gid: u32) -> io::Result<()> {
    std::os::unix::fs::lchown(path, Some(uid), Some(gid))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user() -> User {
        User { name: "user".into(), uid: 1, gid: 1, home: "/home/user".into(), groups: vec![1] }
    }

    #[test]
    fn resolves_like_envd() {
        let u = user();
        assert_eq!(resolve("", &u).unwrap(), PathBuf::from("/home/user"));
        assert_eq!(resolve("a/b", &u).unwrap(), PathBuf::from("/home/user/a/b"));
        assert_eq!(resolve("~", &u).unwrap(), PathBuf::from("/home/user"));
        assert_eq!(resolve("~/x", &u).unwrap(), PathBuf::from("/home/user/x"));
        assert_eq!(resolve("/tmp/../etc/./x", &u).unwrap(), PathBuf::from("/etc/x"));
        assert_eq!(resolve("../../..", &u).unwrap(), PathBuf::from("/"));
        assert!(resolve("~root/x", &u).is_err());
    }

    #[test]
    fn ensure_dirs_creates_missing_parents() {
        let tmp = tempfile::tempdir().unwrap();
        let (uid, gid) = (nix::unistd::getuid().as_raw(), nix::unistd::getgid().as_raw());
        let deep = tmp.path().join("a/b/c");
        ensure_dirs(&deep, uid, gid).unwrap();
        assert!(deep.is_dir());
        std::fs::write(tmp.path().join("f"), b"x").unwrap();
        assert!(ensure_dirs(&tmp.path().join("f/g"), uid, gid).is_err());
    }
}
