//! Lifecycle beyond create/destroy: pause and resume (SIGSTOP/SIGCONT of
//! every process of the jail), filesystem snapshots (ZFS), rollback, and
//! snapshot export/import (`zfs send`/`zfs recv` streams).
//!
//! A copse snapshot is a dataset `<root>/snapshots/<id>` with one ZFS
//! snapshot `@snapshot`, received as a clone of the sandbox's own origin
//! (the template's `@base`, or the snapshot it was created from) so it
//! holds only what the sandbox wrote. It is copied out of the sandbox's
//! own dataset (`zfs send -i`) rather than kept there so that it outlives
//! the sandbox, and the sandbox's quota never pays for it. Sandboxes
//! created from it are `zfs clone`s of `@snapshot`. Each snapshot dataset
//! carries `copse:snapshot=<id>`; nothing without that mark is listed or
//! destroyed. A sandbox's later snapshots stack on its earlier ones (see
//! `layers`), which is what a template build's layers are.

use std::fmt;

use super::zfs::{self, Origin, prop, rows};
use super::{
    Cmd, Layout, PROP_DELETED, PROP_SNAPSHOT, PROP_TEMPLATE, PROP_TEMPLATE_GUID, Step, jail_name, layers, sandbox, tool,
};
use copse_substrate::SandboxSpec;

/// The two signals pause and resume send. The executor maps them to the
/// host's signal numbers; plans stay the same on every OS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JailSignal {
    Stop,
    Cont,
}

impl fmt::Display for JailSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            JailSignal::Stop => "STOP",
            JailSignal::Cont => "CONT",
        })
    }
}

fn signal(id: &str, jid: i32, signal: JailSignal) -> Step {
    Step::SignalJail { name: jail_name(id), jid, signal }
}

pub fn pause(id: &str, jid: i32) -> Vec<Step> {
    vec![signal(id, jid, JailSignal::Stop)]
}

pub fn resume(id: &str, jid: i32) -> Vec<Step> {
    vec![signal(id, jid, JailSignal::Cont)]
}

/// Every process of jail `jid` with its state letters (ps(1) `state`).
pub fn processes(jid: i32) -> Cmd {
    Cmd::new(tool::PS, ["-a", "-x", "-J", &jid.to_string(), "-o", "pid=", "-o", "state="])
}

/// Whether the `ps` listing shows a paused sandbox: at least one live
/// process, and every live one stopped (`T`). Zombies count as neither.
pub fn is_paused(ps_output: &str) -> bool {
    let states: Vec<&str> =
        ps_output.lines().filter_map(|l| l.split_whitespace().nth(1)).filter(|s| !s.starts_with('Z')).collect();
    !states.is_empty() && states.iter().all(|s| s.starts_with('T'))
}

/// The short-lived ZFS snapshot of the sandbox's own dataset that a copse
/// snapshot is copied from; named after the copse snapshot so two
/// snapshots of one sandbox never collide.
pub fn transient_snapshot(layout: &Layout, id: &str, snapshot_id: &str) -> String {
    format!("{}@copse-{snapshot_id}", layout.sandbox_dataset(id))
}

/// What `snapshot` needs to know about the sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotSource {
    pub id: String,
    pub jid: i32,
    /// The ZFS snapshot the sandbox's dataset is a clone of (its `origin`).
    pub origin: String,
    /// The copse snapshot of this sandbox to stack on (its bookmark is in
    /// the sandbox's dataset; see [`layers::stack_parent`]); `None`: the
    /// new snapshot is sent from `origin`.
    pub parent: Option<String>,
    pub template: String,
    pub template_guid: u64,
    /// Already paused: leave it so, and send no SIGCONT afterwards.
    pub paused: bool,
}

/// The steps of `Substrate::snapshot`: processes stopped only for the
/// instant of `zfs snapshot` (atomic), then the copy runs while the
/// sandbox goes on.
pub fn snapshot(layout: &Layout, source: &SnapshotSource, snapshot_id: &str) -> Vec<Step> {
    let transient = transient_snapshot(layout, &source.id, snapshot_id);
    let dataset = layout.snapshot_dataset(snapshot_id);
    // Sent from the parent's bookmark, the copy is a clone of the parent's
    // `@snapshot` (the snapshot the bookmark was made from, received
    // under the same guid) and holds only what was written since.
    let (from, origin) = match &source.parent {
        Some(parent) => (layers::bookmark(layout, &source.id, parent), layout.snapshot_origin(parent)),
        None => (source.origin.clone(), source.origin.clone()),
    };
    let origin = &origin;
    let mut steps = Vec::new();
    if !source.paused {
        steps.push(signal(&source.id, source.jid, JailSignal::Stop));
    }
    steps.push(Step::Run(Cmd::new(tool::ZFS, ["snapshot", &transient])));
    if !source.paused {
        steps.push(signal(&source.id, source.jid, JailSignal::Cont));
    }
    // `-i` from the sandbox's origin sends only what the sandbox wrote;
    // received as a clone of that origin, the copy shares its blocks
    // again. (The origin is a dependency from then on; `delete` and
    // `collect` respect it.)
    steps.push(Step::Pipe {
        from: Cmd::new(tool::ZFS, ["send", "-c", "-i", &from, &transient]),
        to: Cmd::new(
            tool::ZFS,
            [
                "recv".to_string(),
                "-u".into(),
                "-o".into(),
                format!("origin={origin}"),
                "-o".into(),
                "mountpoint=none".into(),
                "-o".into(),
                "canmount=off".into(),
                "-o".into(),
                "readonly=on".into(),
                "-o".into(),
                format!("{PROP_SNAPSHOT}={snapshot_id}"),
                "-o".into(),
                format!("{PROP_TEMPLATE}={}", source.template),
                "-o".into(),
                format!("{PROP_TEMPLATE_GUID}={}", source.template_guid),
                dataset.clone(),
            ],
        ),
    });
    let received = format!("{dataset}@copse-{snapshot_id}");
    steps.push(Step::Run(Cmd::new(tool::ZFS, ["rename", &received, &layout.snapshot_origin(snapshot_id)])));
    // What the next snapshot is sent from; without it that one is sent
    // from the origin and only holds more.
    let mark = layers::bookmark(layout, &source.id, snapshot_id);
    steps.push(Step::Run(Cmd::new(tool::ZFS, ["bookmark", &transient, &mark]).may_fail()));
    // Already copied; a leftover only costs the sandbox quota until it is
    // destroyed with the sandbox.
    steps.push(Step::Run(Cmd::new(tool::ZFS, ["destroy", &transient]).may_fail()));
    steps
}

/// What to run when `snapshot` failed part-way: every step is safe to run
/// whether or not the step it undoes happened.
pub fn snapshot_undo(layout: &Layout, source: &SnapshotSource, snapshot_id: &str) -> Vec<Step> {
    let mut steps = Vec::new();
    if !source.paused {
        steps.push(signal(&source.id, source.jid, JailSignal::Cont));
    }
    steps.push(Step::Run(
        Cmd::new(tool::ZFS, ["destroy", &transient_snapshot(layout, &source.id, snapshot_id)]).may_fail(),
    ));
    steps.push(Step::Run(
        Cmd::new(tool::ZFS, ["destroy", &layers::bookmark(layout, &source.id, snapshot_id)]).may_fail(),
    ));
    steps.push(Step::Run(zfs::destroy(&layout.snapshot_dataset(snapshot_id)).may_fail()));
    steps
}

/// A dataset under `<root>/snapshots` as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredSnapshot {
    pub dataset: String,
    /// `copse:snapshot`; `None` for a dataset copse did not tag.
    pub id: Option<String>,
    pub template: Option<String>,
    pub template_guid: Option<u64>,
    pub deleted: bool,
    /// Bytes it holds beyond its template (ZFS `used`).
    pub used: u64,
    pub createtxg: u64,
}

impl StoredSnapshot {
    /// The snapshot as the trait reports it, if it is a live, whole one.
    pub fn info(&self) -> Option<copse_substrate::SnapshotInfo> {
        if self.deleted {
            return None;
        }
        Some(copse_substrate::SnapshotInfo {
            id: self.id.clone()?,
            template: self.template.clone()?,
            size_bytes: self.used,
            memory: false,
        })
    }
}

pub fn list_snapshots(layout: &Layout) -> Cmd {
    let columns = format!("name,{PROP_SNAPSHOT},{PROP_TEMPLATE},{PROP_TEMPLATE_GUID},{PROP_DELETED},used,createtxg");
    Cmd::new(tool::ZFS, ["list", "-H", "-p", "-t", "filesystem", "-o", &columns, "-r", &layout.snapshots_dataset()])
}

/// Parses [`list_snapshots`]' output; the parent dataset itself is skipped.
pub fn parse_snapshots(layout: &Layout, text: &str) -> Result<Vec<StoredSnapshot>, String> {
    let parent = format!("{}/", layout.snapshots_dataset());
    let mut out = Vec::new();
    for (line, [name, id, template, guid, deleted, used, txg]) in rows(text)? {
        if !name.starts_with(&parent) {
            continue;
        }
        let num = |s: &str, what: &str| s.parse::<u64>().map_err(|_| format!("bad {what} in {line:?}"));
        out.push(StoredSnapshot {
            dataset: name.to_string(),
            id: prop(id).map(String::from),
            template: prop(template).map(String::from),
            template_guid: prop(guid).map(|g| num(g, "template guid")).transpose()?,
            deleted: prop(deleted) == Some("on"),
            used: num(used, "used")?,
            createtxg: num(txg, "createtxg")?,
        });
    }
    Ok(out)
}

/// The live snapshot called `snapshot_id`, if any.
pub fn find<'a>(stored: &'a [StoredSnapshot], snapshot_id: &str) -> Option<&'a StoredSnapshot> {
    stored.iter().find(|s| !s.deleted && s.id.as_deref() == Some(snapshot_id))
}

/// The steps of `Substrate::delete_snapshot`. A snapshot sandboxes (or
/// later snapshots) were cloned from cannot be destroyed while they exist,
/// so it is marked deleted and renamed out of the way (ids never contain
/// `.`, so the new name frees the id at once); [`layers::collect`]
/// destroys it later.
pub fn delete(stored: &StoredSnapshot, has_clones: bool) -> Vec<Step> {
    if !has_clones {
        return vec![Step::Run(zfs::destroy(&stored.dataset))];
    }
    vec![
        Step::Run(Cmd::new(tool::ZFS, ["set", &format!("{PROP_DELETED}=on"), &stored.dataset])),
        Step::Run(Cmd::new(
            tool::ZFS,
            ["rename", &stored.dataset, &format!("{}.deleted.{}", stored.dataset, stored.createtxg)],
        )),
    ]
}

/// The steps of `Substrate::rollback`: the sandbox as it is goes entirely
/// (a ZFS rollback cannot reach a snapshot kept outside its dataset, and
/// the processes must restart anyway), then it is created again under the
/// same id as a clone of the snapshot.
pub fn rollback(layout: &Layout, spec: &SandboxSpec, traces: &sandbox::Traces, origin: &Origin) -> Vec<Step> {
    let mut steps = sandbox::destroy(&spec.id, traces);
    steps.extend(sandbox::create(layout, spec, origin));
    steps
}

/// `Substrate::export_snapshot`: a full (not incremental) replication of
/// `@snapshot`, so the receiving host needs no copy of the template; `-p`
/// carries the `copse:` properties (template name and guid) along.
pub fn send_stream(layout: &Layout, snapshot_id: &str) -> Cmd {
    Cmd::new(tool::ZFS, ["send", "-p", "-c", &layout.snapshot_origin(snapshot_id)])
}

/// `Substrate::import_snapshot`: receive a [`send_stream`] under a new id.
/// `-o` wins over the stream's own properties; a `copse:deleted` mark is
/// never imported.
pub fn receive_stream(layout: &Layout, snapshot_id: &str) -> Cmd {
    Cmd::new(
        tool::ZFS,
        [
            "recv".to_string(),
            "-u".into(),
            "-o".into(),
            "mountpoint=none".into(),
            "-o".into(),
            "canmount=off".into(),
            "-o".into(),
            "readonly=on".into(),
            "-o".into(),
            format!("{PROP_SNAPSHOT}={snapshot_id}"),
            "-x".into(),
            PROP_DELETED.into(),
            layout.snapshot_dataset(snapshot_id),
        ],
    )
}

/// After a failed import: nothing half-received may stay.
pub fn import_undo(layout: &Layout, snapshot_id: &str) -> Vec<Step> {
    vec![Step::Run(zfs::destroy(&layout.snapshot_dataset(snapshot_id)).may_fail())]
}

#[cfg(test)]
mod tests {
    use super::super::render;
    use super::super::testing::*;
    use super::*;
    use copse_substrate::Limits;

    fn source(paused: bool) -> SnapshotSource {
        SnapshotSource {
            id: "i3k2m9x".into(),
            jid: 12,
            origin: "zroot/copse/templates/base@base".into(),
            parent: None,
            template: "base".into(),
            template_guid: 77,
            paused,
        }
    }

    #[test]
    fn pause_and_resume_signal_the_whole_jail() {
        assert_golden(&render(&pause("i3k2m9x", 12)), "signal STOP every process in jail 12 (copse-i3k2m9x)\n");
        assert_golden(&render(&resume("i3k2m9x", 12)), "signal CONT every process in jail 12 (copse-i3k2m9x)\n");
        assert_eq!(processes(12).to_string(), "/bin/ps -a -x -J 12 -o pid= -o state=");
    }

    #[test]
    fn paused_means_every_live_process_stopped() {
        assert!(is_paused("  101 TJs\n  140 T\n  141 Z\n"));
        assert!(!is_paused("  101 TJs\n  140 S\n"));
        assert!(!is_paused("  141 Z\n"));
        assert!(!is_paused(""));
    }

    #[test]
    fn snapshot_of_a_running_sandbox_golden() {
        assert_golden(
            &render(&snapshot(&layout(), &source(false), "snap1")),
            "
signal STOP every process in jail 12 (copse-i3k2m9x)
run /sbin/zfs snapshot zroot/copse/sandboxes/i3k2m9x@copse-snap1
signal CONT every process in jail 12 (copse-i3k2m9x)
run /sbin/zfs send -c -i zroot/copse/templates/base@base zroot/copse/sandboxes/i3k2m9x@copse-snap1 | /sbin/zfs recv -u -o origin=zroot/copse/templates/base@base -o mountpoint=none -o canmount=off -o readonly=on -o copse:snapshot=snap1 -o copse:template=base -o copse:template_guid=77 zroot/copse/snapshots/snap1
run /sbin/zfs rename zroot/copse/snapshots/snap1@copse-snap1 zroot/copse/snapshots/snap1@snapshot
run /sbin/zfs bookmark zroot/copse/sandboxes/i3k2m9x@copse-snap1 'zroot/copse/sandboxes/i3k2m9x#copse-snap1'
run /sbin/zfs destroy zroot/copse/sandboxes/i3k2m9x@copse-snap1
",
        );
    }

    #[test]
    fn snapshot_of_a_sandbox_made_from_a_snapshot_builds_on_that_one() {
        let source = SnapshotSource { origin: layout().snapshot_origin("snap0"), ..source(true) };
        let plan = render(&snapshot(&layout(), &source, "snap1"));
        let copy = plan.lines().nth(1).unwrap();
        assert_eq!(
            copy,
            "run /sbin/zfs send -c -i zroot/copse/snapshots/snap0@snapshot zroot/copse/sandboxes/i3k2m9x@copse-snap1 \
             | /sbin/zfs recv -u -o origin=zroot/copse/snapshots/snap0@snapshot -o mountpoint=none -o canmount=off \
             -o readonly=on -o copse:snapshot=snap1 -o copse:template=base -o copse:template_guid=77 \
             zroot/copse/snapshots/snap1"
        );
    }

    #[test]
    fn snapshot_of_a_paused_sandbox_leaves_it_paused() {
        let plan = render(&snapshot(&layout(), &source(true), "snap1"));
        assert!(!plan.contains("signal"), "{plan}");
        assert!(plan.starts_with("run /sbin/zfs snapshot zroot/copse/sandboxes/i3k2m9x@copse-snap1\n"));
    }

    #[test]
    fn failed_snapshot_undo_golden() {
        assert_golden(
            &render(&snapshot_undo(&layout(), &source(false), "snap1")),
            "
signal CONT every process in jail 12 (copse-i3k2m9x)
run /sbin/zfs destroy zroot/copse/sandboxes/i3k2m9x@copse-snap1
run /sbin/zfs destroy 'zroot/copse/sandboxes/i3k2m9x#copse-snap1'
run /sbin/zfs destroy -r -f zroot/copse/snapshots/snap1
",
        );
        for step in snapshot_undo(&layout(), &source(true), "snap1") {
            match step {
                Step::Run(cmd) => assert!(cmd.may_fail, "{cmd}"),
                other => panic!("unexpected {other}"),
            }
        }
    }

    #[test]
    fn snapshot_listing_is_parsed() {
        let l = layout();
        assert_eq!(
            list_snapshots(&l).to_string(),
            "/sbin/zfs list -H -p -t filesystem -o \
             name,copse:snapshot,copse:template,copse:template_guid,copse:deleted,used,createtxg -r zroot/copse/snapshots"
        );
        let text = "zroot/copse/snapshots\t-\t-\t-\t-\t98304\t40\n\
                    zroot/copse/snapshots/snap1\tsnap1\tbase\t77\t-\t1048576\t500\n\
                    zroot/copse/snapshots/old.deleted.300\told\tbase\t77\ton\t4096\t300\n\
                    zroot/copse/snapshots/handmade\t-\t-\t-\t-\t1\t2\n";
        let stored = parse_snapshots(&l, text).unwrap();
        assert_eq!(stored.len(), 3);
        assert_eq!(
            stored[0],
            StoredSnapshot {
                dataset: "zroot/copse/snapshots/snap1".into(),
                id: Some("snap1".into()),
                template: Some("base".into()),
                template_guid: Some(77),
                deleted: false,
                used: 1048576,
                createtxg: 500,
            }
        );
        let infos: Vec<_> = stored.iter().filter_map(StoredSnapshot::info).collect();
        assert_eq!(
            infos,
            [copse_substrate::SnapshotInfo {
                id: "snap1".into(),
                template: "base".into(),
                size_bytes: 1048576,
                memory: false
            }]
        );
        assert!(find(&stored, "old").is_none());
        assert!(find(&stored, "snap1").is_some());
        assert!(parse_snapshots(&l, "zroot/copse/snapshots/x\tx\n").is_err());
    }

    fn stored(id: &str, deleted: bool) -> StoredSnapshot {
        StoredSnapshot {
            dataset: format!("zroot/copse/snapshots/{id}"),
            id: Some(id.into()),
            template: Some("base".into()),
            template_guid: Some(77),
            deleted,
            used: 1,
            createtxg: 500,
        }
    }

    #[test]
    fn delete_destroys_or_defers_golden() {
        assert_golden(
            &render(&delete(&stored("s1", false), false)),
            "run /sbin/zfs destroy -r -f zroot/copse/snapshots/s1\n",
        );
        assert_golden(
            &render(&delete(&stored("s1", false), true)),
            "
run /sbin/zfs set copse:deleted=on zroot/copse/snapshots/s1
run /sbin/zfs rename zroot/copse/snapshots/s1 zroot/copse/snapshots/s1.deleted.500
",
        );
    }

    #[test]
    fn rollback_recreates_the_sandbox_from_the_snapshot_golden() {
        let spec = SandboxSpec {
            id: "i3k2m9x".into(),
            template: "base".into(),
            limits: Limits { cpu_count: 1, memory_mb: 1024, disk_mb: 2048, pids: 128 },
            agent_socket: "/var/run/copse/i3k2m9x.sock".into(),
            snapshot: None,
            network: None,
            volumes: Vec::new(),
        };
        let traces = sandbox::Traces {
            jid: Some(12),
            rctl_rules: true,
            mounts: vec!["/var/db/copse/sandboxes/i3k2m9x/dev".into()],
            dataset: Some("zroot/copse/sandboxes/i3k2m9x".into()),
            agent_socket: Some("/var/run/copse/i3k2m9x.sock".into()),
        };
        let plan = render(&rollback(&layout(), &spec, &traces, &Origin::snapshot(&layout(), "snap1", 77)));
        let head: String = plan.lines().take(6).map(|l| format!("{l}\n")).collect();
        assert_golden(
            &head,
            "
jail_remove 12 (copse-i3k2m9x)
run /usr/bin/rctl -r jail:copse-i3k2m9x
run /sbin/umount -f /var/db/copse/sandboxes/i3k2m9x/dev
run /sbin/zfs destroy -r -f zroot/copse/sandboxes/i3k2m9x
remove /var/run/copse/i3k2m9x.sock
run /sbin/zfs clone -o mountpoint=/var/db/copse/sandboxes/i3k2m9x -o quota=2048M -o readonly=off -o compression=lz4 -o atime=off -o setuid=off -o copse:sandbox=i3k2m9x -o copse:template=base -o copse:template_guid=77 -o copse:agent_socket=/var/run/copse/i3k2m9x.sock -o copse:from_snapshot=snap1 zroot/copse/snapshots/snap1@snapshot zroot/copse/sandboxes/i3k2m9x
",
        );
        assert!(plan.ends_with("/.copse/copse-agent boot\n"), "{plan}");
    }

    #[test]
    fn export_and_import_streams_golden() {
        assert_eq!(
            send_stream(&layout(), "snap1").to_string(),
            "/sbin/zfs send -p -c zroot/copse/snapshots/snap1@snapshot"
        );
        assert_eq!(
            receive_stream(&layout(), "moved").to_string(),
            "/sbin/zfs recv -u -o mountpoint=none -o canmount=off -o readonly=on -o copse:snapshot=moved \
             -x copse:deleted zroot/copse/snapshots/moved"
        );
        assert_golden(
            &render(&import_undo(&layout(), "moved")),
            "run /sbin/zfs destroy -r -f zroot/copse/snapshots/moved\n",
        );
    }
}
