//! A sandbox as the gateway records it: who it belongs to, how long it
//! lives, whether it runs or is paused (and how), where the substrate
//! placed it and which address and egress policy it holds.

use std::collections::HashMap;
use std::path::PathBuf;

use copse_substrate::{Limits, Placement, SandboxNetwork};
use serde::{Deserialize, Serialize};

use super::error::{Result, SandboxError};
use super::snapshot::LazyFiles;
use super::team::default_team;
use super::template::OciBase;
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
    /// E2B's `maskRequestHost`: the `Host` its servers are handed instead
    /// of the name the caller used, `${PORT}` replaced by the port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask_request_host: Option<String>,
    /// E2B's `httpsPorts`, validated, sorted: its ports the agent reaches
    /// over TLS. Fixed at create; forks inherit it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub https_ports: Vec<u16>,
    /// The password of its `egress_proxy` upstream as the store keeps it,
    /// sealed (`store/sealing.rs`); the policy's own copy is blank there.
    /// `None` in a record as read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sealed_upstream_password: Option<super::SealedValue>,
    /// The node whose host holds it, on a shared database (`model::node`);
    /// `None` on a single host, and for records from before nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
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
    /// Its files (`files_only`) also hold a checkpoint of its processes,
    /// restored running at resume: it was paused by a drain that moves a
    /// node's sandboxes away (`service/relocate.rs`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub memory: bool,
    /// Its node has uploaded its files to the cluster's object store, so
    /// it may resume on another node when its own takes no sandboxes.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_object_store: bool,
    /// Stored with its layers as images too, for the node it resumes on
    /// to mount as they arrive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lazy: Option<LazyFiles>,
    /// Stored with the layer blobs of the OCI image its template is, for
    /// a node that lacks that template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oci: Option<OciBase>,
}

fn yes() -> bool {
    true
}

impl SandboxRecord {
    /// Paused without memory: nothing of it runs on the host.
    pub fn has_no_processes(&self) -> bool {
        self.paused.as_ref().is_some_and(|p| p.files_only.is_some())
    }

    /// Paused as of `now_ms`, its files in `files_only` if its processes
    /// are gone (`memory`: with a checkpoint of them). The clock stops
    /// while paused: a paused sandbox never expires.
    pub fn set_paused(&mut self, files_only: Option<String>, memory: bool, now_ms: i64) {
        self.paused = Some(Paused {
            remaining_ms: (self.end_at_ms - now_ms).max(0),
            files_only,
            paused_at_ms: Some(now_ms),
            memory,
            in_object_store: false,
            lazy: None,
            oci: None,
        });
        self.state = State::Paused;
        self.end_at_ms = i64::MAX;
    }

    /// Running again as of `now_ms`, for `lifetime_ms`.
    pub fn set_running(&mut self, lifetime_ms: i64, now_ms: i64) {
        self.paused = None;
        self.state = State::Running;
        self.end_at_ms = now_ms + lifetime_ms;
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

/// The placeholder a request host mask may carry, as E2B spells it.
pub const PORT_PLACEHOLDER: &str = "${PORT}";

/// A `maskRequestHost` the data plane can put in a `Host` header as it
/// is: a host name (letters, digits, `.`, `-`), an optional `:port`, and
/// `${PORT}` anywhere. Anything else (spaces, control characters, `@`,
/// `/`, other `$`) would let a caller smuggle headers or a path into what
/// the sandbox's servers are handed.
pub fn validate_host_mask(mask: &str) -> Result<()> {
    let filled = mask.replace(PORT_PLACEHOLDER, "65535");
    let (name, port) = match filled.rsplit_once(':') {
        Some((name, port)) => (name, Some(port)),
        None => (filled.as_str(), None),
    };
    let name_ok = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        });
    let port_ok = port.is_none_or(|p| !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()));
    if name_ok && port_ok {
        return Ok(());
    }
    Err(SandboxError::Invalid(format!(
        "network.maskRequestHost must be a host name, optionally with :port, where {PORT_PLACEHOLDER} stands for \
         the sandbox port (e.g. \"{PORT_PLACEHOLDER}-myapp.example.com\")"
    )))
}

/// The `Host` a server on `port` is handed under `mask`.
pub fn masked_host(mask: &str, port: u16) -> String {
    mask.replace(PORT_PLACEHOLDER, &port.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_masks_are_host_names_with_the_port_placeholder() {
        for good in ["${PORT}-myapp.example.com", "app.example.com", "${PORT}.x.io:8443", "a-${PORT}-b.c"] {
            assert!(validate_host_mask(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "a b.com",
            "evil.com\r\nx-access-token: t",
            "user@host.com",
            "host.com/path",
            "${HOME}.com",
            "-x.com",
            "x..com",
            "x.com:",
            "x.com:123456",
            "[::1]",
            &"a".repeat(64),
        ] {
            assert!(validate_host_mask(bad).is_err(), "{bad:?}");
        }
        assert_eq!(masked_host("${PORT}-app.example.com", 8080), "8080-app.example.com");
    }

    #[test]
    fn timeouts_outside_the_allowed_range_are_refused() {
        assert!(validate_timeout(-1).is_err());
        assert!(validate_timeout(MAX_TIMEOUT_S + 1).is_err());
        assert_eq!(validate_timeout(30).unwrap(), 30);
    }
}
