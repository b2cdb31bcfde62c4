//! Snapshots stacked on snapshots: what a template build's layers are in
//! ZFS, and how their chains are torn down.
//!
//! The gateway builds a template with the trait calls every substrate has
//! (`service/builds`): `create` of a build sandbox (from the base template,
//! or with `SandboxSpec::snapshot` set to the deepest cached layer),
//! `snapshot(build sandbox, layer, memory=false)` after each step and once
//! more for the finished image, `create` with `SandboxSpec::snapshot` =
//! the image for every sandbox of the built template, and
//! `delete_snapshot` for each layer and image when the template goes. So on
//! FreeBSD a built template *is* a copse snapshot — the dataset
//! `<root>/snapshots/<key>` and its `@snapshot` — and nothing is promoted
//! into `<root>/templates`: `zfs promote` of a clone of `templates/base`
//! would move `base@base` (and the dependency) into the built template,
//! turning the shipped template into a clone of a user's build and breaking
//! both the `<name>@base` listing and the rule that a template outlives
//! what is made from it.
//!
//! What this module adds to `lifecycle`'s snapshots:
//! - **Stacking.** Each snapshot leaves a bookmark `<sandbox>#copse-<s>`
//!   in the sandbox's dataset. The next snapshot of that sandbox is sent
//!   incrementally from the bookmark and received as a clone of
//!   `<root>/snapshots/<s>@snapshot` (same guid: a received snapshot keeps
//!   the sent one's), so layer n+1 holds only what step n+1 wrote and
//!   depends on layer n, which depends on the base template's `@base`.
//!   Without the bookmark every layer would hold everything written since
//!   the base, and a build's n layers would cost O(n²) blocks.
//! - **Chains torn down leaves first.** A layer with clones (a later layer
//!   or a running sandbox) is never `zfs destroy`ed — ZFS would refuse, and
//!   `-R` would take the dependents along; `delete` marks it deleted and
//!   [`collect`] later destroys every deleted snapshot whose clones are all
//!   being destroyed too, each after the clones that depend on it.

use super::lifecycle::StoredSnapshot;
use super::zfs::{self, prop, rows};
use super::{Cmd, Layout, SNAPSHOT_SNAPSHOT, Step, tool};

/// The mark a copse snapshot `snapshot_id` leaves in sandbox `id`'s
/// dataset: what the sandbox's next snapshot is sent from.
pub fn bookmark(layout: &Layout, id: &str, snapshot_id: &str) -> String {
    format!("{}#copse-{snapshot_id}", layout.sandbox_dataset(id))
}

/// The bookmarks of one sandbox's dataset (it has no children).
pub fn list_bookmarks(layout: &Layout, id: &str) -> Cmd {
    Cmd::new(
        tool::ZFS,
        ["list", "-H", "-p", "-t", "bookmark", "-o", "name,guid,createtxg", "-d", "1", &layout.sandbox_dataset(id)],
    )
}

/// A bookmark copse left in a sandbox's dataset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bookmark {
    pub snapshot_id: String,
    pub guid: u64,
    pub createtxg: u64,
}

/// Parses [`list_bookmarks`]' output; bookmarks not named `copse-<id>`, or
/// of another dataset, are not copse's and are skipped.
pub fn parse_bookmarks(layout: &Layout, id: &str, text: &str) -> Result<Vec<Bookmark>, String> {
    let prefix = format!("{}#copse-", layout.sandbox_dataset(id));
    let mut out = Vec::new();
    for (line, [name, guid, txg]) in rows(text)? {
        let Some(snapshot_id) = name.strip_prefix(&prefix) else {
            continue;
        };
        let num = |s: &str, what: &str| s.parse::<u64>().map_err(|_| format!("bad {what} in {line:?}"));
        out.push(Bookmark {
            snapshot_id: snapshot_id.to_string(),
            guid: num(guid, "guid")?,
            createtxg: num(txg, "createtxg")?,
        });
    }
    Ok(out)
}

/// Every `@snapshot` under `<root>/snapshots` with its guid and clones:
/// what a new snapshot may stack on and what depends on what.
pub fn list_uses(layout: &Layout) -> Cmd {
    Cmd::new(
        tool::ZFS,
        ["list", "-H", "-p", "-t", "snapshot", "-o", "name,guid,clones", "-r", &layout.snapshots_dataset()],
    )
}

/// One snapshot dataset's `@snapshot` as [`list_uses`] shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Use {
    /// The dataset (`<root>/snapshots/<s>`), not its `@snapshot`.
    pub dataset: String,
    pub guid: u64,
    /// Datasets that are clones of it: sandboxes and stacked snapshots.
    pub clones: Vec<String>,
}

/// Parses [`list_uses`]' output, keeping only `@snapshot`s (a transient
/// `@copse-<s>` left by a failed receive is nobody's origin).
pub fn parse_uses(text: &str) -> Result<Vec<Use>, String> {
    let suffix = format!("@{SNAPSHOT_SNAPSHOT}");
    let mut out = Vec::new();
    for (line, [name, guid, clones]) in rows(text)? {
        let Some(dataset) = name.strip_suffix(&suffix) else {
            continue;
        };
        out.push(Use {
            dataset: dataset.to_string(),
            guid: guid.parse().map_err(|_| format!("bad guid in {line:?}"))?,
            clones: prop(clones.trim())
                .map(|c| c.split(',').filter(|c| !c.is_empty()).map(String::from).collect())
                .unwrap_or_default(),
        });
    }
    Ok(out)
}

/// Datasets whose `@snapshot` has at least one clone.
pub fn cloned(uses: &[Use]) -> Vec<String> {
    uses.iter().filter(|u| !u.clones.is_empty()).map(|u| u.dataset.clone()).collect()
}

/// The copse snapshot a new snapshot of the sandbox stacks on: the newest
/// of its bookmarks whose snapshot is live and still the very one the
/// bookmark marks (same guid: an id reused by an import is another
/// snapshot). `None`: send from the sandbox's origin, as a first snapshot.
pub fn stack_parent(bookmarks: &[Bookmark], stored: &[StoredSnapshot], uses: &[Use]) -> Option<String> {
    bookmarks
        .iter()
        .filter(|b| {
            super::lifecycle::find(stored, &b.snapshot_id)
                .and_then(|s| uses.iter().find(|u| u.dataset == s.dataset))
                .is_some_and(|u| u.guid == b.guid)
        })
        .max_by_key(|b| b.createtxg)
        .map(|b| b.snapshot_id.clone())
}

/// Destroys the deleted snapshots nothing outside the destroyed set is
/// cloned from any more, each after every clone that depends on it (a
/// layer's later layers first). Live and untagged datasets are never
/// touched, and neither is anything a live one or a sandbox stacks on.
pub fn collect(stored: &[StoredSnapshot], uses: &[Use]) -> Vec<Step> {
    let candidates: Vec<&StoredSnapshot> = stored.iter().filter(|s| s.deleted && s.id.is_some()).collect();
    let clones_of = |dataset: &str| uses.iter().find(|u| u.dataset == dataset).map_or(&[][..], |u| &u.clones[..]);
    let mut order: Vec<&str> = Vec::new();
    loop {
        let next = candidates.iter().find(|s| {
            !order.contains(&s.dataset.as_str()) && clones_of(&s.dataset).iter().all(|c| order.contains(&c.as_str()))
        });
        match next {
            Some(s) => order.push(&s.dataset),
            None => break,
        }
    }
    order.into_iter().map(|d| Step::Run(zfs::destroy(d).may_fail())).collect()
}

#[cfg(test)]
mod tests {
    use super::super::lifecycle::{self, SnapshotSource};
    use super::super::render;
    use super::super::sandbox;
    use super::super::testing::*;
    use super::super::zfs::Origin;
    use super::*;
    use copse_substrate::{Limits, SandboxSpec};

    #[test]
    fn bookmark_listing_golden_and_parsed() {
        let l = layout();
        assert_eq!(bookmark(&l, "b1", "snap-a"), "zroot/copse/sandboxes/b1#copse-snap-a");
        assert_eq!(
            list_bookmarks(&l, "b1").to_string(),
            "/sbin/zfs list -H -p -t bookmark -o name,guid,createtxg -d 1 zroot/copse/sandboxes/b1"
        );
        let text = "zroot/copse/sandboxes/b1#copse-snap-a\t11\t600\n\
                    zroot/copse/sandboxes/b1#handmade\t12\t601\n\
                    zroot/copse/sandboxes/b10#copse-snap-z\t13\t602\n";
        assert_eq!(
            parse_bookmarks(&l, "b1", text).unwrap(),
            [Bookmark { snapshot_id: "snap-a".into(), guid: 11, createtxg: 600 }]
        );
        assert!(parse_bookmarks(&l, "b1", "zroot/copse/sandboxes/b1#copse-x 1 2\n").is_err());
    }

    #[test]
    fn uses_listing_golden_and_parsed() {
        assert_eq!(
            list_uses(&layout()).to_string(),
            "/sbin/zfs list -H -p -t snapshot -o name,guid,clones -r zroot/copse/snapshots"
        );
        let text = "zroot/copse/snapshots/a@snapshot\t1\tzroot/copse/sandboxes/x,zroot/copse/snapshots/b\n\
                    zroot/copse/snapshots/b@snapshot\t2\t\n\
                    zroot/copse/snapshots/c@snapshot\t3\t-\n\
                    zroot/copse/snapshots/d@copse-d\t4\tzroot/copse/sandboxes/z\n";
        let uses = parse_uses(text).unwrap();
        assert_eq!(
            uses[0],
            Use {
                dataset: "zroot/copse/snapshots/a".into(),
                guid: 1,
                clones: vec!["zroot/copse/sandboxes/x".into(), "zroot/copse/snapshots/b".into()],
            }
        );
        assert_eq!(uses.len(), 3);
        assert_eq!(cloned(&uses), ["zroot/copse/snapshots/a"]);
        assert!(parse_uses("zroot/copse/snapshots/a@snapshot\t1\n").is_err());
    }

    fn stored(id: &str, deleted: bool) -> StoredSnapshot {
        let name = if deleted { format!("{id}.deleted.500") } else { id.to_string() };
        StoredSnapshot {
            dataset: format!("zroot/copse/snapshots/{name}"),
            id: Some(id.into()),
            template: Some("base".into()),
            template_guid: Some(77),
            deleted,
            used: 1,
            createtxg: 500,
        }
    }

    fn used(id: &str, guid: u64, clones: &[&str]) -> Use {
        Use {
            dataset: format!("zroot/copse/snapshots/{id}"),
            guid,
            clones: clones.iter().map(|c| c.to_string()).collect(),
        }
    }

    #[test]
    fn a_snapshot_stacks_on_the_newest_live_one_it_bookmarked() {
        let marks = [
            Bookmark { snapshot_id: "l1".into(), guid: 1, createtxg: 600 },
            Bookmark { snapshot_id: "l2".into(), guid: 2, createtxg: 700 },
            Bookmark { snapshot_id: "gone".into(), guid: 9, createtxg: 800 },
        ];
        let live = [stored("l1", false), stored("l2", false)];
        let uses = [used("l1", 1, &[]), used("l2", 2, &[])];
        assert_eq!(stack_parent(&marks, &live, &uses).as_deref(), Some("l2"));
        // l2 deleted: its files may go any moment, so not on it.
        let deleted = [stored("l1", false), stored("l2", true)];
        assert_eq!(stack_parent(&marks, &deleted, &uses).as_deref(), Some("l1"));
        // An id now naming another snapshot (imported): its guid differs.
        let reused = [used("l1", 1, &[]), used("l2", 99, &[])];
        assert_eq!(stack_parent(&marks, &live, &reused).as_deref(), Some("l1"));
        assert_eq!(stack_parent(&[], &live, &uses), None);
    }

    #[test]
    fn chains_are_collected_leaves_first_and_never_under_a_live_clone() {
        // l1 <- l2 <- l3 (all deleted); l2 also <- a running sandbox at
        // first, then not. `keep` (live) stacks on `k0` (deleted).
        let all =
            [stored("l1", true), stored("l2", true), stored("l3", true), stored("k0", true), stored("keep", false)];
        let d = |id: &str| format!("zroot/copse/snapshots/{id}.deleted.500");
        let (l2, l3) = (d("l2"), d("l3"));
        let busy = [
            used("l1.deleted.500", 1, &[&l2]),
            used("l2.deleted.500", 2, &[&l3, "zroot/copse/sandboxes/x"]),
            used("l3.deleted.500", 3, &[]),
            used("k0.deleted.500", 4, &["zroot/copse/snapshots/keep"]),
            used("keep", 5, &[]),
        ];
        assert_golden(
            &render(&collect(&all, &busy)),
            "run /sbin/zfs destroy -r -f zroot/copse/snapshots/l3.deleted.500\n",
        );
        let mut free = busy.clone();
        free[1].clones.pop();
        assert_golden(
            &render(&collect(&all, &free)),
            "
run /sbin/zfs destroy -r -f zroot/copse/snapshots/l3.deleted.500
run /sbin/zfs destroy -r -f zroot/copse/snapshots/l2.deleted.500
run /sbin/zfs destroy -r -f zroot/copse/snapshots/l1.deleted.500
",
        );
        let mut untagged = stored("u", true);
        untagged.id = None;
        assert!(collect(&[untagged], &[]).is_empty());
    }

    // The exact sequence a template build makes of the trait calls the
    // gateway sends (see the module docs), for a build `FROM base` with two
    // steps, a sandbox of the built template, a rebuild that finds step 1
    // cached, and the template's deletion.

    fn spec(id: &str, snapshot: Option<&str>) -> SandboxSpec {
        SandboxSpec {
            id: id.into(),
            template: "base".into(),
            limits: Limits { cpu_count: 2, memory_mb: 1024, disk_mb: 4096, pids: 512 },
            agent_socket: format!("/var/run/copse/{id}.sock").into(),
            snapshot: snapshot.map(String::from),
            network: None,
            volumes: Vec::new(),
        }
    }

    /// The build sandbox `b1` as `JailSubstrate::snapshot` sees it.
    fn build_sandbox(parent: Option<&str>, origin: &str) -> SnapshotSource {
        SnapshotSource {
            id: "b1".into(),
            jid: 7,
            origin: origin.into(),
            parent: parent.map(String::from),
            template: "base".into(),
            template_guid: 77,
            paused: false,
        }
    }

    #[test]
    fn build_sandbox_boots_from_the_base_template_golden() {
        let plan = render(&sandbox::create(&layout(), &spec("b1", None), &Origin::template(&layout(), "base", 77)));
        assert!(
            plan.starts_with(
                "run /sbin/zfs clone -o mountpoint=/var/db/copse/sandboxes/b1 -o quota=4096M -o readonly=off \
                 -o compression=lz4 -o atime=off -o setuid=off -o copse:sandbox=b1 -o copse:template=base \
                 -o copse:template_guid=77 -o copse:agent_socket=/var/run/copse/b1.sock \
                 zroot/copse/templates/base@base zroot/copse/sandboxes/b1\n"
            ),
            "{plan}"
        );
    }

    #[test]
    fn first_layer_is_sent_from_the_base_template_golden() {
        let base = "zroot/copse/templates/base@base";
        assert_golden(
            &render(&lifecycle::snapshot(&layout(), &build_sandbox(None, base), "snap-l1")),
            "
signal STOP every process in jail 7 (copse-b1)
run /sbin/zfs snapshot zroot/copse/sandboxes/b1@copse-snap-l1
signal CONT every process in jail 7 (copse-b1)
run /sbin/zfs send -c -i zroot/copse/templates/base@base zroot/copse/sandboxes/b1@copse-snap-l1 | /sbin/zfs recv -u -o origin=zroot/copse/templates/base@base -o mountpoint=none -o canmount=off -o readonly=on -o copse:snapshot=snap-l1 -o copse:template=base -o copse:template_guid=77 zroot/copse/snapshots/snap-l1
run /sbin/zfs rename zroot/copse/snapshots/snap-l1@copse-snap-l1 zroot/copse/snapshots/snap-l1@snapshot
run /sbin/zfs bookmark zroot/copse/sandboxes/b1@copse-snap-l1 'zroot/copse/sandboxes/b1#copse-snap-l1'
run /sbin/zfs destroy zroot/copse/sandboxes/b1@copse-snap-l1
",
        );
    }

    #[test]
    fn later_layers_and_the_image_stack_on_the_previous_layer_golden() {
        let base = "zroot/copse/templates/base@base";
        assert_golden(
            &render(&lifecycle::snapshot(&layout(), &build_sandbox(Some("snap-l1"), base), "snap-l2")),
            "
signal STOP every process in jail 7 (copse-b1)
run /sbin/zfs snapshot zroot/copse/sandboxes/b1@copse-snap-l2
signal CONT every process in jail 7 (copse-b1)
run /sbin/zfs send -c -i 'zroot/copse/sandboxes/b1#copse-snap-l1' zroot/copse/sandboxes/b1@copse-snap-l2 | /sbin/zfs recv -u -o origin=zroot/copse/snapshots/snap-l1@snapshot -o mountpoint=none -o canmount=off -o readonly=on -o copse:snapshot=snap-l2 -o copse:template=base -o copse:template_guid=77 zroot/copse/snapshots/snap-l2
run /sbin/zfs rename zroot/copse/snapshots/snap-l2@copse-snap-l2 zroot/copse/snapshots/snap-l2@snapshot
run /sbin/zfs bookmark zroot/copse/sandboxes/b1@copse-snap-l2 'zroot/copse/sandboxes/b1#copse-snap-l2'
run /sbin/zfs destroy zroot/copse/sandboxes/b1@copse-snap-l2
",
        );
        // The finished image is one more snapshot, on the last layer.
        let image = render(&lifecycle::snapshot(&layout(), &build_sandbox(Some("snap-l2"), base), "snap-img"));
        assert!(
            image.contains(
                "run /sbin/zfs send -c -i 'zroot/copse/sandboxes/b1#copse-snap-l2' zroot/copse/sandboxes/b1@copse-snap-img \
                 | /sbin/zfs recv -u -o origin=zroot/copse/snapshots/snap-l2@snapshot "
            ),
            "{image}"
        );
    }

    #[test]
    fn sandboxes_of_the_built_template_clone_its_image_as_from_a_shipped_template_golden() {
        let plan = render(&sandbox::create(
            &layout(),
            &spec("s1", Some("snap-img")),
            &Origin::snapshot(&layout(), "snap-img", 77),
        ));
        assert!(
            plan.starts_with(
                "run /sbin/zfs clone -o mountpoint=/var/db/copse/sandboxes/s1 -o quota=4096M -o readonly=off \
                 -o compression=lz4 -o atime=off -o setuid=off -o copse:sandbox=s1 -o copse:template=base \
                 -o copse:template_guid=77 -o copse:agent_socket=/var/run/copse/s1.sock \
                 -o copse:from_snapshot=snap-img zroot/copse/snapshots/snap-img@snapshot zroot/copse/sandboxes/s1\n"
            ),
            "{plan}"
        );
    }

    #[test]
    fn a_rebuild_stacks_new_layers_on_the_cached_one_golden() {
        // Step 1 cached: the build sandbox b1 is a clone of snap-l1, and
        // its first snapshot is sent from there (no bookmark yet).
        let origin = layout().snapshot_origin("snap-l1");
        let plan = render(&lifecycle::snapshot(&layout(), &build_sandbox(None, &origin), "snap-l2b"));
        let copy = plan.lines().nth(3).unwrap();
        assert_eq!(
            copy,
            "run /sbin/zfs send -c -i zroot/copse/snapshots/snap-l1@snapshot zroot/copse/sandboxes/b1@copse-snap-l2b \
             | /sbin/zfs recv -u -o origin=zroot/copse/snapshots/snap-l1@snapshot -o mountpoint=none -o canmount=off \
             -o readonly=on -o copse:snapshot=snap-l2b -o copse:template=base -o copse:template_guid=77 \
             zroot/copse/snapshots/snap-l2b"
        );
    }

    #[test]
    fn deleting_the_built_template_defers_what_is_in_use_then_collects_the_chain_golden() {
        // base@base <- l1 <- l2 <- img <- sandbox s1 (running).
        let live = [stored("snap-l1", false), stored("snap-l2", false), stored("snap-img", false)];
        let uses = [
            used("snap-l1", 1, &["zroot/copse/snapshots/snap-l2"]),
            used("snap-l2", 2, &["zroot/copse/snapshots/snap-img"]),
            used("snap-img", 3, &["zroot/copse/sandboxes/s1"]),
        ];
        let has_clones = |s: &StoredSnapshot| cloned(&uses).contains(&s.dataset);
        // The gateway deletes the image, then each layer: every one is
        // depended on, so each is only marked and renamed.
        let deletes: Vec<Step> = live.iter().flat_map(|s| lifecycle::delete(s, has_clones(s))).collect();
        assert_golden(
            &render(&deletes),
            "
run /sbin/zfs set copse:deleted=on zroot/copse/snapshots/snap-l1
run /sbin/zfs rename zroot/copse/snapshots/snap-l1 zroot/copse/snapshots/snap-l1.deleted.500
run /sbin/zfs set copse:deleted=on zroot/copse/snapshots/snap-l2
run /sbin/zfs rename zroot/copse/snapshots/snap-l2 zroot/copse/snapshots/snap-l2.deleted.500
run /sbin/zfs set copse:deleted=on zroot/copse/snapshots/snap-img
run /sbin/zfs rename zroot/copse/snapshots/snap-img zroot/copse/snapshots/snap-img.deleted.500
",
        );
        let deleted = [stored("snap-l1", true), stored("snap-l2", true), stored("snap-img", true)];
        let renamed = |id: &str, guid, clones: &[&str]| used(&format!("{id}.deleted.500"), guid, clones);
        let (l2, img) = ("zroot/copse/snapshots/snap-l2.deleted.500", "zroot/copse/snapshots/snap-img.deleted.500");
        // While s1 runs nothing goes: every layer is under it.
        let running = [
            renamed("snap-l1", 1, &[l2]),
            renamed("snap-l2", 2, &[img]),
            renamed("snap-img", 3, &["zroot/copse/sandboxes/s1"]),
        ];
        assert!(collect(&deleted, &running).is_empty());
        // After s1's destroy: the image, then the layers, newest first.
        let idle = [renamed("snap-l1", 1, &[l2]), renamed("snap-l2", 2, &[img]), renamed("snap-img", 3, &[])];
        assert_golden(
            &render(&collect(&deleted, &idle)),
            "
run /sbin/zfs destroy -r -f zroot/copse/snapshots/snap-img.deleted.500
run /sbin/zfs destroy -r -f zroot/copse/snapshots/snap-l2.deleted.500
run /sbin/zfs destroy -r -f zroot/copse/snapshots/snap-l1.deleted.500
",
        );
        // An unused built template, deleted layer by layer in any order:
        // what a later layer stacks on is deferred, the leaf goes at once,
        // and the collect that follows every delete takes the rest.
        let unused = [
            used("snap-l1", 1, &["zroot/copse/snapshots/snap-l2"]),
            used("snap-l2", 2, &["zroot/copse/snapshots/snap-img"]),
            used("snap-img", 3, &[]),
        ];
        let deletes: Vec<Step> =
            live.iter().flat_map(|s| lifecycle::delete(s, cloned(&unused).contains(&s.dataset))).collect();
        assert_golden(
            &render(&deletes),
            "
run /sbin/zfs set copse:deleted=on zroot/copse/snapshots/snap-l1
run /sbin/zfs rename zroot/copse/snapshots/snap-l1 zroot/copse/snapshots/snap-l1.deleted.500
run /sbin/zfs set copse:deleted=on zroot/copse/snapshots/snap-l2
run /sbin/zfs rename zroot/copse/snapshots/snap-l2 zroot/copse/snapshots/snap-l2.deleted.500
run /sbin/zfs destroy -r -f zroot/copse/snapshots/snap-img
",
        );
        let after = [renamed("snap-l1", 1, &[l2]), renamed("snap-l2", 2, &[])];
        assert_golden(
            &render(&collect(&deleted[..2], &after)),
            "
run /sbin/zfs destroy -r -f zroot/copse/snapshots/snap-l2.deleted.500
run /sbin/zfs destroy -r -f zroot/copse/snapshots/snap-l1.deleted.500
",
        );
    }
}
