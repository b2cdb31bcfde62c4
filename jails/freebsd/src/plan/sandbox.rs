//! One sandbox's life on FreeBSD, as two plans: create and destroy.
//!
//! Create, in order: clone the template, mount `/dev` and the agent, make
//! the jail, limit it, bring up loopback, bind the agent's socket, start
//! the agent. Each privileged step happens before any code of the sandbox
//! runs; the agent is the first process in the jail.
//!
//! Destroy is computed from what is observed on the host ([`Traces`]),
//! not from what create intended, so it also cleans up after a create that
//! failed halfway or a gateway that crashed, and is idempotent.

use std::path::PathBuf;

use super::{AGENT_DIR_IN_JAIL, Cmd, Layout, Step, devfs, jail, jail_name, mounts, rctl, tool, volume, zfs};
use copse_substrate::SandboxSpec;

/// The steps of `Substrate::create`, from `origin` (looked up just before).
pub fn create(layout: &Layout, spec: &SandboxSpec, origin: &zfs::Origin) -> Vec<Step> {
    let root = layout.sandbox_root(&spec.id);
    let agent_mountpoint = root.join(AGENT_DIR_IN_JAIL.trim_start_matches('/'));
    let mut steps = vec![Step::Run(zfs::clone_sandbox(layout, spec, origin))];
    steps.extend(devfs::mount(&root, layout.devfs_ruleset));
    steps.push(Step::RealDir { path: agent_mountpoint.clone(), below: root.clone(), mode: 0o755 });
    steps.push(Step::Run(Cmd::new(
        tool::MOUNT,
        [
            "-t".to_string(),
            "nullfs".into(),
            "-o".into(),
            "ro".into(),
            layout.agent_dir().display().to_string(),
            agent_mountpoint.display().to_string(),
        ],
    )));
    steps.extend(volume::mounts(layout, spec));
    steps.push(Step::CreateJail(jail::sandbox_jail(layout, &spec.id)));
    steps.extend(rctl::rules(&spec.id, &spec.limits).iter().map(|r| Step::Run(rctl::add(r))));
    steps.push(Step::Run(jail::loopback_up(&spec.id)));
    steps.push(Step::BindAgentSocket { path: spec.agent_socket.clone() });
    steps.push(Step::StartAgent(jail::agent_launch(&spec.id, &spec.agent_socket)));
    steps
}

/// What of one sandbox exists on the host right now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Traces {
    /// Jid of the live (not dying) jail named `copse-<id>`.
    pub jid: Option<i32>,
    pub rctl_rules: bool,
    /// Mountpoints strictly inside the sandbox root, deepest first.
    pub mounts: Vec<PathBuf>,
    /// The sandbox's dataset, if it exists.
    pub dataset: Option<String>,
    /// From the dataset's `copse:agent_socket` property.
    pub agent_socket: Option<PathBuf>,
}

impl Traces {
    pub fn is_empty(&self) -> bool {
        self == &Traces::default()
    }
}

/// The steps of `Substrate::destroy`: processes and jail first (nothing may
/// run while its filesystem goes), then limits, mounts, dataset, socket.
pub fn destroy(id: &str, traces: &Traces) -> Vec<Step> {
    let mut steps = Vec::new();
    if let Some(jid) = traces.jid {
        steps.push(Step::RemoveJail { name: jail_name(id), jid });
    }
    if traces.rctl_rules {
        steps.push(Step::Run(rctl::remove_all(id)));
    }
    steps.extend(traces.mounts.iter().map(|m| Step::Run(mounts::unmount(m))));
    if let Some(dataset) = &traces.dataset {
        steps.push(Step::Run(zfs::destroy(dataset)));
    }
    if let Some(socket) = &traces.agent_socket {
        steps.push(Step::RemoveFile { path: socket.clone() });
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::super::render;
    use super::super::testing::*;
    use super::*;
    use copse_substrate::Limits;

    fn spec() -> SandboxSpec {
        SandboxSpec {
            id: "i3k2m9x".into(),
            template: "base".into(),
            limits: Limits { cpu_count: 1, memory_mb: 1024, disk_mb: 2048, pids: 128 },
            agent_socket: "/var/run/copse/i3k2m9x.sock".into(),
            snapshot: None,
            network: None,
            volumes: Vec::new(),
        }
    }

    /// Linux masks host state in /proc and /sys; a jail gets neither: no
    /// procfs, linprocfs, linsysfs or fdescfs is mounted in it, and with
    /// `allow.nomount` its root cannot mount one (not run on FreeBSD).
    #[test]
    fn no_process_or_kernel_filesystem_is_mounted_in_a_jail() {
        let plan = render(&create(&layout(), &spec(), &zfs::Origin::template(&layout(), "base", 77)));
        for fs in ["procfs", "linprocfs", "linsysfs", "fdescfs", "tmpfs -o ", "nullfs -o rw"] {
            assert!(!plan.contains(fs), "{fs} in the create plan:\n{plan}");
        }
        let mounts: Vec<&str> = plan.lines().filter(|l| l.contains("/sbin/mount ")).collect();
        assert_eq!(mounts.len(), 2, "devfs and the read-only agent directory only: {mounts:?}");
        assert!(plan.contains("allow.nomount") && plan.contains("enforce_statfs=2"));
    }

    #[test]
    fn create_plan_golden() {
        assert_golden(
            &render(&create(&layout(), &spec(), &zfs::Origin::template(&layout(), "base", 77))),
            "
run /sbin/zfs clone -o mountpoint=/var/db/copse/sandboxes/i3k2m9x -o quota=2048M -o readonly=off -o compression=lz4 -o atime=off -o setuid=off -o copse:sandbox=i3k2m9x -o copse:template=base -o copse:template_guid=77 -o copse:agent_socket=/var/run/copse/i3k2m9x.sock zroot/copse/templates/base@base zroot/copse/sandboxes/i3k2m9x
realdir /var/db/copse/sandboxes/i3k2m9x/dev mode=555 nosymlinks-below=/var/db/copse/sandboxes/i3k2m9x
run /sbin/mount -t devfs devfs /var/db/copse/sandboxes/i3k2m9x/dev
run /sbin/devfs -m /var/db/copse/sandboxes/i3k2m9x/dev ruleset 4270
run /sbin/devfs -m /var/db/copse/sandboxes/i3k2m9x/dev rule applyset
realdir /var/db/copse/sandboxes/i3k2m9x/.copse mode=755 nosymlinks-below=/var/db/copse/sandboxes/i3k2m9x
run /sbin/mount -t nullfs -o ro /var/db/copse/agent /var/db/copse/sandboxes/i3k2m9x/.copse
jail_set create name=copse-i3k2m9x path=/var/db/copse/sandboxes/i3k2m9x host.hostname=i3k2m9x vnet=1 enforce_statfs=2 securelevel=3 children.max=0 devfs_ruleset=4270 persist allow.noset_hostname allow.nosysvipc allow.noraw_sockets allow.nochflags allow.nomount allow.noquotas allow.nosocket_af allow.nomlock allow.noreserved_ports allow.noread_msgbuf allow.nounprivileged_proc_debug allow.suser
run /usr/bin/rctl -a jail:copse-i3k2m9x:memoryuse:deny=1073741824
run /usr/bin/rctl -a jail:copse-i3k2m9x:pcpu:deny=100
run /usr/bin/rctl -a jail:copse-i3k2m9x:maxproc:deny=128
run /usr/bin/rctl -a jail:copse-i3k2m9x:openfiles:deny=16384
run /usr/bin/rctl -a jail:copse-i3k2m9x:writebps:throttle=134217728
run /usr/bin/rctl -a jail:copse-i3k2m9x:coredumpsize:deny=0
run /usr/bin/env -i /usr/sbin/jexec copse-i3k2m9x /sbin/ifconfig lo0 inet 127.0.0.1/8 up
listen /var/run/copse/i3k2m9x.sock
start jail=copse-i3k2m9x cwd=/ fd3=/var/run/copse/i3k2m9x.sock PATH=/sbin:/bin:/usr/sbin:/usr/bin:/usr/local/sbin:/usr/local/bin HOME=/root /.copse/copse-agent boot
",
        );
    }

    #[test]
    fn agent_socket_stays_outside_the_jail_root() {
        let plan = create(&layout(), &spec(), &zfs::Origin::template(&layout(), "base", 77));
        let root = layout().sandbox_root("i3k2m9x");
        for step in &plan {
            if let Step::BindAgentSocket { path } = step {
                assert!(!path.starts_with(&root));
            }
        }
    }

    #[test]
    fn destroy_plan_golden_for_a_running_sandbox() {
        let traces = Traces {
            jid: Some(12),
            rctl_rules: true,
            mounts: vec!["/var/db/copse/sandboxes/i3k2m9x/dev".into(), "/var/db/copse/sandboxes/i3k2m9x/.copse".into()],
            dataset: Some("zroot/copse/sandboxes/i3k2m9x".into()),
            agent_socket: Some("/var/run/copse/i3k2m9x.sock".into()),
        };
        assert_golden(
            &render(&destroy("i3k2m9x", &traces)),
            "
jail_remove 12 (copse-i3k2m9x)
run /usr/bin/rctl -r jail:copse-i3k2m9x
run /sbin/umount -f /var/db/copse/sandboxes/i3k2m9x/dev
run /sbin/umount -f /var/db/copse/sandboxes/i3k2m9x/.copse
run /sbin/zfs destroy -r -f zroot/copse/sandboxes/i3k2m9x
remove /var/run/copse/i3k2m9x.sock
",
        );
    }

    #[test]
    fn destroy_of_nothing_does_nothing() {
        assert!(Traces::default().is_empty());
        assert!(destroy("gone", &Traces::default()).is_empty());
    }

    #[test]
    fn destroy_after_a_half_finished_create_removes_only_what_exists() {
        let traces = Traces {
            mounts: vec!["/var/db/copse/sandboxes/x/dev".into()],
            dataset: Some("zroot/copse/sandboxes/x".into()),
            ..Traces::default()
        };
        assert_golden(
            &render(&destroy("x", &traces)),
            "
run /sbin/umount -f /var/db/copse/sandboxes/x/dev
run /sbin/zfs destroy -r -f zroot/copse/sandboxes/x
",
        );
    }
}
