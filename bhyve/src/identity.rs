//! What makes two guests restored from one checkpoint different.
//!
//! A restored guest wakes up with the checkpointed guest's hostname,
//! machine id, kernel RNG state and network address. Before a guest is
//! handed out (for prewarm pools: before it is stopped) the pool writes it
//! a fresh [`Identity`] on its serial console; the line's format and the
//! steps the guest takes live in `copse-identity-line`, shared with the
//! guest agent (`copse-agent guest`).

use rand::RngCore;

pub use copse_identity_line::{GuestNet, GuestStep, Identity, hex};

/// A fresh identity for the guest that becomes `sandbox_id`.
///
/// It carries no agent token: the gateway gives the agent its token
/// through `/init`, authenticated with the token it knows the agent holds
/// (none for a template checkpoint, the source's for a memory snapshot). A
/// token made here would be one the gateway never learns.
pub fn generate(sandbox_id: &str, net: GuestNet, rng: &mut impl RngCore) -> Identity {
    let mut id = [0u8; 16];
    rng.fill_bytes(&mut id);
    let mut rng_seed = vec![0u8; 64];
    rng.fill_bytes(&mut rng_seed);
    Identity { hostname: hostname_for(sandbox_id), net, machine_id: Some(hex(&id)), rng_seed, agent_token: None }
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
        let a = generate("sb-1", net(2), &mut rng);
        let b = generate("sb-2", net(3), &mut rng);
        assert_ne!(a.machine_id, b.machine_id);
        assert_ne!(a.rng_seed, b.rng_seed);
        assert_ne!(a.hostname, b.hostname);
        let (sa, sb) = (a.steps(), b.steps());
        assert!(sa.contains(&GuestStep::SetNetwork(net(2))) && sb.contains(&GuestStep::SetNetwork(net(3))));
    }

    #[test]
    fn formats() {
        let mut rng = StdRng::seed_from_u64(2);
        let id = generate("Sb_ABC.9", net(4), &mut rng);
        assert_eq!(id.hostname, "sb-abc-9");
        let machine_id = id.machine_id.unwrap();
        assert_eq!(machine_id.len(), 32);
        assert!(machine_id.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(id.rng_seed.len(), 64);
        assert_eq!(id.agent_token, None, "the gateway owns the token");
        assert_eq!(hostname_for("---"), "sandbox");
        assert_eq!(hostname_for(&"x".repeat(80)).len(), 63);
    }

    /// What the substrate writes is what the guest agent accepts.
    #[test]
    fn control_line_parses_on_the_guest_side() {
        let mut rng = StdRng::seed_from_u64(4);
        let id = generate("sb-1", net(6), &mut rng);
        let line = id.control_line();
        assert!(line.ends_with('\n') && line.matches('\n').count() == 1);
        assert_eq!(Identity::parse(&line).unwrap(), id);
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["hostname"], "sb-1");
        assert_eq!(v["address"], "10.77.0.6/16");
        assert_eq!(v["mac"], "02:c0:00:00:00:06");
        assert_eq!(v["rng_seed"].as_str().unwrap().len(), 128);
        assert!(v.get("agent_token").is_none());
    }
}
