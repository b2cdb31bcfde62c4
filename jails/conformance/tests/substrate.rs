//! What every substrate must do, checked on the real host: create, exec
//! through the agent, files, limits, complete teardown, crash recovery.
//!
//! Ignored by a plain `cargo test` (they need root, a built agent and a
//! template); `mise run conformance` runs them, and `./dev test` does too.

use copse_conformance::{Sandbox, serial, substrate};
use copse_substrate::Limits;

const SMALL: Limits = Limits { cpu_count: 1, memory_mb: 256, disk_mb: 1024, pids: 64 };

#[test]
#[ignore = "needs root, COPSE_AGENT and a template: run `mise run conformance`"]
fn a_sandbox_runs_commands_and_keeps_files_until_destroyed() {
    let _serial = serial();
    let sandbox = Sandbox::create("files", SMALL).unwrap();
    let agent = sandbox.agent();
    assert!(substrate().is_alive(sandbox.id(), &sandbox.placement));

    let out = agent.sh("echo hello from $(id -un); echo oops >&2; exit 3").unwrap();
    assert_eq!((out.stdout.as_str(), out.stderr.as_str(), out.exit_code), ("hello from user\n", "oops\n", 3));

    agent.write_file("/home/user/notes/a.txt", b"written through the agent\n").unwrap();
    assert_eq!(agent.read_file("/home/user/notes/a.txt").unwrap(), b"written through the agent\n");
    let out = agent.sh("cat /home/user/notes/a.txt && ls -ld /home/user/notes | cut -d' ' -f3").unwrap();
    assert_eq!(out.stdout, "written through the agent\nuser\n");

    // Nothing of the host is visible: the sandbox has its own root.
    let host_dir = copse_conformance::state_dir();
    let out = agent.sh(&format!("test -e {} && echo host-visible || echo private", host_dir.display())).unwrap();
    assert_eq!(out.stdout, "private\n");
}

#[test]
#[ignore = "needs root, COPSE_AGENT and a template: run `mise run conformance`"]
fn memory_limit_stops_a_process_that_exceeds_it() {
    let _serial = serial();
    let sandbox = Sandbox::create("memory", Limits { memory_mb: 128, ..SMALL }).unwrap();
    // dd fills a buffer of `bs` bytes, so the whole of it is touched.
    let out = sandbox.agent().sh("dd if=/dev/zero of=/dev/null bs=536870912 count=1 2>/dev/null && echo done").unwrap();
    assert_ne!(out.exit_code, 0, "{out:?}");
    assert!(!out.stdout.contains("done"), "{out:?}");
    // The sandbox itself survives its process being stopped.
    assert_eq!(sandbox.agent().sh("echo alive").unwrap().stdout, "alive\n");
}

#[test]
#[ignore = "needs root, COPSE_AGENT and a template: run `mise run conformance`"]
fn process_limit_refuses_forks_beyond_it() {
    let _serial = serial();
    let sandbox = Sandbox::create("pids", Limits { pids: 32, ..SMALL }).unwrap();
    let out = sandbox.agent().sh("i=0; while [ $i -lt 100 ]; do sleep 60 & i=$((i+1)); echo $i; done").unwrap();
    let started: u32 = out.stdout.lines().last().and_then(|l| l.parse().ok()).unwrap_or(0);
    assert!(started < 32, "{started} processes started under a limit of 32: {out:?}");
    assert_ne!(out.exit_code, 0, "{out:?}");
}

#[test]
#[ignore = "needs root, COPSE_AGENT and a template: run `mise run conformance`"]
fn destroy_removes_everything_and_is_idempotent() {
    let _serial = serial();
    let sandbox = Sandbox::create("teardown", SMALL).unwrap();
    let agent = sandbox.agent();
    agent.sh("sleep 600 >/dev/null 2>&1 &").unwrap();
    let (id, placement, socket) = (sandbox.id().to_string(), sandbox.placement.clone(), agent.socket.clone());

    substrate().destroy(&id).unwrap();
    assert!(!substrate().is_alive(&id, &placement));
    assert!(!socket.exists(), "agent socket {} left behind", socket.display());
    assert!(agent.sh("true").is_err());
    // A second destroy, and recovery, find nothing left of it.
    substrate().destroy(&id).unwrap();
    let recovery = substrate().recover(&[]).unwrap();
    assert!(!recovery.removed.contains(&id), "recover found remains of {id}: {recovery:?}");
    drop(sandbox);
}

#[test]
#[ignore = "needs root, COPSE_AGENT and a template: run `mise run conformance`"]
fn recover_keeps_known_sandboxes_and_removes_orphans() {
    let _serial = serial();
    let known = Sandbox::create("known", SMALL).unwrap();
    let orphan = Sandbox::create("orphan", SMALL).unwrap();

    let recovery = substrate().recover(&[(known.id().to_string(), known.placement.clone())]).unwrap();
    assert_eq!(recovery.adopted, [known.id()]);
    assert!(recovery.removed.iter().any(|id| id == orphan.id()), "{recovery:?}");

    assert!(!substrate().is_alive(orphan.id(), &orphan.placement));
    assert!(!orphan.agent().socket.exists());
    assert!(substrate().is_alive(known.id(), &known.placement));
    assert_eq!(known.agent().sh("echo still here").unwrap().stdout, "still here\n");

    // A placement that no longer matches (a recycled id) is not adopted.
    let mut stale = known.placement.clone();
    stale.init_start += 1;
    let recovery = substrate().recover(&[(known.id().to_string(), stale)]).unwrap();
    assert!(recovery.adopted.is_empty());
    assert!(!substrate().is_alive(known.id(), &known.placement));
}
