//! Persistent volumes on FreeBSD, as plans: a ZFS dataset per volume
//! (`<root>/volumes/<id>`, its `quota` the volume's limit, mounted below
//! the state directory, 0700 to host root), nullfs-mounted read-write into
//! each jail that mounts it. Jails share the host's ids, so the volume's
//! root is handed to the templates' `user` (uid 1000) as on Linux.
//! Golden-tested on Linux; not run on FreeBSD.

use std::path::{Path, PathBuf};

use super::{Cmd, Layout, Step, tool};
use copse_substrate::SandboxSpec;

/// The ZFS property naming the volume a dataset holds.
pub const PROP_VOLUME: &str = "copse:volume";
/// Owner of a new volume's root (the templates' `user`).
const VOLUME_OWNER: u32 = 1000;

pub fn volumes_dataset(layout: &Layout) -> String {
    format!("{}/volumes", layout.dataset_root)
}

pub fn volume_dataset(layout: &Layout, id: &str) -> String {
    format!("{}/{id}", volumes_dataset(layout))
}

/// Where volume `id` is mounted on the host (what the content API reads).
pub fn volume_root(layout: &Layout, id: &str) -> PathBuf {
    layout.state_dir.join("volumes").join(id)
}

/// The steps of `Substrate::create_volume` (the parent dataset made first
/// by `host::prepare`'s `zfs::create_parent` when missing).
pub fn create(layout: &Layout, id: &str, limit_bytes: u64, parent_exists: bool) -> Vec<Step> {
    let mut steps = Vec::new();
    if !parent_exists {
        steps.push(Step::Run(super::zfs::create_parent(&volumes_dataset(layout))));
    }
    let root = volume_root(layout, id);
    steps.push(Step::Run(Cmd::new(
        tool::ZFS,
        [
            "create".to_string(),
            "-o".into(),
            format!("mountpoint={}", root.display()),
            "-o".into(),
            format!("quota={limit_bytes}"),
            "-o".into(),
            "compression=lz4".into(),
            "-o".into(),
            "atime=off".into(),
            "-o".into(),
            "setuid=off".into(),
            "-o".into(),
            "devices=off".into(),
            "-o".into(),
            format!("{PROP_VOLUME}={id}"),
            volume_dataset(layout, id),
        ],
    )));
    steps
        .push(Step::Run(Cmd::new(tool::CHOWN, [format!("{VOLUME_OWNER}:{VOLUME_OWNER}"), root.display().to_string()])));
    steps
}

/// The steps of `Substrate::delete_volume` (refused by ZFS while a jail
/// still has it nullfs-mounted; the gateway refuses that case first).
pub fn destroy(layout: &Layout, id: &str) -> Vec<Step> {
    vec![Step::Run(Cmd::new(tool::ZFS, ["destroy".to_string(), "-r".into(), volume_dataset(layout, id)]))]
}

/// Mounts of the spec's volumes inside the jail's root: each mount point
/// made with no symlink at or below the root (the tree is the sandbox's),
/// then a read-write nullfs of the volume's dataset, nosuid. Destroy finds
/// them among the mounts below the root, as it does the agent's.
pub fn mounts(layout: &Layout, spec: &SandboxSpec) -> Vec<Step> {
    let root = layout.sandbox_root(&spec.id);
    let mut steps = Vec::new();
    for volume in &spec.volumes {
        let point = root.join(Path::new(volume.path.trim_start_matches('/')));
        steps.push(Step::RealDir { path: point.clone(), below: root.clone(), mode: 0o755 });
        steps.push(Step::Run(Cmd::new(
            tool::MOUNT,
            [
                "-t".to_string(),
                "nullfs".into(),
                "-o".into(),
                "rw,nosuid".into(),
                volume_root(layout, &volume.volume).display().to_string(),
                point.display().to_string(),
            ],
        )));
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::super::render;
    use super::super::testing::*;
    use super::*;
    use copse_substrate::{Limits, VolumeMount};

    #[test]
    fn create_and_destroy_plans_golden() {
        assert_golden(
            &render(&create(&layout(), "v1k2", 10 << 30, false)),
            "
run /sbin/zfs create -o mountpoint=none -o compression=lz4 -o atime=off -o setuid=off zroot/copse/volumes
run /sbin/zfs create -o mountpoint=/var/db/copse/volumes/v1k2 -o quota=10737418240 -o compression=lz4 -o atime=off -o setuid=off -o devices=off -o copse:volume=v1k2 zroot/copse/volumes/v1k2
run /usr/sbin/chown 1000:1000 /var/db/copse/volumes/v1k2
",
        );
        assert_golden(&render(&destroy(&layout(), "v1k2")), "\nrun /sbin/zfs destroy -r zroot/copse/volumes/v1k2\n");
    }

    #[test]
    fn a_jail_mounts_its_volumes_read_write_below_its_root_without_following_links() {
        let spec = SandboxSpec {
            id: "i3k2m9x".into(),
            template: "base".into(),
            limits: Limits::default(),
            agent_socket: "/var/run/copse/i3k2m9x.sock".into(),
            snapshot: None,
            network: None,
            volumes: vec![VolumeMount { volume: "v1k2".into(), path: "/mnt/data".into() }],
        };
        assert_golden(
            &render(&mounts(&layout(), &spec)),
            "
realdir /var/db/copse/sandboxes/i3k2m9x/mnt/data mode=755 nosymlinks-below=/var/db/copse/sandboxes/i3k2m9x
run /sbin/mount -t nullfs -o rw,nosuid /var/db/copse/volumes/v1k2 /var/db/copse/sandboxes/i3k2m9x/mnt/data
",
        );
        let plan = render(&super::super::sandbox::create(
            &layout(),
            &spec,
            &super::super::zfs::Origin::template(&layout(), "base", 77),
        ));
        let jail = plan.find("jail_set create").unwrap();
        let mount = plan.find("-o rw,nosuid /var/db/copse/volumes/v1k2").unwrap();
        assert!(mount < jail, "mounted before any code of the sandbox runs:\n{plan}");
    }
}
