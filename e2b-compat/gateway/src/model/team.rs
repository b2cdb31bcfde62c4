//! A team: who owns sandboxes and snapshots, and the limits it works
//! under. Every key belongs to one team; the keys of `COPSE_API_KEY` and
//! the keys file belong to [`DEFAULT_TEAM`].

use serde::{Deserialize, Serialize};

use super::error::{Result, SandboxError};

/// The team of the operator's own keys, and of every record written before
/// teams existed.
pub const DEFAULT_TEAM: &str = "default";
/// The row holding the quotas of teams that set none of their own; not a
/// valid team name, so no team can take it.
pub const DEFAULTS_ROW: &str = "*";

pub fn default_team() -> String {
    DEFAULT_TEAM.to_string()
}

/// A span of time as an operator writes it: `90`, `90s`, `15m`, `12h`,
/// `7d`; in seconds.
pub fn parse_duration_s(text: &str) -> std::result::Result<u64, String> {
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, "s"),
    };
    let scale = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("{text:?}: use a number with s, m, h or d (say 7d)")),
    };
    let n: u64 = digits.parse().map_err(|_| format!("{text:?}: use a number with s, m, h or d (say 7d)"))?;
    n.checked_mul(scale).ok_or_else(|| format!("{text:?} is too long"))
}

/// What a team holds on one node (or, summed, on several): each node
/// publishes its teams' holdings with its heartbeat (`model::node`), so
/// a team's limits hold across a cluster (`service/quota.rs`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TeamUsage {
    pub running: u64,
    pub paused: u64,
    pub snapshots: u64,
    /// Disk quotas of its sandboxes plus the size of its snapshots.
    pub disk_bytes: u64,
}

impl std::ops::AddAssign for TeamUsage {
    fn add_assign(&mut self, other: Self) {
        self.running += other.running;
        self.paused += other.paused;
        self.snapshots += other.snapshots;
        self.disk_bytes += other.disk_bytes;
    }
}

/// Team names go into log lines and CLI tables: short and plain.
pub fn validate_team_name(name: &str) -> Result<()> {
    let ok =
        !name.is_empty() && name.len() <= 64 && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if ok {
        Ok(())
    } else {
        Err(SandboxError::Invalid(format!("invalid team name {name:?}: use letters, digits, - and _ (at most 64)")))
    }
}

/// Limits of one team; `None` leaves the limit to the defaults row (and
/// there, unlimited).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quotas {
    /// Running sandboxes at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sandboxes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_paused: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_snapshots: Option<u64>,
    /// Disk quotas of its sandboxes plus the size of its snapshots, in GiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_disk_gb: Option<u64>,
    /// Longest lifetime one create, connect or timeout change may ask for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sandbox_timeout_s: Option<u64>,
    /// Requests per second each of its keys may make (a burst of as many).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_second: Option<u64>,
    /// Seconds a sandbox may stay paused before it is deleted with its
    /// files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_retention_s: Option<u64>,
}

impl Quotas {
    /// Each limit this one leaves unset taken from `defaults`.
    pub fn or(self, defaults: Quotas) -> Quotas {
        Quotas {
            max_sandboxes: self.max_sandboxes.or(defaults.max_sandboxes),
            max_paused: self.max_paused.or(defaults.max_paused),
            max_snapshots: self.max_snapshots.or(defaults.max_snapshots),
            max_disk_gb: self.max_disk_gb.or(defaults.max_disk_gb),
            max_sandbox_timeout_s: self.max_sandbox_timeout_s.or(defaults.max_sandbox_timeout_s),
            requests_per_second: self.requests_per_second.or(defaults.requests_per_second),
            paused_retention_s: self.paused_retention_s.or(defaults.paused_retention_s),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Team {
    pub name: String,
    #[serde(default)]
    pub quotas: Quotas,
    pub created_at_ms: i64,
}

/// Who is asking: the team a request's key belongs to, or an operator's
/// admin key, which sees and acts on every team's records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub team: String,
    pub admin: bool,
}

impl Caller {
    pub fn team(team: &str) -> Self {
        Self { team: team.to_string(), admin: false }
    }

    /// The gateway itself (reaper, pools, shutdown): every record.
    pub fn operator() -> Self {
        Self { team: DEFAULT_TEAM.to_string(), admin: true }
    }

    /// Whether a record of `team` is visible to this caller. Records of
    /// other teams are answered as missing, never as forbidden: a caller
    /// learns nothing of what other teams hold.
    pub fn sees(&self, team: &str) -> bool {
        self.admin || self.team == team
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn team_names_are_plain() {
        assert!(validate_team_name("acme-2_x").is_ok());
        for bad in ["", "a b", "../x", "*", "a/b", &"x".repeat(65)] {
            assert!(validate_team_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_teams_own_limits_win_over_the_defaults() {
        let own = Quotas { max_sandboxes: Some(2), ..Default::default() };
        let defaults = Quotas { max_sandboxes: Some(9), max_paused: Some(1), ..Default::default() };
        let merged = own.or(defaults);
        assert_eq!((merged.max_sandboxes, merged.max_paused, merged.max_snapshots), (Some(2), Some(1), None));
    }

    #[test]
    fn durations_take_a_unit_or_mean_seconds() {
        assert_eq!(parse_duration_s("7d"), Ok(7 * 86_400));
        assert_eq!(parse_duration_s("15m"), Ok(900));
        assert_eq!(parse_duration_s("90"), Ok(90));
        for bad in ["", "d", "7w", "-1s", "1.5h"] {
            assert!(parse_duration_s(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn only_admins_see_across_teams() {
        assert!(Caller::team("a").sees("a"));
        assert!(!Caller::team("a").sees("b"));
        assert!(Caller { team: "a".into(), admin: true }.sees("b"));
    }
}
