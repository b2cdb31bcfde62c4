//! The volumes service: create, read, list, delete, and finding the
//! volumes a sandbox create names. A volume belongs to the caller's team:
//! other teams are told it does not exist. Its bytes are the substrate's
//! (one directory with a kernel-enforced size limit per volume); this
//! service keeps the record and refuses to delete a volume a sandbox
//! still mounts.

use std::sync::Arc;

use copse_substrate::Substrate;

use super::Sandboxes;
use crate::model::{
    Caller, DEFAULTS_ROW, Quotas, Store, VolumeError, VolumeMount, VolumeRecord, VolumeStore, new_id, new_token,
    now_ms, validate_mount_path, validate_mounts, validate_volume_name,
};
use crate::tenancy::Directory;
use crate::volume_files::VolumeFiles;

type Result<T> = std::result::Result<T, VolumeError>;

/// A volume's size limit when its team sets no `max-disk-gb`.
pub const DEFAULT_VOLUME_GB: u64 = 10;

pub struct Volumes {
    store: Arc<dyn VolumeStore>,
    substrate: Arc<dyn Substrate>,
    sandboxes: Arc<Sandboxes>,
    directory: Option<Arc<Directory>>,
}

impl Volumes {
    pub fn new(store: Arc<dyn VolumeStore>, substrate: Arc<dyn Substrate>, sandboxes: Arc<Sandboxes>) -> Self {
        let _ = sandboxes.volume_store.set(store.clone());
        Self { store, substrate, sandboxes, directory: None }
    }

    /// Team limits (`max-disk-gb` sizes each volume) come from here.
    pub fn with_directory(mut self, directory: Arc<Directory>) -> Self {
        self.directory = Some(directory);
        self
    }

    /// Each volume may hold up to its team's whole disk quota: the kernel
    /// refuses writes past it (not the sum over the team's volumes).
    fn limit_bytes(&self, team: &str) -> u64 {
        limit_for(self.directory.as_ref().map(|d| d.quotas(team)).unwrap_or_default())
    }

    pub fn create(&self, caller: &Caller, name: &str) -> Result<VolumeRecord> {
        validate_volume_name(name)?;
        if self.store.volume_named(&caller.team, name)?.is_some() {
            return Err(VolumeError::NameTaken(name.to_string()));
        }
        let record = VolumeRecord {
            id: new_id(),
            team: caller.team.clone(),
            name: name.to_string(),
            token: new_token(),
            created_at_ms: now_ms(),
            node: self.sandboxes.node().map(str::to_string),
            moved_out: None,
        };
        // The bytes first: a record always names a volume that exists.
        self.substrate.create_volume(&record.id, self.limit_bytes(&record.team)).map_err(refusal)?;
        if !self.store.insert_volume(&record)? {
            let _ = self.substrate.delete_volume(&record.id);
            return Err(VolumeError::NameTaken(name.to_string()));
        }
        Ok(record)
    }

    /// By id, or by name within the caller's team.
    pub fn get(&self, caller: &Caller, id_or_name: &str) -> Result<VolumeRecord> {
        let found = match self.store.volume(id_or_name)? {
            Some(record) => Some(record),
            None => self.store.volume_named(&caller.team, id_or_name)?,
        };
        found.filter(|r| caller.sees(&r.team)).ok_or_else(|| VolumeError::NotFound(id_or_name.to_string()))
    }

    /// The caller's volumes (every team's for an admin), ordered by id.
    pub fn list(&self, caller: &Caller) -> Result<Vec<VolumeRecord>> {
        Ok(self.store.volumes()?.into_iter().filter(|r| caller.sees(&r.team)).collect())
    }

    /// Refused while any sandbox (running or paused) mounts it.
    pub fn delete(&self, caller: &Caller, id_or_name: &str) -> Result<()> {
        let record = self.here(self.get(caller, id_or_name)?)?;
        let users = self.sandboxes.mounting(&record.id).map_err(|e| VolumeError::Internal(anyhow::anyhow!("{e}")))?;
        if !users.is_empty() {
            return Err(VolumeError::InUse(format!(
                "volume {} is mounted by sandbox {}; kill {} first",
                record.name,
                users.join(", "),
                if users.len() == 1 { "it" } else { "them" }
            )));
        }
        self.substrate.delete_volume(&record.id).map_err(refusal)?;
        if self.store.remove_volume(&record.id)? { Ok(()) } else { Err(VolumeError::NotFound(id_or_name.to_string())) }
    }

    /// Volume `id`'s files, for a caller presenting `token` (the content
    /// API's only credential). A wrong token gets the answer an unknown
    /// volume gets.
    pub fn files(&self, id: &str, token: &str) -> Result<VolumeFiles> {
        let record = self.store.volume(id)?.ok_or_else(|| VolumeError::NotFound(id.to_string()))?;
        if !copse_protocol::signature::equal(&record.token, token) {
            return Err(VolumeError::NotFound(id.to_string()));
        }
        let record = self.here(record)?;
        let location = self.substrate.volume_location(&record.id).map_err(refusal)?;
        Ok(VolumeFiles::new(location.root, location.id_base))
    }

    /// The node holding volume `id`'s bytes, for a caller presenting the
    /// volume's `token`; `None` for an unknown volume or a wrong token
    /// (whichever gateway is asked answers those alike), and for a volume
    /// from before nodes.
    pub fn node_for_content(&self, id: &str, token: &str) -> Result<Option<String>> {
        let record = self.store.volume(id)?.filter(|r| copse_protocol::signature::equal(&r.token, token));
        match record {
            Some(record) => Ok(match self.sandboxes.volume_owner(&record)? {
                crate::service::Owner::Here => self.sandboxes.node().map(str::to_string),
                crate::service::Owner::There(node) => Some(node.id),
                crate::service::Owner::Lost { node, .. } => Some(node),
            }),
            None => Ok(None),
        }
    }

    /// Volume `record` with its bytes on this node: a volume waiting in
    /// the object store for its next node is fetched (`volume_moves.rs`).
    fn here(&self, record: VolumeRecord) -> Result<VolumeRecord> {
        match record.moved_out {
            None => Ok(record),
            Some(_) => self.sandboxes.bring_volume_here(&record.id, self.limit_bytes(&record.team)),
        }
    }

    /// The nodes holding the caller's volumes named `names` (ones it does
    /// not have are the create's to refuse).
    pub fn nodes_of(&self, caller: &Caller, names: &[String]) -> Result<std::collections::BTreeSet<String>> {
        let mut nodes = std::collections::BTreeSet::new();
        for name in names {
            let volume = self.store.volume_named(&caller.team, name)?.filter(|r| caller.sees(&r.team));
            // One waiting in the object store goes where the create is placed.
            nodes.extend(volume.filter(|v| !v.waits_in_object_store()).and_then(|v| v.node));
        }
        Ok(nodes)
    }

    /// The mounts a sandbox create asks for (`(name, path)` as the SDK
    /// sends them), each volume found by name in the caller's team.
    pub fn resolve(&self, caller: &Caller, asked: &[(String, String)]) -> Result<Vec<VolumeMount>> {
        let mut mounts = Vec::with_capacity(asked.len());
        for (name, path) in asked {
            let path = validate_mount_path(path)?;
            let volume = self.store.volume_named(&caller.team, name)?.filter(|r| caller.sees(&r.team));
            let volume = volume.ok_or_else(|| VolumeError::Invalid(format!("volume {name:?} not found")))?;
            let volume = self.here(volume)?;
            mounts.push(VolumeMount { volume_id: volume.id, name: volume.name, path });
        }
        validate_mounts(&mounts)?;
        Ok(mounts)
    }
}

impl Sandboxes {
    /// Ids of the sandboxes (running or paused) that mount volume `id`.
    pub fn mounting(&self, volume_id: &str) -> crate::model::Result<Vec<String>> {
        Ok(self
            .store
            .all()?
            .into_iter()
            .filter(|r| r.volume_mounts.iter().any(|m| m.volume_id == volume_id))
            .map(|r| r.id)
            .collect())
    }
}

fn limit_for(quotas: Quotas) -> u64 {
    quotas.max_disk_gb.unwrap_or(DEFAULT_VOLUME_GB).saturating_mul(1 << 30)
}

/// A volume's size limit in `team` read from the store, as the CLI (which
/// has no tenancy directory) needs it: the team's own limit, else the
/// defaults row's, else `DEFAULT_VOLUME_GB`.
pub fn team_volume_limit(store: &dyn Store, team: &str) -> anyhow::Result<u64> {
    let teams = store.teams()?;
    let row = |name: &str| teams.iter().find(|t| t.name == name).map(|t| t.quotas).unwrap_or_default();
    Ok(limit_for(row(team).or(row(DEFAULTS_ROW))))
}

/// A substrate's typed refusal keeps its meaning (no volumes on this
/// substrate is the caller's 400, not a fault).
fn refusal(err: anyhow::Error) -> VolumeError {
    match copse_substrate::SubstrateError::find(&err) {
        Some(refusal) => VolumeError::Substrate(refusal.clone()),
        None => VolumeError::Internal(err),
    }
}
