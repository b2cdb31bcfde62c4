//! Host preparation when the substrate opens: state directories, the
//! agent binary jails will see, copse's parent datasets, the devfs ruleset.
//! Everything here is idempotent; `open` runs it at every gateway start.

use std::path::Path;

use super::{Layout, Step, devfs, zfs};

/// What `open` found on the host.
#[derive(Debug, Clone, Default)]
pub struct Found {
    /// Which of [`zfs::parents`] already exist.
    pub existing_datasets: Vec<String>,
    /// Whether the kernel already holds copse's devfs ruleset as planned.
    pub ruleset_loaded: bool,
}

pub fn prepare(layout: &Layout, agent_binary: &Path, found: &Found) -> Vec<Step> {
    let state = &layout.state_dir;
    let mut steps = Vec::new();
    for dir in [state.join("sandboxes"), state.join("templates"), layout.agent_dir()] {
        steps.push(Step::RealDir { path: dir, below: state.clone(), mode: 0o755 });
    }
    // Copied at every start so an upgraded agent reaches new sandboxes;
    // running ones keep the inode they started with (copy, then rename).
    steps.push(Step::CopyFile { from: agent_binary.to_path_buf(), to: layout.agent_binary(), mode: 0o555 });
    for dataset in zfs::parents(layout) {
        if !found.existing_datasets.contains(&dataset) {
            steps.push(Step::Run(zfs::create_parent(&dataset)));
        }
    }
    // Reloading empties the ruleset for a moment, during which a device
    // node appearing in a running jail's /dev would not be hidden; so only
    // reload when what is loaded differs.
    if !found.ruleset_loaded {
        steps.extend(devfs::load(layout.devfs_ruleset).into_iter().map(Step::Run));
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::super::render;
    use super::super::testing::*;
    use super::*;

    #[test]
    fn first_start_on_a_fresh_host_golden() {
        let plan = render(&prepare(&layout(), Path::new("/usr/local/libexec/copse-agent"), &Found::default()));
        let head: String = plan.lines().take(8).map(|l| format!("{l}\n")).collect();
        assert_golden(
            &head,
            "
realdir /var/db/copse/sandboxes mode=755 nosymlinks-below=/var/db/copse
realdir /var/db/copse/templates mode=755 nosymlinks-below=/var/db/copse
realdir /var/db/copse/agent mode=755 nosymlinks-below=/var/db/copse
copy /usr/local/libexec/copse-agent /var/db/copse/agent/copse-agent mode=555
run /sbin/zfs create -o mountpoint=none -o compression=lz4 -o atime=off -o setuid=off zroot/copse
run /sbin/zfs create -o mountpoint=none -o compression=lz4 -o atime=off -o setuid=off zroot/copse/templates
run /sbin/zfs create -o mountpoint=none -o compression=lz4 -o atime=off -o setuid=off zroot/copse/sandboxes
run /sbin/zfs create -o mountpoint=none -o compression=lz4 -o atime=off -o setuid=off zroot/copse/snapshots
",
        );
        assert!(plan.contains("run /sbin/devfs rule -s 4270 delset\n"));
    }

    #[test]
    fn restart_on_a_prepared_host_only_refreshes_the_agent() {
        let found = Found { existing_datasets: zfs::parents(&layout()), ruleset_loaded: true };
        let plan = render(&prepare(&layout(), Path::new("/opt/copse-agent"), &found));
        assert!(!plan.contains("zfs create"));
        assert!(!plan.contains("devfs"));
        assert!(plan.contains("copy /opt/copse-agent /var/db/copse/agent/copse-agent mode=555\n"));
    }
}
