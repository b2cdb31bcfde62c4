//! The gateway's model: the records it keeps (sandboxes, snapshots, secrets,
//! teams, keys, journal intents, built templates and their build layer
//! cache, the nodes of a shared database), their
//! states and rules, id and clock helpers, the error every service verb
//! answers with, and the [`Store`] trait that persists the records.
//!
//! It depends on nothing else in this crate (only on the substrate's plain
//! types such as `Limits` and `SandboxNetwork`), so the service, the API and
//! every store implementation can use it without a cycle. A new kind of
//! record is a new file here and a few methods on [`Store`].

mod build_layer;
mod clock;
mod error;
mod https_ports;
mod ids;
mod journal;
mod key;
mod node;
mod sandbox;
mod secret;
mod snapshot;
mod store;
mod team;
mod template;
mod template_labels;
mod volume;

pub use build_layer::BuildLayer;
pub use clock::now_ms;
pub use error::{Result, SandboxError};
pub use https_ports::{MAX_HTTPS_PORTS, validate_https_ports};
pub use ids::{new_id, new_token, new_uuid, snapshot_key};
pub use journal::{Change, Intent};
pub use key::KeyRecord;
pub use node::{
    Admit, Capacity, HEARTBEAT_MS, LOST_AFTER_MS, NodeRecord, NodeStatus, PlaceClaim, RecentPlacements, place,
    validate_node_id,
};
pub use sandbox::{
    DEFAULT_TIMEOUT_S, ENVD_VERSION, MAX_TIMEOUT_S, Paused, SandboxRecord, State, masked_host, validate_host_mask,
    validate_timeout,
};
pub use secret::{
    KEPT_VERSIONS, MAX_VALUE_BYTES, SealedValue, SealedVersion, SecretError, SecretRecord, validate_secret_metadata,
    validate_secret_name, validate_secret_value,
};
pub use snapshot::{LazyFiles, SnapshotRecord, validate_snapshot_name};
pub use store::{NodeStore, SecretStore, Store, VolumeStore};
pub use team::{
    Caller, DEFAULT_TEAM, DEFAULTS_ROW, Quotas, Team, TeamUsage, default_team, parse_duration_s, validate_team_name,
};
pub use template::{
    Build, BuildFailure, BuildLine, BuildStatus, Image, MAX_BUILD_LOG_LINES, OciBase, TemplateRecord,
    split_template_name, validate_files_hash,
};
pub use template_labels::{
    DEFAULT_TAG, MAX_TAGS_PER_REQUEST, Tag, TagAssignment, TemplateLabels, normalize_tag, normalize_tags, split_tag,
};
pub use volume::{
    MAX_MOUNTS, VolumeError, VolumeMount, VolumeMove, VolumeRecord, validate_mount_path, validate_mounts,
    validate_volume_name,
};
