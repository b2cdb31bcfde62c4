//! The OS substrate behind every sandbox, as the gateway sees it.
//!
//! The gateway sees only [`Substrate`] and the plain data types in this
//! crate; the backends that implement it (`copse-namespaces` on Linux,
//! `copse-freebsd-jails` and `copse-bhyve` on FreeBSD) are peers, and
//! `copse-host` picks this host's. A substrate owns each privileged step of
//! a sandbox's life (filesystem clone, isolation, limits, teardown) and
//! nothing about the E2B wire protocol. No platform `cfg` lives here.

pub mod error;
pub mod none;
pub mod phases;
pub mod router;
pub mod template;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use copse_cubenet::{EgressCa, Interceptor, NetConfig, Policy, SandboxNetwork, SecretResolver};

pub use error::SubstrateError;
pub use phases::Phases;
pub use router::Router;
pub use template::{Backend, Recipe, TemplateInfo};

/// The host's memory in MiB (see [`Substrate::host_memory`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostMemory {
    pub total_mb: u64,
    pub available_mb: u64,
}

/// Resource limits applied to a whole sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    pub cpu_count: u32,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub pids: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self { cpu_count: 2, memory_mb: 512, disk_mb: 1024, pids: 512 }
    }
}

/// What the gateway asks for when it creates a sandbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxSpec {
    pub id: String,
    pub template: String,
    pub limits: Limits,
    /// Host path of the unix socket the in-sandbox agent will listen on.
    pub agent_socket: PathBuf,
    /// Start from this filesystem snapshot (taken by [`Substrate::snapshot`])
    /// instead of the bare template; `template` must be the snapshot's.
    #[serde(default)]
    pub snapshot: Option<String>,
    /// Put the sandbox on the host's sandbox network, configured before
    /// `create` returns; `None` leaves it with loopback only.
    #[serde(default)]
    pub network: Option<SandboxNetwork>,
    /// Volumes (made by [`Substrate::create_volume`]) mounted read-write in
    /// the sandbox, shared with every other sandbox mounting them.
    #[serde(default)]
    pub volumes: Vec<VolumeMount>,
}

/// A volume's directory on the host, and the host id a sandbox's id 0 is
/// (files in it are owned by sandbox ids shifted by it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeLocation {
    pub root: PathBuf,
    pub id_base: u32,
}

/// One volume at one absolute path inside a sandbox. The gateway has
/// checked the path (absolute, normal, clear of the sandbox's own mounts);
/// the substrate still never follows a link the sandbox planted on the
/// way to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeMount {
    pub volume: String,
    pub path: String,
}

/// Where a running sandbox lives on the host; persisted by the gateway so a
/// restarted gateway can re-adopt the sandbox or tear it down.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Host pid of the sandbox's init (Linux) or jail id (FreeBSD).
    pub init_pid: i32,
    /// A number that changes whenever the id is reused for a new instance,
    /// so a recycled pid or name is never mistaken for the sandbox after a
    /// crash: init's kernel start time on Linux, the clone's ZFS creation
    /// transaction group on FreeBSD.
    pub init_start: u64,
}

/// Resource use of one sandbox, read from the kernel's own accounting.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct Usage {
    /// CPU time consumed since creation, in nanoseconds.
    pub cpu_ns: u64,
    pub memory_bytes: u64,
    pub memory_cache_bytes: u64,
    pub disk_bytes: u64,
}

/// What a substrate found when the gateway started.
#[derive(Debug, Default)]
pub struct Recovery {
    /// Sandboxes the gateway knew that are still alive and usable.
    pub adopted: Vec<String>,
    /// Sandboxes (known or orphaned) that were torn down.
    pub removed: Vec<String>,
}

/// A point-in-time copy of one sandbox's files, kept by the substrate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    pub id: String,
    /// Template the snapshotted sandbox was booted from; sandboxes created
    /// from the snapshot boot from it too.
    pub template: String,
    /// Bytes of files the snapshot holds on top of its template.
    pub size_bytes: u64,
    /// Whether it also holds memory and processes: sandboxes created from
    /// it (or rolled back to it) carry on running where it was taken.
    #[serde(default)]
    pub memory: bool,
}

/// Which lifecycle operations a substrate offers beyond create/destroy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    /// Snapshots that also keep memory and processes ("full" in E2B's
    /// terms). Without it only filesystem snapshots exist, and a request for
    /// a full one must be refused, never silently downgraded.
    pub memory_snapshots: Support,
}

/// Whether a substrate offers a feature on this host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Support {
    Yes,
    /// Not offered by this kind of sandbox (a jail cannot save memory).
    No,
    /// Offered, but this host lacks what it needs: the text says what is
    /// missing and how to install it.
    Missing(String),
}

impl Support {
    pub fn is_yes(&self) -> bool {
        matches!(self, Support::Yes)
    }
}

/// One line of progress from a long operation such as a template build.
pub type Progress<'a> = &'a (dyn Fn(&str) + Send + Sync);

/// The host isolation mechanism. Methods block; the gateway calls them from a
/// blocking thread. Every method that removes something is idempotent.
/// The bytes of a layer image that arrive as they are read (the gateway's
/// object store), for [`Substrate::new_lazy_layer`]'s server.
pub trait ImageSource: Send + Sync {
    fn size(&self) -> u64;
    /// Up to `len` bytes at `offset`, fewer only past the end; an error
    /// when they cannot be had whole and checked.
    fn read_at(&self, offset: u64, len: usize) -> std::io::Result<Vec<u8>>;
}

/// Images of a snapshot's layers, top first, and the template beneath
/// them ([`Substrate::layer_images`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerImages {
    pub template: String,
    pub images: Vec<PathBuf>,
    /// An image of the snapshot's memory checkpoint, if it has one: a
    /// restore elsewhere reads its pages as they are touched.
    pub memory: Option<PathBuf>,
}

/// The memory a lazily fetched snapshot comes with
/// ([`Substrate::import_lazy`]).
pub enum LazyMemory<'a> {
    None,
    /// A checkpoint stream ([`Substrate::export_checkpoint`]), read whole.
    Whole(&'a mut dyn std::io::Read),
    /// A layer from [`Substrate::new_lazy_layer`] whose served image is a
    /// [`LayerImages::memory`]: the restore reads its pages from there.
    Served(String),
}

pub trait Substrate: Send + Sync + 'static {
    /// Short name for logs and `copse version` ("linux-ns", "freebsd-jail").
    fn name(&self) -> &'static str;

    /// Whether sandboxes run here at all: only [`none::NoSandboxes`], an
    /// API front's, says no.
    fn runs_sandboxes(&self) -> bool {
        true
    }

    /// Templates that are built and ready to boot.
    fn templates(&self) -> anyhow::Result<Vec<TemplateInfo>>;

    /// Build `recipe` unless a complete build exists. Reports progress lines.
    fn ensure_template(&self, recipe: &Recipe, progress: Progress<'_>) -> anyhow::Result<TemplateInfo>;

    /// Make `name` a template from a root directory that `fill` writes (an
    /// unpacked OCI image), replacing an earlier one of that name (sandboxes
    /// still running on it keep it). `fingerprint` (the image's digest)
    /// becomes the template's [`TemplateInfo::recipe`]. The directory is the
    /// substrate's, empty, and `fill` must leave only the root in it.
    fn import_template(
        &self,
        name: &str,
        _fingerprint: &str,
        _fill: &mut dyn FnMut(&std::path::Path) -> anyhow::Result<()>,
        _progress: Progress<'_>,
    ) -> anyhow::Result<TemplateInfo> {
        Err(SubstrateError::Unsupported(format!(
            "template {name}: the {} substrate cannot make templates from images yet",
            self.name()
        ))
        .into())
    }

    /// Removes template `name`, one [`Self::import_template`] made, unless
    /// a sandbox or a snapshot still stacks on it: `Ok(false)` then, and
    /// nothing changed. The gateway asks it only of templates it made for
    /// its own builds, never of those copse ships.
    fn delete_template(&self, name: &str) -> anyhow::Result<bool> {
        Err(SubstrateError::Unsupported(format!(
            "template {name}: the {} substrate cannot delete templates",
            self.name()
        ))
        .into())
    }

    /// Boot a sandbox. On error nothing of it is left behind.
    fn create(&self, spec: &SandboxSpec) -> anyhow::Result<Placement>;

    /// [`Self::create`], noting in `phases` where its time went (the create
    /// response's `Server-Timing` carries them). A substrate that does not
    /// time its steps notes nothing.
    fn create_timed(&self, spec: &SandboxSpec, phases: &mut Phases) -> anyhow::Result<Placement> {
        let _ = phases;
        self.create(spec)
    }

    /// Tear down everything a sandbox owns: processes, mounts, limits,
    /// network, private filesystem, agent socket. Unknown ids are a no-op.
    fn destroy(&self, id: &str) -> anyhow::Result<()>;

    /// Whether the sandbox placed at `placement` is still running.
    fn is_alive(&self, id: &str, placement: &Placement) -> bool;

    fn usage(&self, id: &str) -> anyhow::Result<Usage>;

    /// What every template of this substrate offers.
    fn capabilities(&self) -> Capabilities;

    /// The host's memory, total and available to new sandboxes, for a
    /// cluster's placement; `None` where the substrate cannot tell.
    fn host_memory(&self) -> Option<HostMemory> {
        None
    }

    /// What sandboxes of `template` offer; differs from
    /// [`Substrate::capabilities`] only where templates have different
    /// backends (see [`Router`]).
    fn capabilities_for(&self, _template: &str) -> Capabilities {
        self.capabilities()
    }

    /// Stop every process of the sandbox where it stands (memory and state
    /// kept, no CPU used) until [`Substrate::resume`]. Idempotent.
    fn pause(&self, id: &str) -> anyhow::Result<()>;

    /// Let a paused sandbox run again. Idempotent.
    fn resume(&self, id: &str) -> anyhow::Result<()>;

    /// Take a consistent copy of the sandbox's files (its processes are held
    /// still while it is taken) and, with `memory`, of its memory and
    /// processes too, and keep it as `snapshot_id`. The sandbox keeps
    /// running as it was, paused or not. `memory` is only asked of a
    /// substrate whose [`Capabilities::memory_snapshots`] says so.
    fn snapshot(&self, id: &str, snapshot_id: &str, memory: bool) -> anyhow::Result<SnapshotInfo>;

    /// Snapshots this substrate holds.
    fn snapshots(&self) -> anyhow::Result<Vec<SnapshotInfo>>;

    /// Forget a snapshot. Sandboxes already created from it are unaffected.
    /// Unknown ids are a no-op.
    fn delete_snapshot(&self, snapshot_id: &str) -> anyhow::Result<()>;

    /// Put the files of `snapshot_id` in place of the sandbox's own and start
    /// it afresh under the same id (and, with `spec.snapshot` ignored, the
    /// same spec). Memory is not restored unless the substrate has
    /// [`Capabilities::memory_snapshots`].
    fn rollback(&self, spec: &SandboxSpec, snapshot_id: &str) -> anyhow::Result<Placement>;

    /// Write a snapshot as one self-contained stream (to move it to
    /// another host).
    fn export_snapshot(&self, snapshot_id: &str, out: &mut dyn std::io::Write) -> anyhow::Result<()>;

    /// Read a stream written by [`Substrate::export_snapshot`] and keep it as
    /// `snapshot_id`.
    fn import_snapshot(&self, snapshot_id: &str, input: &mut dyn std::io::Read) -> anyhow::Result<SnapshotInfo>;

    /// Filesystem images of snapshot `snapshot_id`'s layers, written under
    /// `into`, for a host that would mount them as they arrive (lazy
    /// fetch); `None` where this substrate cannot mount such images.
    fn layer_images(&self, _snapshot_id: &str, _into: &Path) -> anyhow::Result<Option<LayerImages>> {
        Ok(None)
    }

    /// A new layer of snapshot `snapshot_id` whose image is to be served in
    /// the directory returned (as `fuse/image`, with the local copy as
    /// `image` and `complete` once whole), then taken in by
    /// [`Substrate::import_lazy`]; `None` where images cannot be mounted.
    fn new_lazy_layer(&self, _snapshot_id: &str) -> anyhow::Result<Option<(String, PathBuf)>> {
        Ok(None)
    }

    /// Removes a layer from [`Substrate::new_lazy_layer`] that was not
    /// taken in (its fetch failed part-way), and whatever serves it.
    fn discard_lazy_layer(&self, _layer: &str) -> anyhow::Result<()> {
        Ok(())
    }

    /// The memory checkpoint of snapshot `snapshot_id` alone, as one
    /// stream: what lazy fetch sends whole beside the layers' images.
    fn export_checkpoint(&self, snapshot_id: &str, _out: &mut dyn std::io::Write) -> anyhow::Result<()> {
        Err(SubstrateError::Unsupported(format!("snapshot {snapshot_id}: this substrate sends no checkpoint alone"))
            .into())
    }

    /// Keeps snapshot `snapshot_id` as the lazy `layers` (top first) on
    /// `template`, with its `memory` if it has one. On failure the caller
    /// discards the layers, the memory's too
    /// ([`Substrate::discard_lazy_layer`]).
    fn import_lazy(
        &self,
        snapshot_id: &str,
        _template: &str,
        _layers: &[String],
        _size_bytes: u64,
        _memory: LazyMemory<'_>,
    ) -> anyhow::Result<SnapshotInfo> {
        Err(SubstrateError::Unsupported(format!("snapshot {snapshot_id}: this substrate mounts no layer images"))
            .into())
    }

    /// After a gateway restart: keep the `known` sandboxes that are alive,
    /// destroy the dead ones and every resource that belongs to no known
    /// sandbox.
    fn recover(&self, known: &[(String, Placement)]) -> anyhow::Result<Recovery>;

    /// Replace a running sandbox's egress policy; takes effect on its next
    /// packet, and flows the new policy refuses are cut (on FreeBSD, where
    /// pf passes established flows without the rules, a tightened policy
    /// cuts all of the sandbox's flows).
    fn update_network(&self, id: &str, _policy: &Policy) -> anyhow::Result<()> {
        Err(SubstrateError::Unsupported(format!("sandbox {id}: this substrate has no sandbox network")).into())
    }

    /// Where the egress proxy resolves the secret placeholders of
    /// `network.rules` (the gateway's secrets, which the substrate never
    /// holds). A substrate without the proxy refuses rules instead.
    fn set_secret_resolver(&self, _resolver: SecretResolver) {}

    /// What the egress proxy terminates TLS to a host with `network.rules`
    /// with (the copse egress CA, which the gateway keeps). Until it is
    /// set, such connections are refused.
    fn set_interceptor(&self, _interceptor: std::sync::Arc<Interceptor>) {}

    /// After [`Substrate::recover`]: make the network hold exactly the
    /// `known` (re-adopted) sandboxes' attachments, removing every other.
    fn recover_network(&self, _known: &[(String, SandboxNetwork)]) -> anyhow::Result<()> {
        Ok(())
    }

    /// Returns once teardown that [`Substrate::destroy`] left to run in the
    /// background is done; called before the gateway exits, so nothing of
    /// a destroyed sandbox outlives it. Lazily fetched layers no sandbox
    /// stacks on are unmounted too, ending their servers.
    fn settle(&self) {}

    /// Makes persistent volume `id`, holding at most `limit_bytes`.
    /// Idempotent.
    fn create_volume(&self, id: &str, _limit_bytes: u64) -> anyhow::Result<()> {
        Err(SubstrateError::Unsupported(format!("volume {id}: {} has no volumes", self.name())).into())
    }

    /// Deletes volume `id` and everything in it. Idempotent.
    fn delete_volume(&self, id: &str) -> anyhow::Result<()> {
        Err(SubstrateError::Unsupported(format!("volume {id}: {} has no volumes", self.name())).into())
    }

    /// Where volume `id`'s files are on the host, for the content API.
    fn volume_location(&self, id: &str) -> anyhow::Result<VolumeLocation> {
        Err(SubstrateError::Unsupported(format!("volume {id}: {} has no volumes", self.name())).into())
    }

    /// Bytes volume `id` holds, as its quota counts them.
    fn volume_used(&self, id: &str) -> anyhow::Result<u64> {
        Err(SubstrateError::Unsupported(format!("volume {id}: {} has no volumes", self.name())).into())
    }
}
