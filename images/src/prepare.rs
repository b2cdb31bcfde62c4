//! What an unpacked image needs before sandboxes boot it: the account E2B
//! sandboxes run commands as (`user`, uid 1000, home `/home/user`) and real
//! directories where the boot mounts things.
//!
//! Everything is done beneath the root without running anything from the
//! image: its binaries are the image author's, and the host runs none of
//! them as host root.

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::Path;

use anyhow::Context;
use nix::errno::Errno;
use nix::fcntl::{OFlag, openat};
use nix::sys::stat::{Mode, fchmod, mkdirat};
use nix::unistd::{Gid, Uid, fchown};

use crate::unpack::beneath::{Kind, Root, kind_at, remove_at};

pub const USER: &str = "user";
pub const UID: u32 = 1000;
pub const HOME: &str = "home/user";

/// Mount points of the boot and the directories every sandbox expects;
/// one that is a symlink or a file in the image is replaced, so a mount
/// never follows a link the image planted.
const DIRS: &[(&str, u32)] = &[
    ("proc", 0o555),
    ("sys", 0o555),
    ("dev", 0o755),
    ("tmp", 0o1777),
    ("etc", 0o755),
    (".copse", 0o755),
    ("home", 0o755),
];

/// What preparing changed, for the progress log.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Prepared {
    pub added_user: bool,
    pub shell: &'static str,
}

pub fn prepare(root: &Path) -> anyhow::Result<Prepared> {
    let root = Root::open(root)?;
    let top = root.open_dir(Path::new(""))?;
    for (name, mode) in DIRS {
        real_dir(&top, OsStr::new(name), *mode, (0, 0))?;
    }
    for name in [".copse/bin", ".copse/run"] {
        let (dir, last) = root.parent_of(Path::new(name))?.expect("named");
        real_dir(&dir, &last, 0o755, (0, 0))?;
    }
    let shell = if exists(&root, "bin/bash")? { "/bin/bash" } else { "/bin/sh" };
    let etc = root.open_dir(Path::new("etc"))?;
    let passwd = read_text(&etc, "passwd")?;
    let added_user = !has_entry(&passwd, USER);
    if added_user {
        append_line(&etc, "passwd", &passwd, &format!("{USER}:x:{UID}:{UID}::/{HOME}:{shell}"))?;
    }
    let group = read_text(&etc, "group")?;
    if !has_entry(&group, USER) {
        append_line(&etc, "group", &group, &format!("{USER}:x:{UID}:"))?;
    }
    if read_text(&etc, "hosts")?.is_empty() {
        append_line(&etc, "hosts", "", "127.0.0.1 localhost\n::1 localhost")?;
    }
    let (home_parent, home) = root.parent_of(Path::new(HOME))?.expect("named");
    if !matches!(kind_at(&home_parent, &home)?, Some(Kind::Dir)) {
        real_dir(&home_parent, &home, 0o750, (UID, UID))?;
    }
    Ok(Prepared { added_user, shell })
}

fn real_dir(parent: &OwnedFd, name: &OsStr, mode: u32, (uid, gid): (u32, u32)) -> anyhow::Result<()> {
    if matches!(kind_at(parent, name)?, Some(Kind::Dir)) {
        return Ok(());
    }
    remove_at(parent, name)?;
    mkdirat(parent, name, Mode::from_bits_truncate(0o700)).with_context(|| format!("creating {name:?}"))?;
    let fd = openat(parent, name, OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW, Mode::empty())?;
    fchown(&fd, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))?;
    fchmod(&fd, Mode::from_bits_truncate(mode as _))?;
    Ok(())
}

/// Whether `path` names something in the image (links followed beneath the root).
fn exists(root: &Root, path: &str) -> anyhow::Result<bool> {
    let path = Path::new(path);
    let name = path.file_name().expect("named");
    match root.open_dir(path.parent().expect("has a parent")) {
        Ok(dir) => Ok(kind_at(&dir, name)?.is_some()),
        Err(_) => Ok(false),
    }
}

/// A file of `etc`, empty if missing; never through a symlink.
fn read_text(etc: &OwnedFd, name: &str) -> anyhow::Result<String> {
    match openat(etc, name, OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC, Mode::empty()) {
        Ok(fd) => {
            let mut text = String::new();
            std::fs::File::from(fd).read_to_string(&mut text).with_context(|| format!("reading /etc/{name}"))?;
            Ok(text)
        }
        Err(Errno::ENOENT) => Ok(String::new()),
        Err(Errno::ELOOP) => anyhow::bail!("/etc/{name} in the image is a symlink; copse will not edit it"),
        Err(e) => Err(e).with_context(|| format!("opening /etc/{name}")),
    }
}

fn append_line(etc: &OwnedFd, name: &str, before: &str, line: &str) -> anyhow::Result<()> {
    let fd = openat(
        etc,
        name,
        OFlag::O_WRONLY | OFlag::O_APPEND | OFlag::O_CREAT | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o644),
    )
    .with_context(|| format!("opening /etc/{name}"))?;
    let mut file = std::fs::File::from(fd);
    let sep = if before.is_empty() || before.ends_with('\n') { "" } else { "\n" };
    writeln!(file, "{sep}{line}").with_context(|| format!("writing /etc/{name}"))
}

fn has_entry(table: &str, name: &str) -> bool {
    table.lines().any(|l| l.split(':').next() == Some(name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn adds_the_sandbox_user_and_mount_points_once() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir_all(root.join("etc")).unwrap();
        fs::create_dir_all(root.join("bin")).unwrap();
        fs::write(root.join("bin/bash"), "").unwrap();
        fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh").unwrap();
        // A planted symlink where the boot mounts /proc.
        std::os::unix::fs::symlink("/etc", root.join("proc")).unwrap();
        let done = prepare(root).unwrap();
        assert_eq!(done, Prepared { added_user: true, shell: "/bin/bash" });
        assert_eq!(
            fs::read_to_string(root.join("etc/passwd")).unwrap(),
            "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/bash\n"
        );
        assert_eq!(fs::read_to_string(root.join("etc/group")).unwrap(), "user:x:1000:\n");
        assert!(fs::symlink_metadata(root.join("proc")).unwrap().is_dir());
        assert!(root.join(".copse/bin").is_dir() && root.join(".copse/run").is_dir());
        assert_eq!(fs::metadata(root.join("home/user")).unwrap().uid(), UID);
        assert!(!prepare(root).unwrap().added_user);
        assert_eq!(
            fs::read_to_string(root.join("etc/passwd")).unwrap().lines().filter(|l| l.starts_with("user:")).count(),
            1
        );
    }

    #[test]
    fn a_symlinked_passwd_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir_all(dir.path().join("etc")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("etc/passwd")).unwrap();
        assert!(format!("{:#}", prepare(dir.path()).unwrap_err()).contains("symlink"));
    }
}
