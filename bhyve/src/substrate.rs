//! bhyve microVMs behind `copse_substrate::Substrate`.
//!
//! A template is a guest disk image booted once and checkpointed
//! ([`PoolLayout::build_template`]). Each template has a [`Pool`]; create
//! checks a slot out of it (prewarm: SIGCONT of a restored, stopped guest;
//! durable: a vnode restore of a prepared slot), destroy gives it back (the
//! slot is destroyed and the stock refilled). Snapshots are bhyve
//! checkpoints plus a copy of the disk, so they keep memory.
//!
//! How the gateway reaches a guest's agent: every restored guest first gets
//! a fresh identity (MAC, address, hostname, machine id, RNG seed) as one
//! JSON line on its serial console, the only channel unique to one guest
//! while all clones still share the template's address; then the agent
//! answers on `<guest address>:49983` on the pool's private bridge, and a
//! [`Relay`] connects `SandboxSpec::agent_socket` to it. The guest writes
//! no reply: moving to its new address is its last step, so `/health`
//! answering there is the acknowledgement. The guest image must run
//! `copse-agent guest`, which does both (see bhyve/README.md).
//!
//! Every command comes from [`crate::plan`]/[`crate::command`] and every
//! slot transition from [`crate::pool`]; this module sequences them over a
//! [`Host`]. Calls are serialised by one lock.

use std::collections::{BTreeMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, anyhow, bail};
use copse_substrate::template::{Backend, check_backend, validate_name};
use copse_substrate::{
    Capabilities, Placement, Progress, Recipe, Recovery, SandboxSpec, SnapshotInfo, Substrate, SubstrateError, Support,
    TemplateInfo, Usage,
};
use serde::{Deserialize, Serialize};

use crate::archive;
use crate::checkpoint::{CheckpointFiles, CheckpointMeta, memory_file_bytes};
use crate::command::{self, Cmd, MemoryRestore};
use crate::host::{Host, Signal};
use crate::identity::{self, GuestNet};
use crate::plan::{PoolLayout, console_peer};
use crate::pool::{Action, Input, Pool, PoolError, PoolKind, SlotId, SlotState};
use crate::relay::{AGENT_PORT, Relay};

/// Slots of sandboxes made from snapshots are not pool slots; their ids
/// start here so VM names, taps and MACs (low 32 bits) never collide.
const ONE_OFF_SLOTS: SlotId = 0x8000_0000;

/// Host settings of the bhyve backend.
#[derive(Debug, Clone)]
pub struct BhyveConfig {
    /// Templates, checkpoints, snapshots and the state file.
    pub state_dir: PathBuf,
    pub zfs_root: String,
    pub bridge: String,
    pub bootrom: PathBuf,
    pub cpus: u32,
    pub memory_mb: u64,
    /// Size of a template's disk (the image is written onto it).
    pub disk_bytes: u64,
    pub kind: PoolKind,
    /// Slots each template's pool keeps in stock (at least one).
    pub stock: usize,
    /// The pool network: the host is `.1`, the template guest `.2` (the
    /// address baked into every checkpoint), sandboxes from `.3`; a /16.
    pub subnet: Ipv4Addr,
    pub agent_timeout: Duration,
}

impl BhyveConfig {
    /// Defaults under `data_dir/bhyve`, overridable by `COPSE_BHYVE_*`.
    pub fn from_env(data_dir: &Path) -> Self {
        let var = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_string());
        Self {
            state_dir: data_dir.join("bhyve"),
            zfs_root: var("COPSE_BHYVE_ZFS_ROOT", "zroot/copse/vm"),
            bridge: var("COPSE_BHYVE_BRIDGE", "copsevm0"),
            bootrom: var("COPSE_BHYVE_BOOTROM", "/usr/local/share/uefi-firmware/BHYVE_UEFI.fd").into(),
            cpus: 1,
            memory_mb: 256,
            disk_bytes: 8 << 30,
            kind: match var("COPSE_BHYVE_POOL", "durable").as_str() {
                "prewarm" => PoolKind::Prewarm,
                "durable-prewarm" => PoolKind::DurablePrewarm,
                _ => PoolKind::Durable,
            },
            stock: 1,
            subnet: Ipv4Addr::new(10, 78, 0, 0),
            agent_timeout: Duration::from_secs(60),
        }
    }

    fn address(&self, index: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.subnet) + index)
    }
}

/// Address indices within the subnet.
const HOST_ADDRESS: u32 = 1;
const TEMPLATE_ADDRESS: u32 = 2;
const FIRST_GUEST_ADDRESS: u32 = 3;

/// One slot that exists on the host (disk clone and NIC, maybe a bhyve).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SlotRecord {
    template: String,
    slot: SlotId,
    pid: Option<u32>,
    address: Option<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct SandboxRecord {
    template: String,
    slot: SlotId,
    agent_socket: PathBuf,
    paused: bool,
    /// Checked out of the template's pool (else a one-off slot).
    pooled: bool,
}

/// What survives a gateway restart (`state.json`).
#[derive(Debug, Default, Serialize, Deserialize)]
struct Saved {
    slots: BTreeMap<String, SlotRecord>,
    sandboxes: BTreeMap<String, SandboxRecord>,
    next_one_off: SlotId,
}

#[derive(Default)]
struct State {
    saved: Saved,
    pools: BTreeMap<String, Pool>,
    relays: BTreeMap<String, Relay>,
}

fn slot_key(template: &str, slot: SlotId) -> String {
    format!("{template}-{slot}")
}

#[derive(Debug, Serialize, Deserialize)]
struct SnapshotRecord {
    template: String,
    size_bytes: u64,
}

pub struct BhyveSubstrate<H: Host> {
    config: BhyveConfig,
    host: H,
    state: Mutex<State>,
}

impl<H: Host> BhyveSubstrate<H> {
    pub fn open(config: BhyveConfig, host: H) -> anyhow::Result<Self> {
        for dir in ["templates", "checkpoints", "images", "snapshots"] {
            let path = config.state_dir.join(dir);
            std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        }
        let file = config.state_dir.join("state.json");
        let saved = match std::fs::read(&file) {
            Ok(bytes) => serde_json::from_slice(&bytes).with_context(|| format!("reading {}", file.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Saved::default(),
            Err(e) => return Err(e).with_context(|| format!("reading {}", file.display())),
        };
        Ok(Self { config, host, state: Mutex::new(State { saved, ..State::default() }) })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn save(&self, state: &State) -> anyhow::Result<()> {
        let file = self.config.state_dir.join("state.json");
        let tmp = file.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(&state.saved)?)?;
        std::fs::rename(&tmp, &file).with_context(|| format!("writing {}", file.display()))
    }

    fn layout(&self, template: &str) -> PoolLayout {
        PoolLayout {
            template: template.to_string(),
            zfs_root: self.config.zfs_root.clone(),
            checkpoint_dir: self.config.state_dir.join("checkpoints"),
            bridge: self.config.bridge.clone(),
            bootrom: self.config.bootrom.clone(),
            cpus: self.config.cpus,
            memory_mb: self.config.memory_mb,
        }
    }

    fn snapshot_dir(&self, snapshot: &str) -> PathBuf {
        self.config.state_dir.join("snapshots").join(snapshot)
    }

    fn template_file(&self, name: &str) -> PathBuf {
        self.config.state_dir.join("templates").join(format!("{name}.json"))
    }

    fn agent_addr(&self, index: u32) -> SocketAddr {
        SocketAddr::new(IpAddr::V4(self.config.address(index)), AGENT_PORT)
    }

    fn free_address(state: &State) -> u32 {
        let used: Vec<u32> = state.saved.slots.values().filter_map(|s| s.address).collect();
        (FIRST_GUEST_ADDRESS..).find(|a| !used.contains(a)).expect("addresses are plentiful")
    }

    /// Start `slot` from `checkpoint`, give it an identity, wait for its
    /// agent. On failure the process is killed; the slot stays for its
    /// owner to destroy.
    fn restore(
        &self,
        state: &mut State,
        layout: &PoolLayout,
        slot: SlotId,
        checkpoint: &Path,
        hostname: &str,
    ) -> anyhow::Result<()> {
        check_checkpoint(checkpoint)?;
        let guest = layout.slot_guest(slot);
        let address = Self::free_address(state);
        let pid = self.host.spawn(&command::restore(&guest, checkpoint, MemoryRestore::Vnode))?;
        let record = SlotRecord { template: layout.template.clone(), slot, pid: Some(pid), address: Some(address) };
        state.saved.slots.insert(slot_key(&layout.template, slot), record);
        let net = GuestNet {
            mac: guest.mac.clone(),
            address: format!("{}/16", self.config.address(address)),
            gateway: self.config.address(HOST_ADDRESS).to_string(),
        };
        let identity = identity::generate(hostname, net, &mut rand::rng());
        let ready = self
            .host
            .send_console(&console_peer(&guest.console), &identity.control_line())
            .and_then(|()| self.host.wait_agent(self.agent_addr(address), self.config.agent_timeout));
        if let Err(e) = ready {
            let _ = self.host.signal(pid, Signal::Kill);
            return Err(e.context(format!("restoring {}", guest.name)));
        }
        Ok(())
    }

    /// Kill the slot's bhyve and remove everything it owns.
    fn teardown(&self, state: &mut State, template: &str, slot: SlotId) -> anyhow::Result<()> {
        if let Some(pid) = state.saved.slots.get(&slot_key(template, slot)).and_then(|s| s.pid) {
            let _ = self.host.signal(pid, Signal::Kill);
        }
        self.host.run(&self.layout(template).destroy_slot(slot))?;
        state.saved.slots.remove(&slot_key(template, slot));
        Ok(())
    }

    /// Carry out pool actions until none are left, feeding the results back.
    /// `hostname` names the guest a waiting caller is handed.
    fn drive(&self, state: &mut State, template: &str, actions: Vec<Action>, hostname: &str) -> anyhow::Result<()> {
        let layout = self.layout(template);
        let mut queue = VecDeque::from(actions);
        while let Some(action) = queue.pop_front() {
            let (slot, outcome) = match action {
                Action::Prepare(slot) => {
                    state.saved.slots.insert(
                        slot_key(template, slot),
                        SlotRecord { template: template.into(), slot, pid: None, address: None },
                    );
                    (slot, self.host.run(&layout.prepare_slot(slot)).map(|()| Input::PrepareDone))
                }
                Action::Restore { slot, stop } => {
                    let name = if stop { layout.slot_guest(slot).name } else { hostname.to_string() };
                    let restored =
                        self.restore(state, &layout, slot, &layout.checkpoint(), &name).and_then(|()| {
                            match (stop, self.pid(state, template, slot)) {
                                (true, Some(pid)) => self.host.signal(pid, Signal::Stop),
                                _ => Ok(()),
                            }
                        });
                    (slot, restored.map(|()| Input::RestoreDone))
                }
                Action::Continue(slot) => {
                    let pid =
                        self.pid(state, template, slot).ok_or_else(|| anyhow!("warm slot {slot} has no bhyve"))?;
                    self.host.signal(pid, Signal::Cont)?;
                    continue;
                }
                Action::Destroy(slot) => (slot, self.teardown(state, template, slot).map(|()| Input::Destroyed)),
            };
            let input = outcome.unwrap_or_else(|e| {
                eprintln!("bhyve pool {template}, slot {slot}: {e:#}");
                Input::Failed
            });
            let pool = state.pools.get_mut(template).expect("driven pools exist");
            queue.extend(pool.apply(slot, input)?);
            if input == Input::PrepareDone {
                queue.extend(pool.refill());
            }
        }
        self.save(state)
    }

    fn pid(&self, state: &State, template: &str, slot: SlotId) -> Option<u32> {
        state.saved.slots.get(&slot_key(template, slot)).and_then(|s| s.pid)
    }

    fn pool<'a>(&self, state: &'a mut State, template: &str) -> &'a mut Pool {
        state.pools.entry(template.to_string()).or_insert_with(|| {
            let mut pool = Pool::new(template, self.config.kind);
            pool.target = self.config.stock.max(1);
            pool
        })
    }

    fn sandbox(state: &State, id: &str) -> anyhow::Result<SandboxRecord> {
        state
            .saved
            .sandboxes
            .get(id)
            .cloned()
            .ok_or_else(|| SubstrateError::NotFound(format!("no bhyve sandbox {id}")).into())
    }

    fn placement(&self, state: &State, template: &str, slot: SlotId) -> anyhow::Result<Placement> {
        let pid = self.pid(state, template, slot).ok_or_else(|| anyhow!("slot {slot} has no bhyve"))?;
        Ok(Placement { init_pid: i32::try_from(pid)?, init_start: slot })
    }

    fn attach(&self, state: &mut State, spec: &SandboxSpec, slot: SlotId, pooled: bool) -> anyhow::Result<Placement> {
        let address = state
            .saved
            .slots
            .get(&slot_key(&spec.template, slot))
            .and_then(|s| s.address)
            .ok_or_else(|| anyhow!("slot {slot} has no address"))?;
        state.relays.insert(spec.id.clone(), Relay::start(&spec.agent_socket, self.agent_addr(address))?);
        let record = SandboxRecord {
            template: spec.template.clone(),
            slot,
            agent_socket: spec.agent_socket.clone(),
            paused: false,
            pooled,
        };
        state.saved.sandboxes.insert(spec.id.clone(), record);
        self.save(state)?;
        self.placement(state, &spec.template, slot)
    }

    fn create_from_pool(&self, state: &mut State, spec: &SandboxSpec) -> anyhow::Result<Placement> {
        if !self.template_file(&spec.template).exists() {
            return Err(SubstrateError::NotFound(format!("no bhyve template {}", spec.template)).into());
        }
        let checkout = match self.pool(state, &spec.template).checkout() {
            Err(PoolError::Empty) => {
                let refill = self.pool(state, &spec.template).refill();
                self.drive(state, &spec.template, refill, &spec.id)?;
                self.pool(state, &spec.template).checkout()
            }
            other => other,
        };
        let (slot, actions) = checkout?;
        self.drive(state, &spec.template, actions, &spec.id)?;
        if self.pool(state, &spec.template).state(slot) != Some(SlotState::CheckedOut) {
            bail!("bhyve template {}: slot {slot} could not be restored", spec.template);
        }
        self.attach(state, spec, slot, true)
    }

    fn create_from_snapshot(&self, state: &mut State, spec: &SandboxSpec, snapshot: &str) -> anyhow::Result<Placement> {
        let record = self.snapshot_record(snapshot)?;
        if record.template != spec.template {
            return Err(SubstrateError::Invalid(format!(
                "snapshot {snapshot} is of template {}, not {}",
                record.template, spec.template
            ))
            .into());
        }
        let slot = ONE_OFF_SLOTS + state.saved.next_one_off;
        state.saved.next_one_off += 1;
        let layout = self.layout(&spec.template);
        state.saved.slots.insert(
            slot_key(&spec.template, slot),
            SlotRecord { template: spec.template.clone(), slot, pid: None, address: None },
        );
        let (send, recv, tap) = layout.prepare_slot_from(slot, snapshot);
        let checkpoint = self.snapshot_dir(snapshot).join(archive::FILES[0]);
        let made = self
            .host
            .pipe(&send, &recv)
            .and_then(|()| self.host.run(&tap))
            .and_then(|()| self.restore(state, &layout, slot, &checkpoint, &spec.id))
            .and_then(|()| self.attach(state, spec, slot, false));
        if made.is_err() {
            let _ = self.teardown(state, &spec.template, slot);
            let _ = self.save(state);
        }
        made
    }

    fn destroy_locked(&self, state: &mut State, id: &str) -> anyhow::Result<()> {
        state.relays.remove(id);
        let Some(sandbox) = state.saved.sandboxes.remove(id) else { return Ok(()) };
        let _ = std::fs::remove_file(&sandbox.agent_socket);
        if sandbox.pooled && state.pools.contains_key(&sandbox.template) {
            let actions = self.pool(state, &sandbox.template).give_back(sandbox.slot)?;
            self.drive(state, &sandbox.template, actions, id)
        } else {
            self.teardown(state, &sandbox.template, sandbox.slot)?;
            self.save(state)
        }
    }

    fn snapshot_record(&self, snapshot: &str) -> anyhow::Result<SnapshotRecord> {
        let file = self.snapshot_dir(snapshot).join("snapshot.json");
        let bytes = std::fs::read(&file).with_context(|| format!("no bhyve snapshot {snapshot}"))?;
        Ok(serde_json::from_slice(&bytes)?)
    }

    fn write_snapshot_record(&self, snapshot: &str, template: &str) -> anyhow::Result<SnapshotInfo> {
        let dir = self.snapshot_dir(snapshot);
        let size_bytes =
            archive::FILES.iter().filter_map(|f| std::fs::metadata(dir.join(f)).ok()).map(|m| m.len()).sum();
        let record = SnapshotRecord { template: template.to_string(), size_bytes };
        std::fs::write(dir.join("snapshot.json"), serde_json::to_vec(&record)?)?;
        Ok(SnapshotInfo { id: snapshot.to_string(), template: template.to_string(), size_bytes, memory: true })
    }

    fn build(&self, recipe: &Recipe, progress: Progress<'_>) -> anyhow::Result<()> {
        let image = self.config.state_dir.join("images").join(format!("{}.img", recipe.name));
        if !image.is_file() {
            bail!(
                "bhyve template {}: no guest image at {} (a disk image whose system comes up at {} and starts \
                 `copse-agent guest`, which serves TCP {AGENT_PORT} and applies the console identity line)",
                recipe.name,
                image.display(),
                self.config.address(TEMPLATE_ADDRESS)
            );
        }
        if !recipe.packages.is_empty() || !recipe.post_install.is_empty() {
            progress("the bhyve backend boots the image as it is: the recipe's packages and commands must be in it");
        }
        let layout = self.layout(&recipe.name);
        let build = layout.build_template();
        progress("[1/4] template disk and NIC");
        self.host.run(&build.prepare)?;
        self.host.run(&layout.import_image(&image, self.config.disk_bytes))?;
        progress("[2/4] booting the template guest");
        let pid = self.host.spawn(&build.boot)?;
        progress("[3/4] waiting for its agent");
        let ready = self.host.wait_agent(self.agent_addr(TEMPLATE_ADDRESS), self.config.agent_timeout);
        if let Err(e) = ready {
            let _ = self.host.signal(pid, Signal::Kill);
            let _ = self.host.run(&[command::destroy_vm(&layout.template_guest().name).allow_failure()]);
            return Err(e.context("the template guest's agent never answered"));
        }
        progress("[4/4] checkpoint (bhyvectl --suspend) and disk snapshot");
        self.host.run(&build.seal[..1])?;
        self.host.wait_exit(pid, self.config.agent_timeout)?;
        self.host.run(&build.seal[1..])?;
        check_checkpoint(&layout.checkpoint())
    }
}

/// The checks a vnode restore needs, before anything is spawned.
fn check_checkpoint(memory: &Path) -> anyhow::Result<()> {
    let files = CheckpointFiles::at(memory);
    let meta = CheckpointMeta::read(&files).with_context(|| format!("checkpoint {}", memory.display()))?;
    meta.check_vnode_restore(memory_file_bytes(&files.memory)?)?;
    Ok(())
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

impl<H: Host> Substrate for BhyveSubstrate<H> {
    fn name(&self) -> &'static str {
        "bhyve"
    }

    fn templates(&self) -> anyhow::Result<Vec<TemplateInfo>> {
        let mut all = Vec::new();
        for entry in std::fs::read_dir(self.config.state_dir.join("templates"))? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "json") {
                all.push(serde_json::from_slice(&std::fs::read(&path)?)?);
            }
        }
        Ok(all)
    }

    fn ensure_template(&self, recipe: &Recipe, progress: Progress<'_>) -> anyhow::Result<TemplateInfo> {
        check_backend(recipe, &[Backend::Bhyve])?;
        validate_name(&recipe.name).map_err(SubstrateError::Invalid)?;
        let _state = self.lock();
        if let Ok(bytes) = std::fs::read(self.template_file(&recipe.name)) {
            return Ok(serde_json::from_slice(&bytes)?);
        }
        self.build(recipe, progress)?;
        let info = TemplateInfo {
            name: recipe.name.clone(),
            built_at: now(),
            size_bytes: self.config.disk_bytes,
            backend: Backend::Bhyve,
            recipe: recipe.fingerprint(),
        };
        std::fs::write(self.template_file(&recipe.name), serde_json::to_vec(&info)?)?;
        progress(&format!("bhyve template {} ready", recipe.name));
        Ok(info)
    }

    fn create(&self, spec: &SandboxSpec) -> anyhow::Result<Placement> {
        validate_name(&spec.id).map_err(SubstrateError::Invalid)?;
        // The guests sit on the pool's own network, where no egress policy
        // is enforced: a sandbox asking for one is refused, never left open.
        if spec.network.as_ref().is_some_and(|n| n.policy != copse_substrate::Policy::open()) {
            return Err(SubstrateError::Unsupported(format!(
                "sandbox {}: the bhyve backend cannot restrict egress; create it with open internet access",
                spec.id
            ))
            .into());
        }
        let mut state = self.lock();
        if state.saved.sandboxes.contains_key(&spec.id) {
            bail!("bhyve sandbox {} exists", spec.id);
        }
        match &spec.snapshot {
            Some(snapshot) => self.create_from_snapshot(&mut state, spec, snapshot),
            None => self.create_from_pool(&mut state, spec),
        }
    }

    fn destroy(&self, id: &str) -> anyhow::Result<()> {
        let mut state = self.lock();
        self.destroy_locked(&mut state, id)
    }

    fn is_alive(&self, id: &str, placement: &Placement) -> bool {
        let state = self.lock();
        let Some(sandbox) = state.saved.sandboxes.get(id) else { return false };
        sandbox.slot == placement.init_start
            && self.pid(&state, &sandbox.template, sandbox.slot).is_some_and(|pid| self.host.alive(pid))
    }

    /// Guest memory as configured; bhyve's own accounting (resident pages
    /// of the process) is not read yet.
    fn usage(&self, id: &str) -> anyhow::Result<Usage> {
        Self::sandbox(&self.lock(), id)?;
        Ok(Usage { memory_bytes: self.config.memory_mb << 20, ..Usage::default() })
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { memory_snapshots: Support::Yes }
    }

    fn pause(&self, id: &str) -> anyhow::Result<()> {
        self.set_paused(id, true)
    }

    fn resume(&self, id: &str) -> anyhow::Result<()> {
        self.set_paused(id, false)
    }

    /// A bhyve checkpoint always holds memory: a files-only request gets
    /// more than it asked for, never less.
    fn snapshot(&self, id: &str, snapshot_id: &str, _memory: bool) -> anyhow::Result<SnapshotInfo> {
        validate_name(snapshot_id).map_err(SubstrateError::Invalid)?;
        let mut state = self.lock();
        let sandbox = Self::sandbox(&state, id)?;
        let pid = self.pid(&state, &sandbox.template, sandbox.slot).ok_or_else(|| anyhow!("{id} has no bhyve"))?;
        let dir = self.snapshot_dir(snapshot_id);
        std::fs::create_dir_all(&dir)?;
        let layout = self.layout(&sandbox.template);
        let plan = layout.snapshot_slot(sandbox.slot, snapshot_id, &dir.join(archive::FILES[0]));
        if sandbox.paused {
            // bhyvectl talks to the bhyve process, which must be running.
            self.host.signal(pid, Signal::Cont)?;
        }
        let stop_paused = |pid| if sandbox.paused { self.host.signal(pid, Signal::Stop) } else { Ok(()) };
        if let Err(e) = self.host.run(std::slice::from_ref(&plan.suspend)) {
            let _ = stop_paused(pid);
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        let saved = self
            .host
            .wait_exit(pid, self.config.agent_timeout)
            .and_then(|()| self.host.run(&plan.disk))
            .and_then(|()| self.host.pipe(&plan.send, &plan.recv));
        self.host.run(&plan.cleanup)?;
        // The same guest goes on from the checkpoint just written, whether
        // the disk copy worked or not.
        let new_pid = self.host.spawn(&plan.restart)?;
        if let Some(slot) = state.saved.slots.get_mut(&slot_key(&sandbox.template, sandbox.slot)) {
            slot.pid = Some(new_pid);
        }
        self.save(&state)?;
        stop_paused(new_pid)?;
        if let Err(e) = saved {
            let _ = self.host.run(&[layout.delete_snapshot(snapshot_id)]);
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        self.write_snapshot_record(snapshot_id, &sandbox.template)
    }

    fn snapshots(&self) -> anyhow::Result<Vec<SnapshotInfo>> {
        let mut all = Vec::new();
        for entry in std::fs::read_dir(self.config.state_dir.join("snapshots"))? {
            let id = entry?.file_name().to_string_lossy().into_owned();
            if let Ok(record) = self.snapshot_record(&id) {
                all.push(SnapshotInfo { id, template: record.template, size_bytes: record.size_bytes, memory: true });
            }
        }
        Ok(all)
    }

    /// Sandboxes restored from it keep running: their memory maps the
    /// checkpoint file, which stays alive while mapped, and their disks are
    /// copies.
    fn delete_snapshot(&self, snapshot_id: &str) -> anyhow::Result<()> {
        if validate_name(snapshot_id).is_err() {
            return Ok(());
        }
        let _state = self.lock();
        let Ok(record) = self.snapshot_record(snapshot_id) else { return Ok(()) };
        self.host.run(&[self.layout(&record.template).delete_snapshot(snapshot_id)])?;
        std::fs::remove_dir_all(self.snapshot_dir(snapshot_id))?;
        Ok(())
    }

    /// Memory, processes and files all come back: the sandbox is restored
    /// from the snapshot's checkpoint under the same id.
    fn rollback(&self, spec: &SandboxSpec, snapshot_id: &str) -> anyhow::Result<Placement> {
        self.snapshot_record(snapshot_id)?;
        let mut state = self.lock();
        self.destroy_locked(&mut state, &spec.id)?;
        self.create_from_snapshot(&mut state, spec, snapshot_id)
    }

    fn export_snapshot(&self, snapshot_id: &str, out: &mut dyn std::io::Write) -> anyhow::Result<()> {
        let record = self.snapshot_record(snapshot_id)?;
        archive::write_head(out, &record.template, &self.snapshot_dir(snapshot_id))?;
        let (send, _) = self.layout(&record.template).snapshot_stream(snapshot_id);
        self.host.run_into(&send, out)
    }

    fn import_snapshot(&self, snapshot_id: &str, input: &mut dyn std::io::Read) -> anyhow::Result<SnapshotInfo> {
        validate_name(snapshot_id).map_err(SubstrateError::Invalid)?;
        let dir = self.snapshot_dir(snapshot_id);
        if dir.exists() {
            bail!("bhyve snapshot {snapshot_id} exists");
        }
        std::fs::create_dir_all(&dir)?;
        let imported = archive::read_head(input, &dir).and_then(|template| {
            let (_, recv) = self.layout(&template).snapshot_stream(snapshot_id);
            self.host.run_from(&recv, input)?;
            self.write_snapshot_record(snapshot_id, &template)
        });
        if imported.is_err() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        imported
    }

    fn recover(&self, known: &[(String, Placement)]) -> anyhow::Result<Recovery> {
        let mut state = self.lock();
        let mut recovery = Recovery::default();
        let ids: Vec<String> = state.saved.sandboxes.keys().cloned().collect();
        for id in ids {
            let sandbox = state.saved.sandboxes[&id].clone();
            let pid = self.pid(&state, &sandbox.template, sandbox.slot);
            let alive = known.iter().any(|(k, p)| *k == id && p.init_start == sandbox.slot)
                && pid.is_some_and(|pid| self.host.alive(pid));
            let address = state.saved.slots.get(&slot_key(&sandbox.template, sandbox.slot)).and_then(|s| s.address);
            match address.filter(|_| alive) {
                Some(address) => {
                    state.relays.insert(id.clone(), Relay::start(&sandbox.agent_socket, self.agent_addr(address))?);
                    recovery.adopted.push(id);
                }
                None => {
                    state.saved.sandboxes.remove(&id);
                    let _ = std::fs::remove_file(&sandbox.agent_socket);
                    recovery.removed.push(id);
                }
            }
        }
        // Pools start afresh: every slot no adopted sandbox holds goes, and
        // adopted pool slots stay checked out of their template's new pool.
        let held: BTreeMap<String, (String, SlotId, bool)> = state
            .saved
            .sandboxes
            .values()
            .map(|s| (slot_key(&s.template, s.slot), (s.template.clone(), s.slot, s.pooled)))
            .collect();
        let spare: Vec<SlotRecord> =
            state.saved.slots.iter().filter(|(k, _)| !held.contains_key(*k)).map(|(_, s)| s.clone()).collect();
        for slot in spare {
            self.teardown(&mut state, &slot.template, slot.slot)?;
        }
        state.pools.clear();
        for (template, slot, pooled) in held.into_values() {
            let pool = self.pool(&mut state, &template);
            if pooled {
                let found = pool.slot_states().chain([(slot, SlotState::CheckedOut)]).collect::<Vec<_>>();
                *pool = Pool::adopt(template.clone(), self.config.kind, found);
                pool.target = self.config.stock.max(1);
            }
        }
        // bhyve processes and vmm instances of ours that nothing names.
        let live: Vec<String> =
            state.saved.slots.values().map(|s| self.layout(&s.template).slot_guest(s.slot).name).collect();
        let mut stray: Vec<Cmd> = Vec::new();
        for (pid, name) in self.host.bhyve_processes()? {
            if name.starts_with("copse-") && !live.contains(&name) {
                let _ = self.host.signal(pid, Signal::Kill);
                stray.push(command::destroy_vm(&name).allow_failure());
            }
        }
        for name in self.host.vmm_devices()? {
            if name.starts_with("copse-") && !live.contains(&name) {
                stray.push(command::destroy_vm(&name).allow_failure());
            }
        }
        stray.dedup();
        self.host.run(&stray)?;
        self.save(&state)?;
        Ok(recovery)
    }
}

impl<H: Host> BhyveSubstrate<H> {
    fn set_paused(&self, id: &str, paused: bool) -> anyhow::Result<()> {
        let mut state = self.lock();
        let sandbox = Self::sandbox(&state, id)?;
        let pid = self.pid(&state, &sandbox.template, sandbox.slot).ok_or_else(|| anyhow!("{id} has no bhyve"))?;
        // SIGSTOP holds every bhyve thread, vCPUs included.
        self.host.signal(pid, if paused { Signal::Stop } else { Signal::Cont })?;
        if let Some(s) = state.saved.sandboxes.get_mut(id) {
            s.paused = paused;
        }
        self.save(&state)
    }
}

#[cfg(test)]
mod tests;
