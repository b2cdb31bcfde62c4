//! A sandbox as the gateway records it: who it belongs to, how long it
//! lives, whether it runs or is paused (and how), where the substrate
//! placed it and which address and egress policy it holds.

use std::collections::HashMap;
use std::path::PathBuf;

use copse_substrate::{Limits, Placement, SandboxNetwork};
use serde::{Deserialize, Serialize};

use super::error::{Result, SandboxError};
use super::team::default_team;
use super::volume::VolumeMount;

/// The envd version copse's agent implements (every SDK feature gate on).
pub const ENVD_VERSION: &str = "0.6.4";
pub const DEFAULT_TIMEOUT_S: i64 = 300;
/// E2B's ceiling for a sandbox's lifetime on its largest plan.
pub const MAX_TIMEOUT_S: i64 = 24 * 3600;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Running,
    Paused,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub id: String,
    /// The team that created it; records older than teams are the default
    /// team's.
    #[serde(default = "default_team")]
    pub team: String,
    pub template: String,
    pub access_token: String,
    /// Set when the sandbox does not allow public traffic: requests to its
    /// ports must carry it (`e2b-traffic-access-token`). Records written
    /// before it existed have none: public, as they were.
    #[serde(default)]
    pub traffic_access_token: Option<String>,
    pub metadata: HashMap<String, String>,
    pub env_vars: HashMap<String, String>,
    pub limits: Limits,
    pub started_at_ms: i64,
    pub end_at_ms: i64,
    pub state: State,
    pub allow_internet_access: bool,
    pub auto_pause: bool,
    /// Whether an automatic pause keeps memory (E2B's `autoPauseMemory`).
    #[serde(default = "yes")]
    pub auto_pause_memory: bool,
    /// Whether traffic to the paused sandbox resumes it.
    #[serde(default)]
    pub auto_resume: bool,
    #[serde(default)]
    pub paused: Option<Paused>,
    pub placement: Placement,
    pub agent_socket: PathBuf,
    /// Address and current egress policy; `None` without a sandbox network.
    /// Kept while paused, so a resumed sandbox has the same address.
    #[serde(default)]
    pub network: Option<SandboxNetwork>,
    /// Persistent volumes mounted in it; mounted again whenever it boots
    /// again under its id (a resume from files, a rollback) and in forks.
    #[serde(default)]
    pub volume_mounts: Vec<VolumeMount>,
}

/// How a paused sandbox is held.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Paused {
    /// Lifetime left when it was paused; the clock stops while paused.
    pub remaining_ms: i64,
    /// `None`: its processes are frozen in place, memory kept. `Some(key)`:
    /// it was paused without memory; its processes are gone and its files
    /// wait in the substrate snapshot `key` until it is resumed.
    pub files_only: Option<String>,
    /// When it was paused, for the team's paused retention; records
    /// paused before it was kept have none and are never reaped by it.
    #[serde(default)]
    pub paused_at_ms: Option<i64>,
}

fn yes() -> bool {
    true
}

impl SandboxRecord {
    /// Paused without memory: nothing of it runs on the host.
    pub fn has_no_processes(&self) -> bool {
        self.paused.as_ref().is_some_and(|p| p.files_only.is_some())
    }
}

/// A lifetime the caller asked for, if E2B allows it.
pub fn validate_timeout(timeout_s: i64) -> Result<i64> {
    if !(0..=MAX_TIMEOUT_S).contains(&timeout_s) {
        return Err(SandboxError::Invalid(format!(
            "timeout must be between 0 and {MAX_TIMEOUT_S} seconds, got {timeout_s}"
        )));
    }
    Ok(timeout_s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_outside_the_allowed_range_are_refused() {
        assert!(validate_timeout(-1).is_err());
        assert!(validate_timeout(MAX_TIMEOUT_S + 1).is_err());
        assert_eq!(validate_timeout(30).unwrap(), 30);
    }
}
