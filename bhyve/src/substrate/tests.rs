//! The substrate's sequences as command transcripts, over a host double
//! that plays bhyvectl's part of writing checkpoint files.

use std::collections::BTreeSet;
use std::io::{Read, Write};

use super::*;

#[derive(Default)]
struct FakeHost {
    log: Mutex<Vec<String>>,
    alive: Mutex<BTreeSet<u32>>,
    next_pid: Mutex<u32>,
}

impl FakeHost {
    fn note(&self, line: String) {
        self.log.lock().unwrap().push(line);
    }
}

const META: &str = r#"{"basic metadata": {"ncpus": 1, "vmname": "v", "memsize": 8192, "memflags": 0}, "devices": []}"#;

impl Host for FakeHost {
    fn run(&self, cmds: &[Cmd]) -> anyhow::Result<()> {
        for cmd in cmds {
            if let Some(path) = cmd.args.iter().find_map(|a| a.strip_prefix("--suspend=")) {
                let files = CheckpointFiles::at(path);
                std::fs::write(&files.memory, vec![0u8; 8192])?;
                std::fs::write(&files.kern, b"kern")?;
                std::fs::write(&files.meta, META)?;
            }
            self.note(cmd.to_string());
        }
        Ok(())
    }
    fn spawn(&self, cmd: &Cmd) -> anyhow::Result<u32> {
        let mut next = self.next_pid.lock().unwrap();
        *next += 1;
        self.alive.lock().unwrap().insert(100 + *next);
        self.note(format!("spawn[{}] {cmd}", 100 + *next));
        Ok(100 + *next)
    }
    fn signal(&self, pid: u32, signal: Signal) -> anyhow::Result<()> {
        if signal == Signal::Kill {
            self.alive.lock().unwrap().remove(&pid);
        }
        self.note(format!("{signal:?} {pid}"));
        Ok(())
    }
    fn alive(&self, pid: u32) -> bool {
        self.alive.lock().unwrap().contains(&pid)
    }
    fn wait_exit(&self, pid: u32, _: Duration) -> anyhow::Result<()> {
        self.alive.lock().unwrap().remove(&pid);
        Ok(())
    }
    fn bhyve_processes(&self) -> anyhow::Result<Vec<(u32, String)>> {
        Ok(vec![(999, "copse-stray-9".into())])
    }
    fn vmm_devices(&self) -> anyhow::Result<Vec<String>> {
        Ok(vec!["copse-stray-9".into(), "other".into()])
    }
    fn send_console(&self, console: &str, line: &str) -> anyhow::Result<()> {
        let v: serde_json::Value = serde_json::from_str(line)?;
        self.note(format!("console {console} {} {}", v["hostname"], v["address"]));
        Ok(())
    }
    fn wait_agent(&self, addr: SocketAddr, _: Duration) -> anyhow::Result<()> {
        self.note(format!("agent {addr}"));
        Ok(())
    }
    fn pipe(&self, from: &Cmd, to: &Cmd) -> anyhow::Result<()> {
        self.note(format!("{from} | {to}"));
        Ok(())
    }
    fn run_into(&self, cmd: &Cmd, out: &mut dyn Write) -> anyhow::Result<()> {
        self.note(format!("{cmd} >"));
        out.write_all(b"DISK")?;
        Ok(())
    }
    fn run_from(&self, cmd: &Cmd, input: &mut dyn Read) -> anyhow::Result<()> {
        let mut rest = String::new();
        input.read_to_string(&mut rest)?;
        self.note(format!("{cmd} < {rest}"));
        Ok(())
    }
}

fn substrate(dir: &Path) -> BhyveSubstrate<FakeHost> {
    let mut config = BhyveConfig::from_env(dir);
    config.zfs_root = "zroot/vm".into();
    config.bridge = "br0".into();
    config.bootrom = "/fw".into();
    config.kind = PoolKind::Durable;
    BhyveSubstrate::open(config, FakeHost::default()).unwrap()
}

fn take(s: &BhyveSubstrate<FakeHost>) -> Vec<String> {
    std::mem::take(&mut *s.host.log.lock().unwrap())
}

fn spec(dir: &Path, id: &str, snapshot: Option<&str>) -> SandboxSpec {
    SandboxSpec {
        id: id.into(),
        template: "vm".into(),
        limits: Default::default(),
        agent_socket: dir.join(format!("{id}.sock")),
        snapshot: snapshot.map(Into::into),
        network: None,
        volumes: Vec::new(),
    }
}

fn recipe() -> Recipe {
    Recipe { name: "vm".into(), packages: vec![], post_install: vec![], backend: Backend::Bhyve }
}

/// Lines of `log` that start with `prefix`.
fn grep(log: &[String], prefix: &str) -> Vec<String> {
    log.iter().filter(|l| l.starts_with(prefix)).cloned().collect()
}

#[test]
fn template_build_needs_an_image_then_boots_and_checkpoints_it() {
    let dir = tempfile::tempdir().unwrap();
    let s = substrate(dir.path());
    let err = s.ensure_template(&recipe(), &|_| {}).unwrap_err().to_string();
    assert!(err.contains("no guest image") && err.contains("49983"), "{err}");
    let jail = Recipe { backend: Backend::Jail, ..recipe() };
    assert!(s.ensure_template(&jail, &|_| {}).is_err(), "a jail recipe is not built as a VM");

    std::fs::write(dir.path().join("bhyve/images/vm.img"), b"disk").unwrap();
    let info = s.ensure_template(&recipe(), &|_| {}).unwrap();
    assert_eq!(info.backend, Backend::Bhyve);
    let log = take(&s);
    let ckp = dir.path().join("bhyve/checkpoints/vm.ckp");
    let img = dir.path().join("bhyve/images/vm.img");
    assert_eq!(
        log.iter().map(|l| l.split(" -A ").next().unwrap().to_string()).collect::<Vec<_>>(),
        [
            "zfs destroy -r zroot/vm/vm".to_string(),
            "ifconfig tap0 create".into(),
            "ifconfig br0 addm tap0 private tap0".into(),
            "ifconfig tap0 up".into(),
            "zfs create -V 8589934592 -o volmode=dev zroot/vm/vm".into(),
            format!("dd if={} of=/dev/zvol/zroot/vm/vm bs=1m conv=sparse", img.display()),
            "spawn[101] bhyve".into(),
            "agent 10.78.0.2:49983".into(),
            format!("bhyvectl --vm=copse-vm-tpl --suspend={}", ckp.display()),
            "zfs snapshot zroot/vm/vm@checkpointed".into(),
            "bhyvectl --vm=copse-vm-tpl --destroy".into(),
            "ifconfig tap0 destroy".into(),
        ]
    );
    assert_eq!(s.templates().unwrap(), std::slice::from_ref(&info));
    assert_eq!(s.ensure_template(&recipe(), &|_| {}).unwrap(), info, "a complete build is kept");
    assert!(take(&s).is_empty());
}

#[test]
fn lifecycle_over_the_pool() {
    let dir = tempfile::tempdir().unwrap();
    let s = substrate(dir.path());
    std::fs::write(dir.path().join("bhyve/images/vm.img"), b"disk").unwrap();
    s.ensure_template(&recipe(), &|_| {}).unwrap();
    take(&s);

    // Create: the empty durable pool prepares a slot, checks it out (vnode
    // restore), resets its identity, then prepares the next one.
    let placement = s.create(&spec(dir.path(), "sb1", None)).unwrap();
    assert_eq!(placement, Placement { init_pid: 102, init_start: 1 });
    let log = take(&s);
    assert_eq!(log[0], "zfs clone -o volmode=dev zroot/vm/vm@checkpointed zroot/vm/vm-1");
    assert!(log[4].starts_with("spawn[102] bhyve") && log[4].ends_with("-o snapshot.vnode_restore=true copse-vm-1"));
    assert_eq!(log[5], r#"console /dev/nmdm1001B "sb1" "10.78.0.3/16""#);
    assert_eq!(log[6], "agent 10.78.0.3:49983");
    assert_eq!(log[7], "zfs clone -o volmode=dev zroot/vm/vm@checkpointed zroot/vm/vm-2");
    assert!(dir.path().join("sb1.sock").exists(), "the relay listens on the agent socket");
    assert!(s.is_alive("sb1", &placement));
    assert!(s.capabilities_for("vm").memory_snapshots.is_yes());

    s.pause("sb1").unwrap();
    s.resume("sb1").unwrap();
    assert_eq!(take(&s), ["Stop 102", "Cont 102"]);

    // A snapshot of a paused sandbox: continued for bhyvectl, stopped again
    // once restored from the new checkpoint.
    s.pause("sb1").unwrap();
    take(&s);
    let info = s.snapshot("sb1", "s1", false).unwrap();
    assert_eq!(info.template, "vm");
    let log = take(&s);
    let ckp = dir.path().join("bhyve/snapshots/s1/vm.ckp");
    assert_eq!(log[0], "Cont 102");
    assert_eq!(log[1], format!("bhyvectl --vm=copse-vm-1 --suspend={}", ckp.display()));
    assert_eq!(log[2], "zfs snapshot zroot/vm/vm-1@copse-s1");
    assert_eq!(log[3], "zfs send zroot/vm/vm-1@copse-s1 | zfs recv -u zroot/vm/snapshots/s1@snapshot");
    assert!(log[6].starts_with("spawn[103] bhyve") && log[6].contains(&format!("-r {}", ckp.display())));
    assert_eq!(log[7], "Stop 103");
    assert_eq!(s.snapshots().unwrap(), [info]);

    // From the snapshot: a copied disk, the snapshot's checkpoint, its own
    // identity and address.
    let child = s.create(&spec(dir.path(), "sb2", Some("s1"))).unwrap();
    assert_eq!(child.init_start, ONE_OFF_SLOTS);
    let log = take(&s);
    assert_eq!(log[0], "zfs send zroot/vm/snapshots/s1@snapshot | zfs recv -u -o volmode=dev zroot/vm/vm-2147483648");
    assert_eq!(grep(&log, "console"), [r#"console /dev/nmdm2147484648B "sb2" "10.78.0.4/16""#]);

    // Export and import carry the checkpoint files and the disk stream.
    let mut stream = Vec::new();
    s.export_snapshot("s1", &mut stream).unwrap();
    assert!(stream.ends_with(b"DISK"));
    let imported = s.import_snapshot("s2", &mut stream.as_slice()).unwrap();
    assert_eq!(imported.template, "vm");
    assert_eq!(
        take(&s),
        ["zfs send zroot/vm/snapshots/s1@snapshot >", "zfs recv -u zroot/vm/snapshots/s2@snapshot < DISK"]
    );

    // Rollback restores sb1 from s2 under the same id.
    let rolled = s.rollback(&spec(dir.path(), "sb1", None), "s2").unwrap();
    assert_eq!(rolled.init_start, ONE_OFF_SLOTS + 1);
    let log = take(&s);
    assert_eq!(log[0], "Kill 103");
    assert_eq!(log[1], "bhyvectl --vm=copse-vm-1 --destroy");
    assert!(grep(&log, "zfs send").iter().any(|l| l.contains("snapshots/s2@snapshot")));

    s.delete_snapshot("s1").unwrap();
    assert_eq!(take(&s), ["zfs destroy -r zroot/vm/snapshots/s1"]);
    assert!(s.snapshots().unwrap().iter().all(|x| x.id != "s1"));

    // After a restart: sb1 is known and alive, sb2 is not known; the spare
    // pool slot and a stray VM go.
    let s2 = BhyveSubstrate::open(s.config.clone(), FakeHost::default()).unwrap();
    s2.host.alive.lock().unwrap().extend(s.host.alive.lock().unwrap().iter());
    drop(s);
    let recovery = s2.recover(&[("sb1".into(), rolled.clone())]).unwrap();
    assert_eq!(recovery.adopted, ["sb1"]);
    assert_eq!(recovery.removed, ["sb2"]);
    let log = take(&s2);
    assert!(log.contains(&"zfs destroy zroot/vm/vm-2".to_string()), "{log:?}");
    assert!(log.contains(&"zfs destroy zroot/vm/vm-2147483648".to_string()), "{log:?}");
    assert!(
        log.contains(&"Kill 999".to_string()) && log.contains(&"bhyvectl --vm=copse-stray-9 --destroy".to_string())
    );
    assert!(s2.is_alive("sb1", &rolled));

    s2.destroy("sb1").unwrap();
    s2.destroy("sb1").unwrap();
    assert!(!dir.path().join("sb1.sock").exists());
    assert!(!s2.is_alive("sb1", &rolled));
}

#[test]
fn a_sandbox_asking_for_an_egress_policy_is_refused_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let s = substrate(dir.path());
    std::fs::write(dir.path().join("bhyve/images/vm.img"), b"disk").unwrap();
    s.ensure_template(&recipe(), &|_| {}).unwrap();
    take(&s);
    let closed = copse_substrate::Policy::from_e2b(Some(false), &[], &[], None).unwrap();
    let network = copse_substrate::SandboxNetwork { address: "10.9.0.2".parse().unwrap(), policy: closed };
    let err = s.create(&SandboxSpec { network: Some(network), ..spec(dir.path(), "sb1", None) }).unwrap_err();
    assert!(err.to_string().contains("cannot restrict egress"), "{err:#}");
    assert!(take(&s).is_empty());
}
