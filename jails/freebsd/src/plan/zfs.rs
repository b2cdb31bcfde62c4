//! ZFS: the command lines copse runs and the parsers of `zfs list` output.
//!
//! Listings always use `-H` (tab-separated, no header) and `-p` (exact
//! numbers); an unset user property prints as `-` (zfsprops(7)).

use std::path::PathBuf;

use super::{
    Cmd, Layout, PROP_AGENT_SOCKET, PROP_BUILT_AT, PROP_FROM_SNAPSHOT, PROP_SANDBOX, PROP_TEMPLATE, PROP_TEMPLATE_GUID,
    TEMPLATE_SNAPSHOT, tool,
};
use copse_substrate::SandboxSpec;

/// Properties every copse dataset gets. `atime=off` saves a write per read;
/// `setuid=off` is defence in depth (sandbox processes also run with
/// no_new_privs, see `confine`).
const COMMON_PROPS: &[(&str, &str)] = &[("compression", "lz4"), ("atime", "off"), ("setuid", "off")];

/// `zfs create` for one of copse's parent datasets (`<root>`,
/// `<root>/sandboxes`, `<root>/templates`). They are never mounted; every
/// child sets its own mountpoint below the state directory.
pub fn create_parent(dataset: &str) -> Cmd {
    let mut args = vec!["create".to_string(), "-o".into(), "mountpoint=none".into()];
    for (k, v) in COMMON_PROPS {
        args.push("-o".into());
        args.push(format!("{k}={v}"));
    }
    args.push(dataset.to_string());
    Cmd::new(tool::ZFS, args)
}

/// The parents `open` makes sure exist, outermost first.
pub fn parents(layout: &Layout) -> Vec<String> {
    vec![
        layout.dataset_root.clone(),
        layout.templates_dataset(),
        layout.sandboxes_dataset(),
        layout.snapshots_dataset(),
    ]
}

/// What a sandbox's dataset is cloned from: its template's `@base`, or
/// the `@snapshot` of a copse snapshot taken from a sandbox of the same
/// template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// Full ZFS snapshot name.
    pub zfs_snapshot: String,
    /// Guid of the template's `@base` the files ultimately come from.
    pub template_guid: u64,
    /// The copse snapshot id, when cloned from one.
    pub snapshot_id: Option<String>,
}

impl Origin {
    pub fn template(layout: &Layout, template: &str, guid: u64) -> Self {
        Self { zfs_snapshot: layout.template_snapshot(template), template_guid: guid, snapshot_id: None }
    }

    pub fn snapshot(layout: &Layout, snapshot_id: &str, template_guid: u64) -> Self {
        Self {
            zfs_snapshot: layout.snapshot_origin(snapshot_id),
            template_guid,
            snapshot_id: Some(snapshot_id.to_string()),
        }
    }
}

/// `zfs clone` of `origin` into the sandbox's dataset, tagged so crash
/// reconciliation can find it and know what it came from.
pub fn clone_sandbox(layout: &Layout, spec: &SandboxSpec, origin: &Origin) -> Cmd {
    let mut props: Vec<(String, String)> = vec![
        ("mountpoint".into(), layout.sandbox_root(&spec.id).display().to_string()),
        // quota counts what the sandbox writes (and its snapshots), not the
        // blocks it shares with the template: the natural disk budget.
        ("quota".into(), format!("{}M", spec.limits.disk_mb)),
        // Clones inherit from their parent dataset, not their origin; say it
        // anyway so a read-only template can never leak through.
        ("readonly".into(), "off".into()),
    ];
    props.extend(COMMON_PROPS.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    props.extend([
        (PROP_SANDBOX.into(), spec.id.clone()),
        (PROP_TEMPLATE.into(), spec.template.clone()),
        (PROP_TEMPLATE_GUID.into(), origin.template_guid.to_string()),
        (PROP_AGENT_SOCKET.into(), spec.agent_socket.display().to_string()),
    ]);
    if let Some(snapshot_id) = &origin.snapshot_id {
        props.push((PROP_FROM_SNAPSHOT.into(), snapshot_id.clone()));
    }
    let mut args = vec!["clone".to_string()];
    for (k, v) in props {
        args.push("-o".into());
        args.push(format!("{k}={v}"));
    }
    args.push(origin.zfs_snapshot.clone());
    args.push(layout.sandbox_dataset(&spec.id));
    Cmd::new(tool::ZFS, args)
}

/// `-r` takes the sandbox's own snapshots along; `-f` unmounts even when a
/// dying jail still holds the mountpoint busy.
pub fn destroy(dataset: &str) -> Cmd {
    Cmd::new(tool::ZFS, ["destroy", "-r", "-f", dataset])
}

/// The listing behind crash reconciliation and destroy.
pub fn list_sandboxes(layout: &Layout) -> Cmd {
    let columns = format!("name,{PROP_SANDBOX},{PROP_AGENT_SOCKET},createtxg");
    Cmd::new(tool::ZFS, ["list", "-H", "-p", "-t", "filesystem", "-o", &columns, "-r", &layout.sandboxes_dataset()])
}

/// Every template snapshot, with what `TemplateInfo` needs.
pub fn list_templates(layout: &Layout) -> Cmd {
    let columns = format!("name,guid,referenced,{PROP_BUILT_AT}");
    Cmd::new(tool::ZFS, ["list", "-H", "-p", "-t", "snapshot", "-o", &columns, "-r", &layout.templates_dataset()])
}

/// Exit status 0 iff the dataset exists.
pub fn exists(dataset: &str) -> Cmd {
    Cmd::new(tool::ZFS, ["list", "-H", "-o", "name", dataset])
}

/// One numeric property, e.g. `used` for disk usage.
pub fn get_number(dataset: &str, property: &str) -> Cmd {
    Cmd::new(tool::ZFS, ["get", "-H", "-p", "-o", "value", property, dataset])
}

/// A dataset under `<root>/sandboxes` as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxDataset {
    pub name: String,
    /// `copse:sandbox`; `None` for a dataset copse did not tag (never
    /// destroyed automatically).
    pub sandbox: Option<String>,
    pub agent_socket: Option<PathBuf>,
    pub createtxg: u64,
}

/// The rows of `zfs list -H` output, each with its `N` tab-separated
/// columns; a row of another width is an error naming it.
pub(super) fn rows<const N: usize>(text: &str) -> Result<Vec<(&str, [&str; N])>, String> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let cols: Vec<&str> = line.split('\t').collect();
            let cols: [&str; N] = cols.try_into().map_err(|_| format!("unexpected zfs list line {line:?}"))?;
            Ok((line, cols))
        })
        .collect()
}

pub(super) fn prop(value: &str) -> Option<&str> {
    (value != "-" && !value.is_empty()).then_some(value)
}

/// Parses `zfs list -H -p -o name,copse:sandbox,copse:agent_socket,createtxg`.
/// The parent `<root>/sandboxes` itself is listed too and skipped.
pub fn parse_sandboxes(layout: &Layout, text: &str) -> Result<Vec<SandboxDataset>, String> {
    let parent = format!("{}/", layout.sandboxes_dataset());
    let mut out = Vec::new();
    for (line, [name, sandbox, socket, txg]) in rows(text)? {
        if !name.starts_with(&parent) {
            continue;
        }
        let createtxg = txg.parse().map_err(|_| format!("bad createtxg in {line:?}"))?;
        out.push(SandboxDataset {
            name: name.to_string(),
            sandbox: prop(sandbox).map(String::from),
            agent_socket: prop(socket).map(PathBuf::from),
            createtxg,
        });
    }
    Ok(out)
}

/// A template's `@base` snapshot as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateSnapshot {
    pub template: String,
    pub guid: u64,
    pub referenced: u64,
    pub built_at: u64,
}

/// Parses `zfs list -H -p -t snapshot -o name,guid,referenced,copse:built_at`,
/// keeping only `<root>/templates/<name>@base` (sandbox-made snapshots of a
/// template, if any, are not templates).
pub fn parse_templates(layout: &Layout, text: &str) -> Result<Vec<TemplateSnapshot>, String> {
    let parent = format!("{}/", layout.templates_dataset());
    let suffix = format!("@{TEMPLATE_SNAPSHOT}");
    let mut out = Vec::new();
    for (line, [name, guid, referenced, built_at]) in rows(text)? {
        let Some(template) = name.strip_prefix(&parent).and_then(|n| n.strip_suffix(&suffix)) else {
            continue;
        };
        if template.contains('/') {
            continue;
        }
        let num = |s: &str, what: &str| s.parse::<u64>().map_err(|_| format!("bad {what} in {line:?}"));
        out.push(TemplateSnapshot {
            template: template.to_string(),
            guid: num(guid, "guid")?,
            referenced: num(referenced, "referenced")?,
            // A snapshot without the property was made by hand; list it
            // with time 0 rather than hide it.
            built_at: prop(built_at).map(|b| num(b, "built_at")).transpose()?.unwrap_or(0),
        });
    }
    Ok(out)
}

/// Parses the single value printed by `zfs get -H -p -o value`.
pub fn parse_number(text: &str) -> Result<u64, String> {
    text.trim().parse().map_err(|_| format!("expected a number from zfs, got {:?}", text.trim()))
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use copse_substrate::{Limits, SandboxSpec};

    fn spec() -> SandboxSpec {
        SandboxSpec {
            id: "i3k2m9x".into(),
            template: "base".into(),
            limits: Limits { cpu_count: 2, memory_mb: 512, disk_mb: 1024, pids: 512 },
            agent_socket: "/var/run/copse/i3k2m9x.sock".into(),
            snapshot: None,
            network: None,
            volumes: Vec::new(),
        }
    }

    #[test]
    fn clone_command_golden() {
        assert_eq!(
            clone_sandbox(&layout(), &spec(), &Origin::template(&layout(), "base", 1234567890123)).to_string(),
            "/sbin/zfs clone -o mountpoint=/var/db/copse/sandboxes/i3k2m9x -o quota=1024M -o readonly=off \
             -o compression=lz4 -o atime=off -o setuid=off -o copse:sandbox=i3k2m9x -o copse:template=base \
             -o copse:template_guid=1234567890123 -o copse:agent_socket=/var/run/copse/i3k2m9x.sock \
             zroot/copse/templates/base@base zroot/copse/sandboxes/i3k2m9x"
        );
    }

    #[test]
    fn clone_from_a_snapshot_golden() {
        assert_eq!(
            clone_sandbox(&layout(), &spec(), &Origin::snapshot(&layout(), "snap1", 42)).to_string(),
            "/sbin/zfs clone -o mountpoint=/var/db/copse/sandboxes/i3k2m9x -o quota=1024M -o readonly=off \
             -o compression=lz4 -o atime=off -o setuid=off -o copse:sandbox=i3k2m9x -o copse:template=base \
             -o copse:template_guid=42 -o copse:agent_socket=/var/run/copse/i3k2m9x.sock \
             -o copse:from_snapshot=snap1 zroot/copse/snapshots/snap1@snapshot zroot/copse/sandboxes/i3k2m9x"
        );
    }

    #[test]
    fn parent_and_listing_commands_golden() {
        let l = layout();
        let rendered: Vec<String> = parents(&l).iter().map(|d| create_parent(d).to_string()).collect();
        assert_eq!(
            rendered,
            [
                "/sbin/zfs create -o mountpoint=none -o compression=lz4 -o atime=off -o setuid=off zroot/copse",
                "/sbin/zfs create -o mountpoint=none -o compression=lz4 -o atime=off -o setuid=off zroot/copse/templates",
                "/sbin/zfs create -o mountpoint=none -o compression=lz4 -o atime=off -o setuid=off zroot/copse/sandboxes",
                "/sbin/zfs create -o mountpoint=none -o compression=lz4 -o atime=off -o setuid=off zroot/copse/snapshots",
            ]
        );
        assert_eq!(
            list_sandboxes(&l).to_string(),
            "/sbin/zfs list -H -p -t filesystem -o name,copse:sandbox,copse:agent_socket,createtxg -r zroot/copse/sandboxes"
        );
        assert_eq!(
            list_templates(&l).to_string(),
            "/sbin/zfs list -H -p -t snapshot -o name,guid,referenced,copse:built_at -r zroot/copse/templates"
        );
        assert_eq!(destroy("zroot/copse/sandboxes/x").to_string(), "/sbin/zfs destroy -r -f zroot/copse/sandboxes/x");
        assert_eq!(
            get_number("zroot/copse/sandboxes/x", "used").to_string(),
            "/sbin/zfs get -H -p -o value used zroot/copse/sandboxes/x"
        );
    }

    #[test]
    fn sandbox_listing_is_parsed_and_untagged_datasets_kept_apart() {
        let text = "zroot/copse/sandboxes\t-\t-\t112\n\
                    zroot/copse/sandboxes/i3k2m9x\ti3k2m9x\t/var/run/copse/i3k2m9x.sock\t48213\n\
                    zroot/copse/sandboxes/handmade\t-\t-\t50000\n";
        let parsed = parse_sandboxes(&layout(), text).unwrap();
        assert_eq!(
            parsed,
            vec![
                SandboxDataset {
                    name: "zroot/copse/sandboxes/i3k2m9x".into(),
                    sandbox: Some("i3k2m9x".into()),
                    agent_socket: Some("/var/run/copse/i3k2m9x.sock".into()),
                    createtxg: 48213,
                },
                SandboxDataset {
                    name: "zroot/copse/sandboxes/handmade".into(),
                    sandbox: None,
                    agent_socket: None,
                    createtxg: 50000,
                },
            ]
        );
        assert!(parse_sandboxes(&layout(), "zroot/copse/sandboxes/x  x  y  1\n").is_err());
    }

    #[test]
    fn template_listing_keeps_only_base_snapshots() {
        let text = "zroot/copse/templates/base@base\t9182736450192837465\t1288490188\t1763769600\n\
                    zroot/copse/templates/base@manual\t1\t2\t-\n\
                    zroot/copse/templates/code-interpreter@base\t42\t2147483648\t-\n";
        let parsed = parse_templates(&layout(), text).unwrap();
        assert_eq!(
            parsed,
            vec![
                TemplateSnapshot {
                    template: "base".into(),
                    guid: 9182736450192837465,
                    referenced: 1288490188,
                    built_at: 1763769600
                },
                TemplateSnapshot { template: "code-interpreter".into(), guid: 42, referenced: 2147483648, built_at: 0 },
            ]
        );
    }

    #[test]
    fn numbers_from_zfs_get() {
        assert_eq!(parse_number("73728\n").unwrap(), 73728);
        assert!(parse_number("-\n").is_err());
    }
}
