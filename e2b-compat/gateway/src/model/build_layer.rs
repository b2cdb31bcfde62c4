//! One entry of the build layer cache: the files a team's build had after
//! one step (a substrate snapshot stacked on its parent's), and the build
//! settings the steps so far left, which live outside the files
//! (environment, user, working directory) and must apply to the steps
//! after a cache hit.
//!
//! An entry belongs to one team: its key is derived from the team's name
//! and only that team's builds look it up, so no build ever stacks on
//! files another team's build produced.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildLayer {
    /// Hex SHA-256 of the team, the parent's key and the step as sent.
    pub key: String,
    pub team: String,
    /// The substrate template under the snapshot's layers (`base`).
    pub substrate_template: String,
    /// The substrate's snapshot holding the files after the step.
    pub snapshot_key: String,
    /// In the order the build set them; later ones win.
    pub envs: Vec<(String, String)>,
    pub user: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// The ids of the team's templates whose builds made or reused it: it
    /// is collected once the last of them is deleted.
    pub templates: Vec<String>,
    pub created_at_ms: i64,
    /// The node whose host holds it, on a shared database (`model::node`);
    /// `None` on a single host, and for records from before nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Its files are in the cluster's object store too
    /// (`service/layer_objects.rs`): a build on another node stacks on
    /// them after fetching them, rather than running its steps again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_object_store: bool,
}
