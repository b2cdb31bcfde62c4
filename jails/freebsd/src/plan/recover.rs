//! Crash reconciliation: which sandboxes to keep and which to tear down,
//! from one observation of the host.
//!
//! Anything bearing a copse mark — a dataset tagged `copse:sandbox`, a jail
//! named `copse-<id>`, rctl rules for such a jail, a mount inside
//! `<state>/sandboxes/<id>` — belongs to sandbox `<id>`. A sandbox is kept
//! only if the gateway knows it and its jail and dataset are the very ones
//! recorded in its [`Placement`]; everything else of copse's is destroyed.

use std::collections::BTreeSet;

use super::sandbox::Traces;
use super::zfs::SandboxDataset;
use super::{Layout, mounts, sandbox_of_jail, validate_id};
use copse_substrate::Placement;

/// Everything of copse's found on the host.
#[derive(Debug, Clone, Default)]
pub struct HostTraces {
    pub datasets: Vec<SandboxDataset>,
    /// Live jails: (jid, name).
    pub jails: Vec<(i32, String)>,
    /// Sandbox ids owning rctl rules.
    pub rctl_owners: Vec<String>,
    pub mounts: Vec<mounts::Mount>,
}

/// What the FreeBSD substrate records as a sandbox's placement: the jid,
/// and the `createtxg` of its dataset as the "start time" that tells this
/// sandbox from an earlier one of the same id (jids and names are reused;
/// a dataset's creation txg never is within a pool).
pub fn placement(jid: i32, createtxg: u64) -> Placement {
    Placement { init_pid: jid, init_start: createtxg }
}

impl HostTraces {
    /// The traces of one sandbox, for its destroy plan.
    pub fn of(&self, layout: &Layout, id: &str) -> Traces {
        let dataset = self.datasets.iter().find(|d| d.sandbox.as_deref() == Some(id));
        let root = layout.sandbox_root(id);
        Traces {
            jid: self.jails.iter().find(|(_, name)| sandbox_of_jail(name) == Some(id)).map(|(jid, _)| *jid),
            rctl_rules: self.rctl_owners.iter().any(|o| o == id),
            mounts: mounts::below(&self.mounts, &root),
            dataset: dataset.map(|d| d.name.clone()),
            agent_socket: dataset.and_then(|d| d.agent_socket.clone()),
        }
    }

    /// Every sandbox id with at least one trace on the host.
    pub fn sandbox_ids(&self, layout: &Layout) -> BTreeSet<String> {
        let mut ids = BTreeSet::new();
        ids.extend(self.datasets.iter().filter_map(|d| d.sandbox.clone()));
        ids.extend(self.jails.iter().filter_map(|(_, n)| sandbox_of_jail(n).map(String::from)));
        ids.extend(self.rctl_owners.iter().cloned());
        let sandboxes = layout.state_dir.join("sandboxes");
        for m in &self.mounts {
            if let Ok(rest) = m.mountpoint.strip_prefix(&sandboxes)
                && let Some(first) = rest.components().next()
            {
                let id = first.as_os_str().to_string_lossy();
                if validate_id(&id).is_ok() {
                    ids.insert(id.into_owned());
                }
            }
        }
        ids
    }

    /// Whether `placement` still describes a live sandbox `id`: its jail
    /// has the recorded jid and its dataset the recorded createtxg.
    pub fn matches(&self, id: &str, placement: &Placement) -> bool {
        let jail_ok = self.jails.iter().any(|(jid, n)| *jid == placement.init_pid && sandbox_of_jail(n) == Some(id));
        let dataset_ok =
            self.datasets.iter().any(|d| d.sandbox.as_deref() == Some(id) && d.createtxg == placement.init_start);
        jail_ok && dataset_ok
    }
}

#[derive(Debug, Default, PartialEq, Eq)]
pub struct Decision {
    pub adopt: Vec<String>,
    /// Destroyed: known but dead, and orphans.
    pub destroy: Vec<String>,
}

pub fn reconcile(layout: &Layout, known: &[(String, Placement)], host: &HostTraces) -> Decision {
    let mut decision = Decision::default();
    let mut handled = BTreeSet::new();
    for (id, placement) in known {
        handled.insert(id.clone());
        if host.matches(id, placement) {
            decision.adopt.push(id.clone());
        } else {
            // Report it removed even when nothing is left: the gateway
            // must drop it either way.
            decision.destroy.push(id.clone());
        }
    }
    decision.destroy.extend(host.sandbox_ids(layout).into_iter().filter(|id| !handled.contains(id)));
    decision
}

#[cfg(test)]
mod tests {
    use super::super::testing::layout;
    use super::*;
    use std::path::PathBuf;

    fn ds(id: &str, txg: u64) -> SandboxDataset {
        SandboxDataset {
            name: format!("zroot/copse/sandboxes/{id}"),
            sandbox: Some(id.into()),
            agent_socket: Some(PathBuf::from(format!("/run/copse/{id}.sock"))),
            createtxg: txg,
        }
    }

    fn mount(path: &str) -> mounts::Mount {
        mounts::Mount { source: "devfs".into(), mountpoint: path.into(), fstype: "devfs".into() }
    }

    fn host() -> HostTraces {
        HostTraces {
            datasets: vec![
                ds("alive", 100),
                ds("recycled", 200),
                ds("orphan", 300),
                SandboxDataset {
                    name: "zroot/copse/sandboxes/untagged".into(),
                    sandbox: None,
                    agent_socket: None,
                    createtxg: 1,
                },
            ],
            jails: vec![
                (7, "copse-alive".into()),
                (8, "copse-recycled".into()),
                (9, "copse-jailonly".into()),
                (10, "www".into()),
            ],
            rctl_owners: vec!["alive".into(), "rulesonly".into()],
            mounts: vec![
                mount("/var/db/copse/sandboxes/alive/dev"),
                mount("/var/db/copse/sandboxes/mountonly/dev"),
                mount("/dev"),
            ],
        }
    }

    #[test]
    fn known_live_sandboxes_are_adopted_and_everything_else_of_copse_is_destroyed() {
        let known = vec![
            ("alive".to_string(), placement(7, 100)),
            // Same name, but the dataset is a newer one than recorded.
            ("recycled".to_string(), placement(8, 150)),
            ("vanished".to_string(), placement(3, 50)),
        ];
        let decision = reconcile(&layout(), &known, &host());
        assert_eq!(decision.adopt, ["alive"]);
        assert_eq!(decision.destroy, ["recycled", "vanished", "jailonly", "mountonly", "orphan", "rulesonly"]);
    }

    #[test]
    fn untagged_datasets_and_foreign_jails_are_never_touched() {
        let ids = host().sandbox_ids(&layout());
        assert!(!ids.contains("untagged"));
        assert!(!ids.contains("www"));
    }

    #[test]
    fn traces_of_one_sandbox_feed_its_destroy_plan() {
        let traces = host().of(&layout(), "alive");
        assert_eq!(
            traces,
            Traces {
                jid: Some(7),
                rctl_rules: true,
                mounts: vec!["/var/db/copse/sandboxes/alive/dev".into()],
                dataset: Some("zroot/copse/sandboxes/alive".into()),
                agent_socket: Some("/run/copse/alive.sock".into()),
            }
        );
        assert!(host().of(&layout(), "never-existed").is_empty());
    }
}
