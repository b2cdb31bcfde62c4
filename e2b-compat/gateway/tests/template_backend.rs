//! `copse template build --backend bhyve` off FreeBSD: refused before
//! anything is built, with a message that says what it needs.

use std::process::Command;

#[test]
fn bhyve_templates_are_refused_off_freebsd() {
    if cfg!(target_os = "freebsd") {
        return;
    }
    let data = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_copse"))
        .args(["template", "build", "--backend", "bhyve", "base", "--agent", "/bin/true", "--data-dir"])
        .arg(data.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("bhyve backend needs a FreeBSD host"), "{stderr}");
    assert!(!data.path().join("templates/base").exists(), "nothing was built");

    let bad = Command::new(env!("CARGO_BIN_EXE_copse"))
        .args(["template", "build", "--backend", "kvm", "base"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("use jail or bhyve"));
}
