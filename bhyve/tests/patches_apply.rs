//! The FreeBSD patches in `patches/` are well-formed unified diffs that git
//! accepts, checked on every test run.
//!
//! FreeBSD sources are not in this repository, so each patch is applied to
//! the pre-image its own hunks describe (context and removed lines, with a
//! gap between hunks). That proves the hunk headers, line counts and
//! context agree with each other and with git's parser; whether the context
//! matches a real FreeBSD tree is checked as described in patches/README.md.

use std::path::{Path, PathBuf};
use std::process::Command;

fn patches_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../patches")
}

struct Hunk {
    old_len: usize,
    new_len: usize,
    lines: Vec<String>,
}

/// (path, hunks) per file of a `git diff` patch.
fn parse(patch: &str) -> Vec<(String, Vec<Hunk>)> {
    let mut files: Vec<(String, Vec<Hunk>)> = Vec::new();
    for line in patch.lines() {
        if let Some(rest) = line.strip_prefix("diff --git a/") {
            let path = rest.split(" b/").next().unwrap().to_string();
            files.push((path, Vec::new()));
        } else if let Some(header) = line.strip_prefix("@@ -") {
            let ranges: Vec<&str> = header.split(" @@").next().unwrap().split(" +").collect();
            let len = |r: &str| r.split(',').nth(1).map_or(1, |n| n.parse().unwrap());
            files.last_mut().unwrap().1.push(Hunk {
                old_len: len(ranges[0]),
                new_len: len(ranges[1]),
                lines: Vec::new(),
            });
        } else if let Some(hunk) = files.last_mut().and_then(|f| f.1.last_mut()) {
            if line.starts_with([' ', '-', '+']) && !line.starts_with("---") && !line.starts_with("+++") {
                hunk.lines.push(line.to_string());
            }
        }
    }
    files
}

fn git(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new("git").args(args).current_dir(dir).output().expect("git runs")
}

fn check(name: &str, must_add: &[(&str, &str)]) {
    let patch_path = patches_dir().join(name);
    let patch = std::fs::read_to_string(&patch_path).unwrap();
    let files = parse(&patch);
    assert!(!files.is_empty(), "{name}: no files");

    let dir = tempfile::tempdir().unwrap();
    for (path, hunks) in &files {
        assert!(!hunks.is_empty(), "{name}: {path} has no hunks");
        let mut pre = String::new();
        for (i, hunk) in hunks.iter().enumerate() {
            let old: Vec<&str> = hunk.lines.iter().filter(|l| !l.starts_with('+')).map(|l| &l[1..]).collect();
            let new = hunk.lines.iter().filter(|l| !l.starts_with('-')).count();
            assert_eq!(old.len(), hunk.old_len, "{name}: {path} hunk {i}: old line count");
            assert_eq!(new, hunk.new_len, "{name}: {path} hunk {i}: new line count");
            for l in old {
                pre.push_str(l);
                pre.push('\n');
            }
            pre.push_str(&format!("/* gap after hunk {i} */\n"));
        }
        let file = dir.path().join(path);
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(file, pre).unwrap();
    }
    assert!(git(dir.path(), &["init", "-q"]).status.success());
    let out = git(dir.path(), &["apply", "--check", "-v", patch_path.to_str().unwrap()]);
    assert!(out.status.success(), "{name}: git apply --check: {}", String::from_utf8_lossy(&out.stderr));
    let out = git(dir.path(), &["apply", patch_path.to_str().unwrap()]);
    assert!(out.status.success(), "{name}: git apply: {}", String::from_utf8_lossy(&out.stderr));
    for (path, text) in must_add {
        let after = std::fs::read_to_string(dir.path().join(path)).unwrap();
        assert!(after.contains(text), "{name}: {path} lacks {text:?} after applying");
    }
}

#[test]
fn kernel_and_libvmmapi_patch_applies() {
    check(
        "vmm-memseg-vnode.diff",
        &[
            ("sys/dev/vmm/vmm_dev.h", "#define\tVM_ALLOC_MEMSEG_FILE"),
            ("sys/dev/vmm/vmm_dev.c", "case VM_ALLOC_MEMSEG_FILE:"),
            ("sys/dev/vmm/vmm_mem.c", "vm_object_shadow(&obj, &offset, len, NULL, false);"),
            ("sys/dev/vmm/vmm_mem.c", "VOP_UNSET_TEXT_CHECKED(seg->vp);"),
            ("lib/libvmmapi/vmmapi.c", "VM_ALLOC_MEMSEG_FILE,"),
            ("lib/libvmmapi/vmmapi.h", "int\tvm_alloc_memseg_file("),
        ],
    );
}

#[test]
fn bhyve_patch_applies() {
    check(
        "bhyve-vnode-restore.diff",
        &[
            ("usr.sbin/bhyve/bhyverun.c", "\"snapshot.vnode_restore\""),
            ("usr.sbin/bhyve/bhyverun.c", "vnode_restore_memory(ctx, &rstate, memsize, memflags);"),
        ],
    );
}
