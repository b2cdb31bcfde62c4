//! From pool decisions to host commands.
//!
//! A pool slot owns a zvol clone of the template's disk, a tap on the pool's
//! bridge and, while restored, a bhyve process. This module turns the pool's
//! [`Action`]s and the one-off template checkpoint build into command lists;
//! the executor only runs them.

use std::path::{Path, PathBuf};

use crate::command::{self, Cmd, GuestConfig, MemoryRestore};
use crate::pool::SlotId;

/// Where one template's pool lives on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolLayout {
    pub template: String,
    /// ZFS dataset holding the template zvol `<root>/<template>` and the
    /// slot clones `<root>/<template>-<slot>`.
    pub zfs_root: String,
    /// Directory of the template's checkpoint files.
    pub checkpoint_dir: PathBuf,
    pub bridge: String,
    pub bootrom: PathBuf,
    pub cpus: u32,
    pub memory_mb: u64,
}

/// Snapshot of the template zvol that slot clones come from.
const BASE_SNAPSHOT: &str = "checkpointed";

impl PoolLayout {
    fn template_zvol(&self) -> String {
        format!("{}/{}", self.zfs_root, self.template)
    }

    fn slot_zvol(&self, slot: SlotId) -> String {
        format!("{}/{}-{slot}", self.zfs_root, self.template)
    }

    /// The checkpoint's memory file.
    pub fn checkpoint(&self) -> PathBuf {
        self.checkpoint_dir.join(format!("{}.ckp", self.template))
    }

    /// The template guest: the one booted once and checkpointed. Its disk is
    /// the template zvol itself, so the snapshot taken right after the
    /// checkpoint matches the memory image exactly.
    pub fn template_guest(&self) -> GuestConfig {
        self.guest(&format!("copse-{}-tpl", self.template), &self.template_zvol(), "tap0", 0)
    }

    /// Slot guests differ from the template guest only in names; the device
    /// list, which a restore must reproduce, is identical.
    pub fn slot_guest(&self, slot: SlotId) -> GuestConfig {
        let tap = format!("tap{}", 1000 + slot);
        self.guest(&format!("copse-{}-{slot}", self.template), &self.slot_zvol(slot), &tap, slot)
    }

    fn guest(&self, name: &str, zvol: &str, tap: &str, slot: SlotId) -> GuestConfig {
        GuestConfig {
            name: name.to_string(),
            cpus: self.cpus,
            memory_mb: self.memory_mb,
            bootrom: self.bootrom.clone(),
            disk: Path::new("/dev/zvol").join(zvol),
            tap: tap.to_string(),
            mac: mac_for(slot),
            console: format!("/dev/nmdm{}A", 1000 + slot),
        }
    }

    /// Boot the template once; the executor waits for its agent between
    /// `boot` and `seal`.
    pub fn build_template(&self) -> TemplateBuild {
        let guest = self.template_guest();
        let mut prepare = command::create_tap(&guest.tap, &self.bridge);
        prepare.insert(0, Cmd::new("zfs", ["destroy", "-r", &self.template_zvol()]).allow_failure());
        TemplateBuild {
            prepare,
            boot: command::boot(&guest),
            seal: vec![
                command::suspend(&guest.name, &self.checkpoint()),
                Cmd::new("zfs", ["snapshot".to_string(), format!("{}@{BASE_SNAPSHOT}", self.template_zvol())]),
                command::destroy_vm(&guest.name).allow_failure(),
                command::destroy_tap(&guest.tap),
            ],
        }
    }

    /// Commands for [`crate::pool::Action::Prepare`].
    pub fn prepare_slot(&self, slot: SlotId) -> Vec<Cmd> {
        let guest = self.slot_guest(slot);
        let mut cmds = vec![Cmd::new(
            "zfs",
            [
                "clone".to_string(),
                "-o".to_string(),
                "volmode=dev".to_string(),
                format!("{}@{BASE_SNAPSHOT}", self.template_zvol()),
                self.slot_zvol(slot),
            ],
        )];
        cmds.extend(command::create_tap(&guest.tap, &self.bridge));
        cmds
    }

    /// The long-lived process for [`crate::pool::Action::Restore`].
    pub fn restore_slot(&self, slot: SlotId, memory: MemoryRestore) -> Cmd {
        command::restore(&self.slot_guest(slot), &self.checkpoint(), memory)
    }

    /// Commands for [`crate::pool::Action::Destroy`], after the executor
    /// killed the slot's bhyve (if any). Each may find its object already
    /// gone (a half-prepared slot, a repeat after a crash).
    pub fn destroy_slot(&self, slot: SlotId) -> Vec<Cmd> {
        let guest = self.slot_guest(slot);
        vec![
            command::destroy_vm(&guest.name).allow_failure(),
            command::destroy_tap(&guest.tap).allow_failure(),
            Cmd::new("zfs", ["destroy".to_string(), self.slot_zvol(slot)]).allow_failure(),
        ]
    }
}

/// Where a sandbox snapshot lives: its checkpoint triple in a directory of
/// its own, its disk as a received volume with a snapshot of fixed name (so
/// an imported copy works under any id).
impl PoolLayout {
    fn snapshot_volume(&self, snapshot: &str) -> String {
        format!("{}/snapshots/{snapshot}", self.zfs_root)
    }

    fn snapshot_disk(&self, snapshot: &str) -> String {
        format!("{}@{SNAPSHOT_NAME}", self.snapshot_volume(snapshot))
    }

    /// Write the operator's guest image onto a fresh template zvol; runs
    /// between [`TemplateBuild::prepare`] and [`TemplateBuild::boot`].
    pub fn import_image(&self, image: &Path, size_bytes: u64) -> Vec<Cmd> {
        let zvol = self.template_zvol();
        vec![
            Cmd::new(
                "zfs",
                [
                    "create".to_string(),
                    "-V".into(),
                    size_bytes.to_string(),
                    "-o".into(),
                    "volmode=dev".into(),
                    zvol.clone(),
                ],
            ),
            Cmd::new(
                "dd",
                [
                    format!("if={}", image.display()),
                    format!("of=/dev/zvol/{zvol}"),
                    "bs=1m".into(),
                    "conv=sparse".into(),
                ],
            ),
        ]
    }

    /// Keep a running slot as `snapshot`: checkpoint (bhyve saves and
    /// exits, so memory and disk are of one instant), copy the disk out,
    /// then [`SnapshotPlan::restart`] puts the same guest back from the new
    /// checkpoint.
    pub fn snapshot_slot(&self, slot: SlotId, snapshot: &str, checkpoint: &Path) -> SnapshotPlan {
        let guest = self.slot_guest(slot);
        let transient = format!("{}@copse-{snapshot}", self.slot_zvol(slot));
        SnapshotPlan {
            suspend: command::suspend(&guest.name, checkpoint),
            disk: vec![Cmd::new("zfs", ["snapshot".to_string(), transient.clone()])],
            send: Cmd::new("zfs", ["send".to_string(), transient.clone()]),
            recv: Cmd::new("zfs", ["recv".to_string(), "-u".into(), self.snapshot_disk(snapshot)]),
            cleanup: vec![
                Cmd::new("zfs", ["destroy".to_string(), transient]).allow_failure(),
                command::destroy_vm(&guest.name).allow_failure(),
            ],
            restart: command::restore(&guest, checkpoint, MemoryRestore::Vnode),
        }
    }

    /// A slot whose disk is a copy of a snapshot's rather than a clone of
    /// the template's: `send | recv`, then the NIC. A copy, so deleting the
    /// snapshot never has to wait for sandboxes made from it.
    pub fn prepare_slot_from(&self, slot: SlotId, snapshot: &str) -> (Cmd, Cmd, Vec<Cmd>) {
        let guest = self.slot_guest(slot);
        (
            Cmd::new("zfs", ["send".to_string(), self.snapshot_disk(snapshot)]),
            Cmd::new("zfs", ["recv".to_string(), "-u".into(), "-o".into(), "volmode=dev".into(), self.slot_zvol(slot)]),
            command::create_tap(&guest.tap, &self.bridge),
        )
    }

    /// The disk half of an export, and of an import under `snapshot`.
    pub fn snapshot_stream(&self, snapshot: &str) -> (Cmd, Cmd) {
        (
            Cmd::new("zfs", ["send".to_string(), self.snapshot_disk(snapshot)]),
            Cmd::new("zfs", ["recv".to_string(), "-u".into(), self.snapshot_disk(snapshot)]),
        )
    }

    pub fn delete_snapshot(&self, snapshot: &str) -> Cmd {
        Cmd::new("zfs", ["destroy".to_string(), "-r".into(), self.snapshot_volume(snapshot)]).allow_failure()
    }
}

/// Fixed name of the ZFS snapshot inside every snapshot volume.
const SNAPSHOT_NAME: &str = "snapshot";

/// The steps of [`PoolLayout::snapshot_slot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotPlan {
    pub suspend: Cmd,
    pub disk: Vec<Cmd>,
    /// `send | recv` of the disk into the snapshot volume.
    pub send: Cmd,
    pub recv: Cmd,
    pub cleanup: Vec<Cmd>,
    pub restart: Cmd,
}

/// The host end of a guest console: nmdm(4) pairs are `A` (bhyve's) and
/// `B` (ours).
pub fn console_peer(console: &str) -> String {
    match console.strip_suffix('A') {
        Some(stem) => format!("{stem}B"),
        None => console.to_string(),
    }
}

/// The steps of building a template checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateBuild {
    pub prepare: Vec<Cmd>,
    pub boot: Cmd,
    /// After the agent answered: checkpoint (bhyve exits), snapshot the
    /// disk, clean up.
    pub seal: Vec<Cmd>,
}

/// Locally administered, unicast, derived from the slot so a slot keeps its
/// MAC across restarts of the controller. A restored guest may keep using
/// the template's MAC until its identity reset moves it to this one
/// ([`crate::identity::GuestStep::SetNetwork`]).
fn mac_for(slot: SlotId) -> String {
    let b = slot.to_be_bytes();
    format!("02:c0:{:02x}:{:02x}:{:02x}:{:02x}", b[4], b[5], b[6], b[7])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> PoolLayout {
        PoolLayout {
            template: "python".into(),
            zfs_root: "zroot/copse/vm".into(),
            checkpoint_dir: "/var/db/copse/ckp".into(),
            bridge: "copsebr0".into(),
            bootrom: "/usr/local/share/uefi-firmware/BHYVE_UEFI.fd".into(),
            cpus: 1,
            memory_mb: 256,
        }
    }

    fn lines(cmds: &[Cmd]) -> Vec<String> {
        cmds.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn template_build_plan() {
        let build = layout().build_template();
        assert_eq!(
            lines(&build.prepare),
            [
                "zfs destroy -r zroot/copse/vm/python",
                "ifconfig tap0 create",
                "ifconfig copsebr0 addm tap0 private tap0",
                "ifconfig tap0 up",
            ]
        );
        assert_eq!(
            build.boot.to_string(),
            "bhyve -A -H -P -c 1 -m 256M -s 0,hostbridge -s 2,virtio-net,tap0,mac=02:c0:00:00:00:00 \
             -s 3,virtio-blk,/dev/zvol/zroot/copse/vm/python -s 31,lpc -l com1,/dev/nmdm1000A \
             -l bootrom,/usr/local/share/uefi-firmware/BHYVE_UEFI.fd copse-python-tpl"
        );
        assert_eq!(
            lines(&build.seal),
            [
                "bhyvectl --vm=copse-python-tpl --suspend=/var/db/copse/ckp/python.ckp",
                "zfs snapshot zroot/copse/vm/python@checkpointed",
                "bhyvectl --vm=copse-python-tpl --destroy",
                "ifconfig tap0 destroy",
            ]
        );
        assert!(build.prepare[0].may_fail && !build.seal[0].may_fail && build.seal[2].may_fail);
    }

    #[test]
    fn slot_plans() {
        let l = layout();
        assert_eq!(
            lines(&l.prepare_slot(17)),
            [
                "zfs clone -o volmode=dev zroot/copse/vm/python@checkpointed zroot/copse/vm/python-17",
                "ifconfig tap1017 create",
                "ifconfig copsebr0 addm tap1017 private tap1017",
                "ifconfig tap1017 up",
            ]
        );
        assert_eq!(
            l.restore_slot(17, MemoryRestore::Vnode).to_string(),
            "bhyve -A -H -P -c 1 -m 256M -s 0,hostbridge -s 2,virtio-net,tap1017,mac=02:c0:00:00:00:11 \
             -s 3,virtio-blk,/dev/zvol/zroot/copse/vm/python-17 -s 31,lpc -l com1,/dev/nmdm1017A \
             -l bootrom,/usr/local/share/uefi-firmware/BHYVE_UEFI.fd \
             -r /var/db/copse/ckp/python.ckp -o snapshot.vnode_restore=true copse-python-17"
        );
        let destroy = l.destroy_slot(17);
        assert_eq!(
            lines(&destroy),
            [
                "bhyvectl --vm=copse-python-17 --destroy",
                "ifconfig tap1017 destroy",
                "zfs destroy zroot/copse/vm/python-17",
            ]
        );
        assert!(destroy.iter().all(|c| c.may_fail), "destroy is idempotent");
    }

    #[test]
    fn slots_restore_the_template_device_list() {
        let l = layout();
        let slots = |g: &GuestConfig| {
            let args = command::boot(g).args;
            args.windows(2)
                .filter(|w| w[0] == "-s")
                .map(|w| w[1].split(',').next().unwrap().to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(slots(&l.template_guest()), slots(&l.slot_guest(3)));
    }

    #[test]
    fn snapshot_plans() {
        let l = layout();
        let plan = l.snapshot_slot(17, "s1", Path::new("/var/db/copse/bhyve/snapshots/s1/vm.ckp"));
        assert_eq!(
            plan.suspend.to_string(),
            "bhyvectl --vm=copse-python-17 --suspend=/var/db/copse/bhyve/snapshots/s1/vm.ckp"
        );
        assert_eq!(lines(&plan.disk), ["zfs snapshot zroot/copse/vm/python-17@copse-s1"]);
        assert_eq!(plan.send.to_string(), "zfs send zroot/copse/vm/python-17@copse-s1");
        assert_eq!(plan.recv.to_string(), "zfs recv -u zroot/copse/vm/snapshots/s1@snapshot");
        assert_eq!(
            lines(&plan.cleanup),
            ["zfs destroy zroot/copse/vm/python-17@copse-s1", "bhyvectl --vm=copse-python-17 --destroy"]
        );
        assert!(plan.cleanup.iter().all(|c| c.may_fail));
        assert!(
            plan.restart
                .to_string()
                .ends_with("-r /var/db/copse/bhyve/snapshots/s1/vm.ckp -o snapshot.vnode_restore=true copse-python-17")
        );

        let (send, recv, tap) = l.prepare_slot_from(18, "s1");
        assert_eq!(send.to_string(), "zfs send zroot/copse/vm/snapshots/s1@snapshot");
        assert_eq!(recv.to_string(), "zfs recv -u -o volmode=dev zroot/copse/vm/python-18");
        assert_eq!(tap[0].to_string(), "ifconfig tap1018 create");
        let (send, recv) = l.snapshot_stream("s2");
        assert_eq!(send.to_string(), "zfs send zroot/copse/vm/snapshots/s2@snapshot");
        assert_eq!(recv.to_string(), "zfs recv -u zroot/copse/vm/snapshots/s2@snapshot");
        assert_eq!(l.delete_snapshot("s2").to_string(), "zfs destroy -r zroot/copse/vm/snapshots/s2");
    }

    #[test]
    fn image_import_and_console_peer() {
        assert_eq!(
            lines(&layout().import_image(Path::new("/img/python.img"), 8 << 30)),
            [
                "zfs create -V 8589934592 -o volmode=dev zroot/copse/vm/python",
                "dd if=/img/python.img of=/dev/zvol/zroot/copse/vm/python bs=1m conv=sparse",
            ]
        );
        assert_eq!(console_peer("/dev/nmdm1017A"), "/dev/nmdm1017B");
    }

    #[test]
    fn macs_are_unique_and_local() {
        assert_eq!(mac_for(1), "02:c0:00:00:00:01");
        assert_eq!(mac_for(0x0102_0304), "02:c0:01:02:03:04");
        assert_ne!(mac_for(1), mac_for(2));
    }
}
