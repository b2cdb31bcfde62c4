//! Which filesystems are mounted inside a sandbox's root, from `mount -p`.
//!
//! Teardown unmounts what is actually there rather than what create meant
//! to mount, so a half-finished create or a crashed gateway leaves nothing
//! behind and a second destroy finds nothing to do.

use std::path::{Path, PathBuf};

use super::{Cmd, tool};

/// `mount -p`: one mount per line in fstab(5) form.
pub fn list() -> Cmd {
    Cmd::new(tool::MOUNT, ["-p"])
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub source: String,
    pub mountpoint: PathBuf,
    pub fstype: String,
}

/// Parses fstab(5)-style lines: fields separated by blanks, with spaces
/// inside a field written as `\040`.
pub fn parse(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let source = unescape(fields.next()?);
            let mountpoint = PathBuf::from(unescape(fields.next()?));
            let fstype = fields.next()?.to_string();
            Some(Mount { source, mountpoint, fstype })
        })
        .collect()
}

fn unescape(field: &str) -> String {
    field.replace("\\040", " ").replace("\\011", "\t")
}

/// Mountpoints strictly below `root`, deepest first (the order umount
/// needs). The root itself is the sandbox's ZFS dataset, which `zfs
/// destroy` unmounts.
pub fn below(mounts: &[Mount], root: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = mounts
        .iter()
        .filter(|m| m.mountpoint != root && m.mountpoint.starts_with(root))
        .map(|m| m.mountpoint.clone())
        .collect();
    // Deepest first; ties by name so duplicates sit together for dedup.
    found.sort_by(|a, b| b.components().count().cmp(&a.components().count()).then_with(|| a.cmp(b)));
    found.dedup();
    found
}

/// `-f`: processes of a removed jail may still hold files open while the
/// kernel finishes killing them.
pub fn unmount(mountpoint: &Path) -> Cmd {
    Cmd::new(tool::UMOUNT, ["-f".to_string(), mountpoint.display().to_string()])
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNT_P: &str = "zroot/ROOT/default\t/\tzfs\trw\t0 0\n\
devfs\t/dev\tdevfs\trw\t0 0\n\
zroot/copse/sandboxes/abc\t/var/db/copse/sandboxes/abc\tzfs\trw,nosuid,noatime\t0 0\n\
devfs\t/var/db/copse/sandboxes/abc/dev\tdevfs\trw\t0 0\n\
/var/db/copse/agent\t/var/db/copse/sandboxes/abc/.copse\tnullfs\tro\t0 0\n\
zroot/copse/sandboxes/abcd\t/var/db/copse/sandboxes/abcd\tzfs\trw,nosuid,noatime\t0 0\n\
/home/op/my\\040dir\t/mnt/my\\040dir\tnullfs\tro\t0 0\n";

    #[test]
    fn mount_p_is_parsed() {
        let mounts = parse(MOUNT_P);
        assert_eq!(mounts.len(), 7);
        assert_eq!(
            mounts[4],
            Mount {
                source: "/var/db/copse/agent".into(),
                mountpoint: "/var/db/copse/sandboxes/abc/.copse".into(),
                fstype: "nullfs".into()
            }
        );
        assert_eq!(mounts[6].mountpoint, Path::new("/mnt/my dir"));
    }

    #[test]
    fn only_mounts_inside_that_sandbox_are_selected_deepest_first() {
        let mounts = parse(MOUNT_P);
        let root = Path::new("/var/db/copse/sandboxes/abc");
        // A sibling whose name merely starts the same (`abcd`) is not inside.
        assert_eq!(
            below(&mounts, root),
            vec![PathBuf::from("/var/db/copse/sandboxes/abc/.copse"), PathBuf::from("/var/db/copse/sandboxes/abc/dev")]
        );
        let nested = vec![
            Mount { source: "a".into(), mountpoint: "/r/x".into(), fstype: "nullfs".into() },
            Mount { source: "b".into(), mountpoint: "/r/x/y/z".into(), fstype: "nullfs".into() },
        ];
        assert_eq!(below(&nested, Path::new("/r")), vec![PathBuf::from("/r/x/y/z"), PathBuf::from("/r/x")]);
        assert_eq!(unmount(Path::new("/r/x")).to_string(), "/sbin/umount -f /r/x");
    }
}
