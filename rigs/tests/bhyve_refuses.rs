//! Off FreeBSD the bhyve rigs refuse with a clear message and write nothing.

use std::process::Command;

#[cfg(not(target_os = "freebsd"))]
#[test]
fn rig_refuses_on_this_host_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_copse-rig-bhyve"))
        .arg("bhyve-fanout-rss")
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("refusing to run") && stderr.contains("FreeBSD 15"), "{stderr}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn rig_rejects_unknown_names() {
    let out = Command::new(env!("CARGO_BIN_EXE_copse-rig-bhyve")).arg("nope").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}
