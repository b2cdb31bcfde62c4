//! Crafted layers: the changeset rules, and the tricks a hostile image
//! would try to write outside the root.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use super::*;

/// A tar entry written header-first, so names and link targets can be
/// what no well-behaved tar writer would produce (`..`, absolute paths).
struct Layer {
    builder: tar::Builder<Vec<u8>>,
}

impl Layer {
    fn new() -> Self {
        Self { builder: tar::Builder::new(Vec::new()) }
    }

    fn raw(mut self, name: &str, kind: tar::EntryType, link: &str, data: &[u8], mode: u32) -> Self {
        let mut header = tar::Header::new_gnu();
        let gnu = header.as_gnu_mut().unwrap();
        gnu.name[..name.len()].copy_from_slice(name.as_bytes());
        gnu.linkname[..link.len()].copy_from_slice(link.as_bytes());
        header.set_entry_type(kind);
        header.set_size(data.len() as u64);
        header.set_mode(mode);
        header.set_uid(0);
        header.set_gid(0);
        header.set_cksum();
        self.builder.append(&header, data).unwrap();
        self
    }

    fn dir(self, name: &str) -> Self {
        self.raw(name, tar::EntryType::Directory, "", b"", 0o755)
    }

    fn file(self, name: &str, data: &str) -> Self {
        self.raw(name, tar::EntryType::Regular, "", data.as_bytes(), 0o644)
    }

    fn symlink(self, name: &str, target: &str) -> Self {
        self.raw(name, tar::EntryType::Symlink, target, b"", 0o777)
    }

    fn hardlink(self, name: &str, target: &str) -> Self {
        self.raw(name, tar::EntryType::Link, target, b"", 0o644)
    }

    fn apply(self, root: &Path) -> anyhow::Result<Applied> {
        let bytes = self.builder.into_inner().unwrap();
        apply_layer(root, bytes.as_slice())
    }
}

/// A root inside a scratch directory, with a sibling "host" file the
/// attacks aim at.
fn scratch() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("rootfs");
    fs::create_dir(&root).unwrap();
    fs::write(dir.path().join("host-file"), "host").unwrap();
    (dir, root)
}

fn read(path: impl AsRef<Path>) -> String {
    fs::read_to_string(path).unwrap()
}

#[test]
fn files_dirs_and_modes_land_beneath_the_root() {
    let (_t, root) = scratch();
    Layer::new()
        .dir("etc/")
        .file("etc/hostname", "img")
        .raw("usr/bin/tool", tar::EntryType::Regular, "", b"#!/bin/sh\n", 0o4755)
        .apply(&root)
        .unwrap();
    assert_eq!(read(root.join("etc/hostname")), "img");
    // A parent the layer never listed is made on the way.
    let tool = fs::metadata(root.join("usr/bin/tool")).unwrap();
    assert_eq!(tool.permissions().mode() & 0o7777, 0o4755);
    assert_eq!(tool.uid(), 0);
}

#[test]
fn a_whiteout_removes_what_a_lower_layer_had() {
    let (_t, root) = scratch();
    Layer::new().file("a/keep", "1").file("a/gone", "2").dir("a/tree/").file("a/tree/x", "3").apply(&root).unwrap();
    let done = Layer::new().file("a/.wh.gone", "").file("a/.wh.tree", "").apply(&root).unwrap();
    assert_eq!(done.whiteouts, 2);
    assert!(root.join("a/keep").exists());
    assert!(!root.join("a/gone").exists());
    assert!(!root.join("a/tree").exists());
    assert!(!root.join("a/.wh.gone").exists(), "the marker itself is never written");
}

#[test]
fn an_opaque_directory_hides_lower_entries_but_keeps_its_own() {
    let (_t, root) = scratch();
    Layer::new().file("d/old", "1").dir("d/sub/").file("d/sub/old", "2").apply(&root).unwrap();
    // The marker after one of the layer's own entries, before another.
    Layer::new().dir("d/").file("d/new", "3").file("d/.wh..wh..opq", "").file("d/later", "4").apply(&root).unwrap();
    let mut names: Vec<_> = fs::read_dir(root.join("d")).unwrap().map(|e| e.unwrap().file_name()).collect();
    names.sort();
    assert_eq!(names, ["later", "new"]);
}

#[test]
fn hard_links_share_the_inode_of_their_target() {
    let (_t, root) = scratch();
    Layer::new().file("bin/a", "same").hardlink("bin/b", "bin/a").apply(&root).unwrap();
    let (a, b) = (fs::metadata(root.join("bin/a")).unwrap(), fs::metadata(root.join("bin/b")).unwrap());
    assert_eq!(a.ino(), b.ino());
    assert_eq!(read(root.join("bin/b")), "same");
}

#[test]
fn a_file_replaces_a_directory_and_a_symlink_replaces_a_file() {
    let (_t, root) = scratch();
    Layer::new().dir("x/").file("x/in", "1").file("y", "2").apply(&root).unwrap();
    Layer::new().file("x", "now a file").symlink("y", "x").apply(&root).unwrap();
    assert_eq!(read(root.join("x")), "now a file");
    assert_eq!(fs::read_link(root.join("y")).unwrap(), Path::new("x"));
}

#[test]
fn dot_dot_in_an_entry_name_is_refused_and_writes_nothing_outside() {
    let (t, root) = scratch();
    let err = Layer::new().file("../host-file", "owned").apply(&root).unwrap_err();
    assert!(format!("{err:#}").contains(".."), "{err:#}");
    let err = Layer::new().file("a/../../host-file", "owned").apply(&root).unwrap_err();
    assert!(format!("{err:#}").contains(".."), "{err:#}");
    assert_eq!(read(t.path().join("host-file")), "host");
}

#[test]
fn an_absolute_entry_name_lands_inside_the_root() {
    let (t, root) = scratch();
    let abs = t.path().join("host-file");
    Layer::new().file(abs.to_str().unwrap(), "inside").apply(&root).unwrap();
    assert_eq!(read(&abs), "host");
    assert_eq!(read(root.join(abs.strip_prefix("/").unwrap())), "inside");
}

#[test]
fn writing_through_an_absolute_symlink_stays_in_the_root() {
    let (t, root) = scratch();
    // The symlink points at the host's directory holding host-file; the
    // next entry writes "through" it.
    let host_dir = t.path().to_str().unwrap().to_string();
    Layer::new().symlink("escape", &host_dir).file("escape/host-file", "owned").apply(&root).unwrap();
    assert_eq!(read(t.path().join("host-file")), "host");
    // As the sandbox will see it: /escape -> <host_dir>, inside the root.
    let inside = root.join(host_dir.trim_start_matches('/')).join("host-file");
    assert_eq!(read(inside), "owned");
}

#[test]
fn writing_through_a_climbing_symlink_stays_in_the_root() {
    let (t, root) = scratch();
    Layer::new().symlink("up", "../../../..").file("up/host-file", "owned").apply(&root).unwrap();
    assert_eq!(read(t.path().join("host-file")), "host");
    assert_eq!(read(root.join("host-file")), "owned");
}

#[test]
fn a_symlink_in_a_lower_layer_does_not_redirect_a_later_file() {
    let (t, root) = scratch();
    let host_file = t.path().join("host-file");
    Layer::new().symlink("etc", t.path().to_str().unwrap()).apply(&root).unwrap();
    // The final component is a symlink to the host file: replaced, not followed.
    Layer::new().symlink("f", host_file.to_str().unwrap()).apply(&root).unwrap();
    Layer::new().file("f", "owned").file("etc/host-file", "owned").apply(&root).unwrap();
    assert_eq!(read(&host_file), "host");
    assert_eq!(read(root.join("f")), "owned");
}

#[test]
fn a_hard_link_cannot_reach_a_host_file() {
    let (t, root) = scratch();
    let host_file = t.path().join("host-file");
    // By absolute name: resolved inside the root, where there is no such file.
    let err = Layer::new().hardlink("stolen", host_file.to_str().unwrap()).apply(&root).unwrap_err();
    assert!(format!("{err:#}").contains("does not exist") || format!("{err:#}").contains("no such"), "{err:#}");
    // Through a symlinked directory: still inside the root.
    let err = Layer::new()
        .symlink("h", t.path().to_str().unwrap())
        .hardlink("stolen", "h/host-file")
        .apply(&root)
        .unwrap_err();
    assert!(format!("{err:#}").contains("does not exist") || format!("{err:#}").contains("no such"), "{err:#}");
    assert_eq!(fs::metadata(&host_file).unwrap().nlink(), 1);
    // By `..`: refused.
    assert!(Layer::new().hardlink("stolen", "../host-file").apply(&root).is_err());
    assert_eq!(fs::metadata(&host_file).unwrap().nlink(), 1);
}

#[test]
fn a_whiteout_through_a_symlink_removes_nothing_outside() {
    let (t, root) = scratch();
    Layer::new().symlink("h", t.path().to_str().unwrap()).apply(&root).unwrap();
    Layer::new().file("h/.wh.host-file", "").file(".wh.h", "").apply(&root).unwrap();
    assert_eq!(read(t.path().join("host-file")), "host");
    assert!(fs::symlink_metadata(root.join("h")).is_err(), "the symlink itself is whited out");
}

#[test]
fn ids_past_the_sandbox_range_become_nobody() {
    let (_t, root) = scratch();
    let mut header = tar::Header::new_gnu();
    header.set_path("f").unwrap();
    header.set_size(0);
    header.set_mode(0o644);
    header.set_uid(200_000);
    header.set_gid(7);
    header.set_entry_type(tar::EntryType::Regular);
    header.set_cksum();
    let mut builder = tar::Builder::new(Vec::new());
    builder.append(&header, &b""[..]).unwrap();
    apply_layer(&root, builder.into_inner().unwrap().as_slice()).unwrap();
    let meta = fs::metadata(root.join("f")).unwrap();
    assert_eq!((meta.uid(), meta.gid()), (NOBODY, 7));
}
