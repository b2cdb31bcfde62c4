//! A snapshot as the API knows it, and the names a caller may give one.

use serde::{Deserialize, Serialize};

use super::error::{Result, SandboxError};
use super::team::default_team;
use super::template::OciBase;
use super::volume::VolumeMount;

/// The public id and names the SDK sees, and the substrate's own key for
/// the snapshot's files.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotRecord {
    /// Unique within its team: names are namespaced per team.
    pub id: String,
    #[serde(default = "default_team")]
    pub team: String,
    pub names: Vec<String>,
    pub key: String,
    pub template: String,
    pub source_sandbox: String,
    pub created_at_ms: i64,
    pub size_bytes: u64,
    /// It holds memory and processes ("full" in E2B's terms).
    #[serde(default)]
    pub memory: bool,
    /// The access token the checkpointed agent demands, so a sandbox
    /// restored from it can be handed its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_token: Option<String>,
    /// The volumes its source had mounted: a record, not a copy. A
    /// sandbox created from the snapshot mounts only what its own create
    /// asks for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<VolumeMount>,
    /// The node whose host holds it, on a shared database (`model::node`);
    /// `None` on a single host, and for records from before nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Its node has uploaded it to the cluster's object store, so any node
    /// may fetch and start it (`service/objects.rs`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_object_store: bool,
    /// Its layers are also in the object store as filesystem images, which
    /// a node can mount as they arrive (`lazy_layers.rs`). Written only
    /// with `in_object_store`, by the node that uploaded them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lazy: Option<LazyFiles>,
    /// The OCI image under `template` when that is an image's template,
    /// its layer blobs stored beside the snapshot for a node that lacks
    /// it (`service/image_objects.rs`). Written with `in_object_store`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oci: Option<OciBase>,
}

/// A snapshot's layers as images in the object store: the substrate
/// template they sit on, and the SHA-256 of each image's manifest, top
/// first; with memory, that of its checkpoint's stream, fetched whole. The
/// database is trusted and the bucket is not, so these hashes are what
/// vouches for every byte a node mounts or restores.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LazyFiles {
    pub template: String,
    pub layers: Vec<String>,
    /// A checkpoint stream's manifest (records stored before memory images).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<String>,
    /// The manifest of an image of the checkpoint, served like a layer's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_image: Option<String>,
}

/// Public snapshot names may carry E2B's `namespace/alias:tag` shape.
pub fn validate_snapshot_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_./:".contains(c))
        && !name.contains("..");
    if ok {
        Ok(())
    } else {
        Err(SandboxError::Invalid(format!(
            "invalid snapshot name {name:?}: use letters, digits and - _ . / : (at most 128)"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_names_take_e2b_shapes_and_refuse_paths() {
        assert!(validate_snapshot_name("team/my-snap:default").is_ok());
        assert!(validate_snapshot_name("plain_name.v2").is_ok());
        assert!(validate_snapshot_name("../etc").is_err());
        assert!(validate_snapshot_name("").is_err());
        assert!(validate_snapshot_name("a b").is_err());
    }
}
