//! An API key as the store keeps it: its hash (never the key), the team it
//! acts for, and what the operator needs to recognise it later.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecord {
    /// `sha256:<hex>` of the whole key (see `keys.rs`).
    pub hash: String,
    /// The key's first characters, shown by `copse keys list` and named by
    /// `copse keys revoke`; too short to help guess the rest.
    pub prefix: String,
    pub team: String,
    #[serde(default)]
    pub label: String,
    /// Sees and acts on every team's records.
    #[serde(default)]
    pub admin: bool,
    pub created_at_ms: i64,
    #[serde(default)]
    pub last_used_ms: Option<i64>,
}
