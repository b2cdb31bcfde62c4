//! The one line a bhyve host writes to a restored guest's serial console,
//! and what the guest does with it.
//!
//! Every guest restored from one checkpoint wakes up with the template's
//! hostname, machine id, kernel RNG state and network address. The console
//! is the only channel that reaches exactly one guest while every clone
//! still answers at the template's address, so the host sends each guest
//! its [`Identity`] there as one JSON line ([`Identity::control_line`]); the
//! guest agent (`copse-agent guest`) reads it ([`Identity::parse`]) and
//! carries out [`Identity::steps`].
//!
//! There is no reply on the console: the last step moves the guest to its
//! own address, and the host waits for the agent's `/health` there. An
//! answer at that address is the acknowledgement; a failed step leaves the
//! guest unreachable, the host's wait times out and the guest is destroyed
//! instead of handed out.

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

/// The guest's own place on the pool network.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestNet {
    pub mac: String,
    /// Address with prefix length, e.g. `10.77.3.17/16`.
    pub address: String,
    pub gateway: String,
}

/// A fresh identity for one guest; also the line's wire format.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    pub hostname: String,
    #[serde(flatten)]
    pub net: GuestNet,
    /// 32 lowercase hex digits, the format of `/etc/machine-id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine_id: Option<String>,
    /// Written to the guest's `/dev/random`, which on FreeBSD and Linux
    /// mixes it into the pool; without it every clone would draw the same
    /// "random" numbers right after restore.
    #[serde(with = "hex_bytes")]
    pub rng_seed: Vec<u8>,
    /// Replaces the agent's access token when present. The bhyve substrate
    /// sends none: the gateway hands every new sandbox its token through
    /// `/init`, authenticated with the token it knows the agent holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_token: Option<String>,
}

/// One thing the guest does to apply an identity, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuestStep {
    ReseedRng(Vec<u8>),
    SetHostname(String),
    WriteFile {
        path: &'static str,
        contents: String,
    },
    RotateAgentToken(String),
    /// Give the guest NIC its MAC, address and default route. Last: being
    /// reachable there is what tells the host the identity is applied.
    SetNetwork(GuestNet),
}

#[derive(Debug, thiserror::Error)]
pub enum LineError {
    #[error("identity line is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("identity line has a bad {field}: {value:?}")]
    Field { field: &'static str, value: String },
}

/// Longest hostname accepted: one DNS label.
const MAX_HOSTNAME: usize = 63;
/// A seed longer than this is a mistake, not more entropy.
const MAX_SEED: usize = 4096;

impl Identity {
    /// The identity as one JSON line, newline included.
    pub fn control_line(&self) -> String {
        let mut line = serde_json::to_string(self).expect("an identity always serialises");
        line.push('\n');
        line
    }

    /// Parses and checks one line: the guest passes these values to
    /// `sethostname`, `ifconfig` and files under `/etc`.
    pub fn parse(line: &str) -> Result<Self, LineError> {
        let id: Self = serde_json::from_str(line.trim())?;
        id.check()?;
        Ok(id)
    }

    fn check(&self) -> Result<(), LineError> {
        let bad = |field: &'static str, value: &str| Err(LineError::Field { field, value: value.to_string() });
        let label_char = |c: char| c.is_ascii_alphanumeric() || c == '-';
        let h = &self.hostname;
        if h.is_empty() || h.len() > MAX_HOSTNAME || !h.chars().all(label_char) || h.starts_with('-') {
            return bad("hostname", h);
        }
        if !is_mac(&self.net.mac) {
            return bad("mac", &self.net.mac);
        }
        if !is_cidr(&self.net.address) {
            return bad("address", &self.net.address);
        }
        if self.net.gateway.parse::<Ipv4Addr>().is_err() {
            return bad("gateway", &self.net.gateway);
        }
        if let Some(id) = &self.machine_id
            && (id.len() != 32 || !id.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
        {
            return bad("machine_id", id);
        }
        if self.rng_seed.is_empty() || self.rng_seed.len() > MAX_SEED {
            return bad("rng_seed", &format!("{} bytes", self.rng_seed.len()));
        }
        if let Some(token) = &self.agent_token
            && (token.is_empty() || token.chars().any(|c| c.is_control() || c.is_whitespace()))
        {
            return bad("agent_token", "(hidden)");
        }
        Ok(())
    }

    pub fn steps(&self) -> Vec<GuestStep> {
        let mut steps =
            vec![GuestStep::ReseedRng(self.rng_seed.clone()), GuestStep::SetHostname(self.hostname.clone())];
        if let Some(id) = &self.machine_id {
            steps.push(GuestStep::WriteFile { path: "/etc/machine-id", contents: format!("{id}\n") });
            steps.push(GuestStep::WriteFile { path: "/etc/hostid", contents: format!("{}\n", uuid_form(id)) });
        }
        if let Some(token) = &self.agent_token {
            steps.push(GuestStep::RotateAgentToken(token.clone()));
        }
        steps.push(GuestStep::SetNetwork(self.net.clone()));
        steps
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// FreeBSD keeps the host UUID in `/etc/hostid` in 8-4-4-4-12 form.
fn uuid_form(hex32: &str) -> String {
    format!("{}-{}-{}-{}-{}", &hex32[..8], &hex32[8..12], &hex32[12..16], &hex32[16..20], &hex32[20..32])
}

fn is_mac(s: &str) -> bool {
    let parts: Vec<&str> = s.split(':').collect();
    parts.len() == 6 && parts.iter().all(|p| p.len() == 2 && p.bytes().all(|b| b.is_ascii_hexdigit()))
}

fn is_cidr(s: &str) -> bool {
    s.split_once('/').is_some_and(|(ip, len)| {
        ip.parse::<Ipv4Addr>().is_ok() && len.parse::<u8>().is_ok_and(|l| (1..=32).contains(&l))
    })
}

mod hex_bytes {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::hex(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        // from_str_radix alone would also take a sign.
        if s.len() % 2 != 0 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(D::Error::custom("not an even number of hex digits"));
        }
        Ok((0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("checked")).collect())
    }
}

#[cfg(test)]
mod tests;
