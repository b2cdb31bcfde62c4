//! What makes two guests restored from one checkpoint different.
//!
//! A restored guest wakes up with the checkpointed guest's hostname,
//! machine id, kernel RNG state and agent token. Before a guest is handed
//! out (for prewarm pools: before it is stopped) the pool sends it a fresh
//! identity through its agent.

use rand::RngCore;

/// The guest's own place on the pool network. Every guest restored from a
/// checkpoint wakes up with the template's MAC and address; on a shared
/// bridge that is a duplicate of every other clone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestNet {
    pub mac: String,
    /// Address with prefix length, e.g. `10.77.3.17/16`.
    pub address: String,
    pub gateway: String,
}

/// A fresh identity for one guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub hostname: String,
    pub net: GuestNet,
    /// 32 lowercase hex digits, the format of `/etc/machine-id`.
    pub machine_id: String,
    /// Written to the guest's `/dev/random`, which on FreeBSD and Linux
    /// mixes it into the pool; without it every clone would draw the same
    /// "random" numbers right after restore.
    pub rng_seed: [u8; 64],
    /// The bearer token the gateway will use with this guest's agent; the
    /// checkpointed one is known to every clone.
    pub agent_token: String,
}

/// One thing the guest agent does to apply an identity, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuestStep {
    ReseedRng(Vec<u8>),
    SetHostname(String),
    /// Give the guest NIC the slot's MAC, address and default route.
    SetNetwork(GuestNet),
    WriteFile {
        path: &'static str,
        contents: String,
    },
    /// Last, so a failure earlier leaves the old token (and the guest is
    /// destroyed instead of handed out).
    RotateAgentToken(String),
}

impl Identity {
    pub fn generate(sandbox_id: &str, net: GuestNet, rng: &mut impl RngCore) -> Self {
        let mut id = [0u8; 16];
        rng.fill_bytes(&mut id);
        let mut rng_seed = [0u8; 64];
        rng.fill_bytes(&mut rng_seed);
        let mut token = [0u8; 32];
        rng.fill_bytes(&mut token);
        Self { hostname: hostname_for(sandbox_id), net, machine_id: hex(&id), rng_seed, agent_token: hex(&token) }
    }

    /// The identity as the one JSON line the guest's control helper reads
    /// on its serial console (see [`crate::substrate`]): the console is the
    /// only channel that reaches exactly one guest while every clone still
    /// answers at the template's address.
    pub fn control_line(&self) -> String {
        let line = serde_json::json!({
            "hostname": self.hostname,
            "mac": self.net.mac,
            "address": self.net.address,
            "gateway": self.net.gateway,
            "machine_id": self.machine_id,
            "hostid": uuid_form(&self.machine_id),
            "rng_seed": hex(&self.rng_seed),
            "agent_token": self.agent_token,
        });
        format!("{line}\n")
    }

    pub fn guest_steps(&self) -> Vec<GuestStep> {
        vec![
            GuestStep::ReseedRng(self.rng_seed.to_vec()),
            GuestStep::SetHostname(self.hostname.clone()),
            GuestStep::SetNetwork(self.net.clone()),
            GuestStep::WriteFile { path: "/etc/machine-id", contents: format!("{}\n", self.machine_id) },
            GuestStep::WriteFile { path: "/etc/hostid", contents: format!("{}\n", uuid_form(&self.machine_id)) },
            GuestStep::RotateAgentToken(self.agent_token.clone()),
        ]
    }
}

/// A DNS label: letters, digits and hyphens, at most 63 bytes.
fn hostname_for(sandbox_id: &str) -> String {
    let label: String = sandbox_id
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' })
        .take(63)
        .collect();
    let label = label.trim_matches('-');
    if label.is_empty() { "sandbox".to_string() } else { label.to_string() }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// FreeBSD keeps the host UUID in `/etc/hostid` in 8-4-4-4-12 form.
fn uuid_form(hex32: &str) -> String {
    format!("{}-{}-{}-{}-{}", &hex32[..8], &hex32[8..12], &hex32[12..16], &hex32[16..20], &hex32[20..32])
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    fn net(n: u8) -> GuestNet {
        GuestNet {
            mac: format!("02:c0:00:00:00:{n:02x}"),
            address: format!("10.77.0.{n}/16"),
            gateway: "10.77.0.1".into(),
        }
    }

    #[test]
    fn two_guests_from_one_checkpoint_differ() {
        let mut rng = StdRng::seed_from_u64(1);
        let a = Identity::generate("sb-1", net(2), &mut rng);
        let b = Identity::generate("sb-2", net(3), &mut rng);
        assert_ne!(a.machine_id, b.machine_id);
        assert_ne!(a.rng_seed, b.rng_seed);
        assert_ne!(a.agent_token, b.agent_token);
        assert_ne!(a.hostname, b.hostname);
        let (sa, sb) = (a.guest_steps(), b.guest_steps());
        assert!(sa.contains(&GuestStep::SetNetwork(net(2))) && sb.contains(&GuestStep::SetNetwork(net(3))));
    }

    #[test]
    fn formats() {
        let mut rng = StdRng::seed_from_u64(2);
        let id = Identity::generate("Sb_ABC.9", net(4), &mut rng);
        assert_eq!(id.hostname, "sb-abc-9");
        assert_eq!(id.machine_id.len(), 32);
        assert!(id.machine_id.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(id.agent_token.len(), 64);
        assert_eq!(hostname_for("---"), "sandbox");
        assert_eq!(hostname_for(&"x".repeat(80)).len(), 63);
        assert_eq!(uuid_form("0123456789abcdef0123456789abcdef"), "01234567-89ab-cdef-0123-456789abcdef");
    }

    #[test]
    fn control_line_is_one_json_line() {
        let mut rng = StdRng::seed_from_u64(4);
        let id = Identity::generate("sb-1", net(6), &mut rng);
        let line = id.control_line();
        assert!(line.ends_with('\n') && line.matches('\n').count() == 1);
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["hostname"], "sb-1");
        assert_eq!(v["address"], "10.77.0.6/16");
        assert_eq!(v["mac"], "02:c0:00:00:00:06");
        assert_eq!(v["rng_seed"].as_str().unwrap().len(), 128);
        assert_eq!(v["agent_token"], id.agent_token.as_str());
    }

    #[test]
    fn token_rotates_last() {
        let mut rng = StdRng::seed_from_u64(3);
        let id = Identity::generate("sb", net(5), &mut rng);
        let steps = id.guest_steps();
        assert_eq!(steps.first(), Some(&GuestStep::ReseedRng(id.rng_seed.to_vec())));
        assert_eq!(steps.last(), Some(&GuestStep::RotateAgentToken(id.agent_token.clone())));
        assert!(
            steps.contains(&GuestStep::WriteFile { path: "/etc/machine-id", contents: format!("{}\n", id.machine_id) })
        );
    }
}
