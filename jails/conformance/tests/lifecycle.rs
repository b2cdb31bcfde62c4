//! Lifecycle every substrate offers beyond create/destroy: pause and
//! resume, filesystem snapshots, sandboxes from snapshots, rollback,
//! export and import.

use std::time::Duration;

use copse_conformance::{Sandbox, Snapshot, fresh_id, serial, substrate};
use copse_substrate::Limits;

const SMALL: Limits = Limits { cpu_count: 1, memory_mb: 256, disk_mb: 1024, pids: 64 };
const TICKER: &str = "nohup sh -c 'while :; do echo t >> /home/user/ticks; sleep 0.05; done' >/dev/null 2>&1 &";

fn ticks(sandbox: &Sandbox) -> usize {
    sandbox.agent().sh("cat /home/user/ticks").unwrap().stdout.lines().count()
}

#[test]
#[ignore = "needs root, COPSE_AGENT and a template: run `mise run conformance`"]
fn pause_holds_every_process_and_resume_lets_them_go_on() {
    let _serial = serial();
    let sandbox = Sandbox::create("pause", SMALL).unwrap();
    sandbox.agent().sh(TICKER).unwrap();
    std::thread::sleep(Duration::from_millis(300));

    let before = ticks(&sandbox);
    substrate().pause(sandbox.id()).unwrap();
    substrate().pause(sandbox.id()).unwrap();
    // The agent is held too: it cannot answer.
    let silent = sandbox.agent().sh_within("true", Duration::from_millis(500)).unwrap();
    assert!(silent.is_none(), "a paused sandbox's agent answered: {silent:?}");
    std::thread::sleep(Duration::from_secs(1));
    substrate().resume(sandbox.id()).unwrap();
    substrate().resume(sandbox.id()).unwrap();
    let after = ticks(&sandbox);
    // A second and a half of running would have written about 30 ticks.
    assert!(after < before + 8, "ticker ran while paused: {before} then {after}");
    std::thread::sleep(Duration::from_millis(500));
    assert!(ticks(&sandbox) > after + 2, "ticker did not go on after resume");
    assert!(substrate().is_alive(sandbox.id(), &sandbox.placement));
}

#[test]
#[ignore = "needs root, COPSE_AGENT and a template: run `mise run conformance`"]
fn a_snapshot_keeps_files_for_new_sandboxes_and_outlives_deletion_of_its_users() {
    let _serial = serial();
    let origin = Sandbox::create("snap-origin", SMALL).unwrap();
    origin.agent().write_file("/home/user/kept.txt", b"before\n").unwrap();
    let snapshot = Snapshot(fresh_id("snap"));
    let info = substrate().snapshot(origin.id(), &snapshot.0, false).unwrap();
    assert_eq!((info.id.as_str(), info.template.as_str()), (snapshot.0.as_str(), "base"));
    assert!(substrate().snapshots().unwrap().contains(&info));

    // The origin runs on, unpaused, and its later writes are its own.
    let out = origin.agent().sh_within("echo after > /home/user/later.txt && echo ok", Duration::from_secs(10));
    assert_eq!(out.unwrap().map(|o| o.stdout), Some("ok\n".into()));

    let copy = Sandbox::from_snapshot("snap-copy", SMALL, &snapshot.0).unwrap();
    assert_eq!(copy.agent().read_file("/home/user/kept.txt").unwrap(), b"before\n");
    let out = copy.agent().sh("test -e /home/user/later.txt && echo leaked || echo absent").unwrap();
    assert_eq!(out.stdout, "absent\n");

    // Deleting the snapshot forgets it; the sandbox made from it goes on.
    substrate().delete_snapshot(&snapshot.0).unwrap();
    assert!(!substrate().snapshots().unwrap().iter().any(|s| s.id == snapshot.0));
    assert_eq!(copy.agent().read_file("/home/user/kept.txt").unwrap(), b"before\n");
    substrate().delete_snapshot(&snapshot.0).unwrap();
    assert!(Sandbox::from_snapshot("snap-gone", SMALL, &snapshot.0).is_err());
}

#[test]
#[ignore = "needs root, COPSE_AGENT and a template: run `mise run conformance`"]
fn layered_snapshots_keep_working_whatever_order_their_layers_are_deleted_in() {
    // What a template build does with snapshots: one after each step of a
    // build sandbox, a rebuild's sandbox on a cached layer, and the
    // layers deleted while what stacks on them still lives.
    let _serial = serial();
    let build = Sandbox::create("layers", SMALL).unwrap();
    build.agent().write_file("/home/user/one.txt", b"1\n").unwrap();
    let first = Snapshot(fresh_id("layer1"));
    substrate().snapshot(build.id(), &first.0, false).unwrap();
    build.agent().write_file("/home/user/two.txt", b"2\n").unwrap();
    build.agent().sh("rm /home/user/one.txt").unwrap();
    let second = Snapshot(fresh_id("layer2"));
    substrate().snapshot(build.id(), &second.0, false).unwrap();
    drop(build);

    let rebuild = Sandbox::from_snapshot("layers-re", SMALL, &first.0).unwrap();
    rebuild.agent().write_file("/home/user/other.txt", b"o\n").unwrap();
    let other = Snapshot(fresh_id("layer2b"));
    substrate().snapshot(rebuild.id(), &other.0, false).unwrap();
    drop(rebuild);

    // The first layer goes first, then the second while a sandbox of it runs.
    substrate().delete_snapshot(&first.0).unwrap();
    let user = Sandbox::from_snapshot("layers-user", SMALL, &second.0).unwrap();
    substrate().delete_snapshot(&second.0).unwrap();
    let out = user.agent().sh("cat /home/user/two.txt; test -e /home/user/one.txt && echo one || echo no-one").unwrap();
    assert_eq!(out.stdout, "2\nno-one\n", "the second layer lost a write or a removal");
    let sibling = Sandbox::from_snapshot("layers-other", SMALL, &other.0).unwrap();
    let out =
        sibling.agent().sh("cat /home/user/one.txt /home/user/other.txt; test -e /home/user/two.txt || echo no-two");
    assert_eq!(out.unwrap().stdout, "1\no\nno-two\n", "a layer on a deleted one lost files or gained its sibling's");
    drop((user, sibling));
    substrate().delete_snapshot(&other.0).unwrap();
    let left = substrate().snapshots().unwrap();
    for gone in [&first, &second, &other] {
        assert!(!left.iter().any(|s| s.id == gone.0), "deleted snapshot {} still listed", gone.0);
    }
}

#[test]
#[ignore = "needs root, COPSE_AGENT and a template: run `mise run conformance`"]
fn a_snapshot_of_a_paused_sandbox_leaves_it_paused() {
    let _serial = serial();
    let sandbox = Sandbox::create("snap-paused", SMALL).unwrap();
    substrate().pause(sandbox.id()).unwrap();
    let snapshot = Snapshot(fresh_id("snap-paused"));
    substrate().snapshot(sandbox.id(), &snapshot.0, false).unwrap();
    assert!(sandbox.agent().sh_within("true", Duration::from_millis(500)).unwrap().is_none());
    substrate().resume(sandbox.id()).unwrap();
    assert_eq!(sandbox.agent().sh("echo back").unwrap().stdout, "back\n");
}

#[test]
#[ignore = "needs root, COPSE_AGENT and a template: run `mise run conformance`"]
fn rollback_brings_back_the_files_and_restarts_the_sandbox() {
    let _serial = serial();
    let mut sandbox = Sandbox::create("rollback", SMALL).unwrap();
    sandbox.agent().write_file("/home/user/a.txt", b"original\n").unwrap();
    let snapshot = Snapshot(fresh_id("rollback"));
    substrate().snapshot(sandbox.id(), &snapshot.0, false).unwrap();
    sandbox.agent().sh("echo changed > /home/user/a.txt; echo new > /home/user/b.txt; sleep 600 &").unwrap();

    let placement = substrate().rollback(&sandbox.spec, &snapshot.0).unwrap();
    assert_ne!(placement, sandbox.placement, "the sandbox was not started afresh");
    sandbox.placement = placement;
    assert!(substrate().is_alive(sandbox.id(), &sandbox.placement));
    assert_eq!(sandbox.agent().read_file("/home/user/a.txt").unwrap(), b"original\n");
    let out = sandbox.agent().sh("test -e /home/user/b.txt && echo kept || echo gone; pgrep -x sleep || true").unwrap();
    assert_eq!(out.stdout, "gone\n", "files or processes survived the rollback");

    // A snapshot that does not exist leaves the sandbox as it is.
    assert!(substrate().rollback(&sandbox.spec, "conf-no-such-snapshot").is_err());
    assert_eq!(sandbox.agent().read_file("/home/user/a.txt").unwrap(), b"original\n");
}

#[test]
#[ignore = "needs root, COPSE_AGENT and a template: run `mise run conformance`"]
fn an_exported_snapshot_imports_as_a_working_one() {
    let _serial = serial();
    let origin = Sandbox::create("export", SMALL).unwrap();
    origin.agent().write_file("/home/user/moved.txt", b"travelled\n").unwrap();
    let snapshot = Snapshot(fresh_id("export"));
    substrate().snapshot(origin.id(), &snapshot.0, false).unwrap();
    drop(origin);

    let mut stream = Vec::new();
    substrate().export_snapshot(&snapshot.0, &mut stream).unwrap();
    assert!(!stream.is_empty());
    let imported = Snapshot(fresh_id("import"));
    let info = substrate().import_snapshot(&imported.0, &mut stream.as_slice()).unwrap();
    assert_eq!((info.id.as_str(), info.template.as_str()), (imported.0.as_str(), "base"));

    let copy = Sandbox::from_snapshot("imported", SMALL, &imported.0).unwrap();
    assert_eq!(copy.agent().read_file("/home/user/moved.txt").unwrap(), b"travelled\n");
    assert!(substrate().import_snapshot(&fresh_id("garbage"), &mut &b"not a snapshot"[..]).is_err());
}

const COUNTER: &str = "nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > /home/user/count.new; mv /home/user/count.new /home/user/count; sleep 0.05; done' >/dev/null 2>&1 &";

fn count(sandbox: &Sandbox) -> u64 {
    sandbox.agent().sh("cat /home/user/count").unwrap().stdout.trim().parse().unwrap()
}

#[test]
#[ignore = "needs root, COPSE_AGENT and a template: run `mise run conformance`"]
fn a_memory_snapshot_carries_running_processes_into_new_sandboxes() {
    let _serial = serial();
    if !substrate().capabilities().memory_snapshots.is_yes() {
        // A host that should have them (the Linux CI installs CRIU) says so.
        assert!(std::env::var_os("COPSE_EXPECT_MEMORY_SNAPSHOTS").is_none(), "memory snapshots are unavailable");
        eprintln!("skipped: {} keeps no memory snapshots", substrate().name());
        return;
    }
    let mut origin = Sandbox::create("mem-origin", SMALL).unwrap();
    origin.agent().sh(COUNTER).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let snapshot = Snapshot(fresh_id("mem"));
    let info = substrate().snapshot(origin.id(), &snapshot.0, true).unwrap();
    assert!(info.memory);
    assert!(substrate().snapshots().unwrap().contains(&info));
    let at_snapshot = count(&origin);

    // The origin runs on.
    std::thread::sleep(Duration::from_millis(300));
    assert!(count(&origin) > at_snapshot, "the origin stopped counting after the snapshot");

    let copy = Sandbox::from_snapshot("mem-copy", SMALL, &snapshot.0).unwrap();
    let first = count(&copy);
    assert!(first + 3 >= at_snapshot, "the copy counts from {first}, the origin was at {at_snapshot}");
    std::thread::sleep(Duration::from_millis(400));
    let later = count(&copy);
    assert!(later > first, "the copy's counter is not running: {first} then {later}");
    let hostname = copy.agent().sh("hostname").unwrap().stdout;
    assert_eq!(hostname.trim(), copy.id(), "the copy kept the origin's host name");

    // Rolling the origin back to it brings its counter back too.
    origin.placement = substrate().rollback(&origin.spec, &snapshot.0).unwrap();
    assert!(substrate().is_alive(origin.id(), &origin.placement));
    let rolled = count(&origin);
    std::thread::sleep(Duration::from_millis(300));
    assert!(count(&origin) > rolled, "the rolled-back origin's counter is not running");
}
