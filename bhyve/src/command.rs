//! Command lines for bhyve, bhyvectl, ifconfig and sysctl, as data.
//!
//! The device list is part of a checkpoint's contract: bhyve restores device
//! state by slot and name, so the boot that made the checkpoint and every
//! restore from it are built from one [`GuestConfig`].

use std::fmt;
use std::path::PathBuf;

/// One program invocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cmd {
    pub program: &'static str,
    pub args: Vec<String>,
    /// A failure is expected when the object is already gone (cleanup that
    /// may repeat); the executor logs it and goes on.
    pub may_fail: bool,
}

impl Cmd {
    pub fn new(program: &'static str, args: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self { program, args: args.into_iter().map(Into::into).collect(), may_fail: false }
    }

    pub fn allow_failure(mut self) -> Self {
        self.may_fail = true;
        self
    }
}

impl fmt::Display for Cmd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.program)?;
        for arg in &self.args {
            write!(f, " {arg}")?;
        }
        Ok(())
    }
}

/// The virtual hardware of one guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestConfig {
    /// vmm(4) instance name, unique on the host.
    pub name: String,
    pub cpus: u32,
    pub memory_mb: u64,
    /// UEFI firmware; restores need a boot ROM because bhyve refuses to
    /// start a fresh VM without one.
    pub bootrom: PathBuf,
    /// Root disk: a zvol clone (`/dev/zvol/...`) or an image file.
    pub disk: PathBuf,
    /// Host side of the guest NIC.
    pub tap: String,
    pub mac: String,
    /// nmdm(4) device for the serial console, A side (e.g. `/dev/nmdm7A`).
    pub console: String,
}

impl GuestConfig {
    fn bhyve_args(&self) -> Vec<String> {
        vec![
            "-A".into(),
            "-H".into(),
            "-P".into(),
            "-c".into(),
            self.cpus.to_string(),
            "-m".into(),
            format!("{}M", self.memory_mb),
            "-s".into(),
            "0,hostbridge".into(),
            "-s".into(),
            format!("2,virtio-net,{},mac={}", self.tap, self.mac),
            "-s".into(),
            format!("3,virtio-blk,{}", self.disk.display()),
            "-s".into(),
            "31,lpc".into(),
            "-l".into(),
            format!("com1,{}", self.console),
            "-l".into(),
            format!("bootrom,{}", self.bootrom.display()),
        ]
    }
}

/// How guest memory is brought back from a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryRestore {
    /// Stock bhyve: read the memory file into private anonymous memory.
    Copy,
    /// Patched bhyve (`patches/`): map the memory file copy-on-write.
    Vnode,
}

/// Cold boot of a template guest (the one that becomes the checkpoint).
pub fn boot(guest: &GuestConfig) -> Cmd {
    let mut args = guest.bhyve_args();
    args.push(guest.name.clone());
    Cmd::new("bhyve", args)
}

/// Restore a guest from `checkpoint` (the memory file's path).
pub fn restore(guest: &GuestConfig, checkpoint: &std::path::Path, memory: MemoryRestore) -> Cmd {
    let mut args = guest.bhyve_args();
    args.push("-r".into());
    args.push(checkpoint.display().to_string());
    if memory == MemoryRestore::Vnode {
        args.push("-o".into());
        args.push("snapshot.vnode_restore=true".into());
    }
    args.push(guest.name.clone());
    Cmd::new("bhyve", args)
}

/// Save the guest to `checkpoint` and let its bhyve exit.
pub fn suspend(name: &str, checkpoint: &std::path::Path) -> Cmd {
    Cmd::new("bhyvectl", [format!("--vm={name}"), format!("--suspend={}", checkpoint.display())])
}

/// Remove the vmm(4) instance (after its bhyve has exited or was killed).
pub fn destroy_vm(name: &str) -> Cmd {
    Cmd::new("bhyvectl", [format!("--vm={name}"), "--destroy".to_string()])
}

/// vmm.ko allows `4 * ncpu` VMs per user by default; a pool of a thousand
/// guests needs more.
pub fn raise_vm_limit(max_vms: u32) -> Cmd {
    Cmd::new("sysctl", [format!("hw.vmm.maxvmms={max_vms}")])
}

/// Host NIC of a guest, attached to the pool's bridge as a private member
/// so guests cannot reach each other.
pub fn create_tap(tap: &str, bridge: &str) -> Vec<Cmd> {
    vec![
        Cmd::new("ifconfig", [tap, "create"]),
        Cmd::new("ifconfig", [bridge, "addm", tap, "private", tap]),
        Cmd::new("ifconfig", [tap, "up"]),
    ]
}

pub fn destroy_tap(tap: &str) -> Cmd {
    Cmd::new("ifconfig", [tap, "destroy"])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn guest() -> GuestConfig {
        GuestConfig {
            name: "copse-g17".into(),
            cpus: 1,
            memory_mb: 256,
            bootrom: "/usr/local/share/uefi-firmware/BHYVE_UEFI.fd".into(),
            disk: "/dev/zvol/zroot/copse/vm/g17".into(),
            tap: "tap17".into(),
            mac: "58:9c:fc:00:00:11".into(),
            console: "/dev/nmdm17A".into(),
        }
    }

    const HW: &str = "-A -H -P -c 1 -m 256M -s 0,hostbridge -s 2,virtio-net,tap17,mac=58:9c:fc:00:00:11 \
                      -s 3,virtio-blk,/dev/zvol/zroot/copse/vm/g17 -s 31,lpc -l com1,/dev/nmdm17A \
                      -l bootrom,/usr/local/share/uefi-firmware/BHYVE_UEFI.fd";

    #[test]
    fn boot_line() {
        assert_eq!(boot(&guest()).to_string(), format!("bhyve {HW} copse-g17"));
    }

    #[test]
    fn vnode_restore_line() {
        let cmd = restore(&guest(), Path::new("/zroot/copse/ckp/python.ckp"), MemoryRestore::Vnode);
        assert_eq!(
            cmd.to_string(),
            format!("bhyve {HW} -r /zroot/copse/ckp/python.ckp -o snapshot.vnode_restore=true copse-g17")
        );
    }

    #[test]
    fn copy_restore_line_is_stock_bhyve() {
        let cmd = restore(&guest(), Path::new("/c/p.ckp"), MemoryRestore::Copy);
        assert_eq!(cmd.to_string(), format!("bhyve {HW} -r /c/p.ckp copse-g17"));
    }

    #[test]
    fn restore_keeps_the_boot_device_list() {
        let boot = boot(&guest());
        let restore = restore(&guest(), Path::new("/c/p.ckp"), MemoryRestore::Vnode);
        let devices = |c: &Cmd| c.args.windows(2).filter(|w| w[0] == "-s").map(|w| w[1].clone()).collect::<Vec<_>>();
        assert_eq!(devices(&boot), devices(&restore));
    }

    #[test]
    fn control_lines() {
        assert_eq!(
            suspend("copse-tpl-python", Path::new("/c/python.ckp")).to_string(),
            "bhyvectl --vm=copse-tpl-python --suspend=/c/python.ckp"
        );
        assert_eq!(destroy_vm("copse-g17").to_string(), "bhyvectl --vm=copse-g17 --destroy");
        assert_eq!(raise_vm_limit(1100).to_string(), "sysctl hw.vmm.maxvmms=1100");
        let tap: Vec<String> = create_tap("tap17", "copsebr0").iter().map(ToString::to_string).collect();
        assert_eq!(tap, ["ifconfig tap17 create", "ifconfig copsebr0 addm tap17 private tap17", "ifconfig tap17 up"]);
        assert_eq!(destroy_tap("tap17").to_string(), "ifconfig tap17 destroy");
    }
}
