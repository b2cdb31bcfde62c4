//! E2B's `network.httpsPorts`: the sandbox ports whose servers speak TLS,
//! which the agent reaches over TLS (without verifying their certificates,
//! as E2B does) while the client still talks to the gateway's own scheme.

use copse_protocol::headers::AGENT_PORT;

use super::error::{Result, SandboxError};

/// More than any real sandbox serves; the list is checked on every request
/// to a port, and kept in the sandbox's record.
pub const MAX_HTTPS_PORTS: usize = 64;

/// The ports as the data plane checks them: sorted, each once. The agent's
/// own port is refused (E2B refuses envd's), as are ports outside 1..=65535.
pub fn validate_https_ports(ports: &[i64]) -> Result<Vec<u16>> {
    let invalid = |why: String| Err(SandboxError::Invalid(format!("network.httpsPorts: {why}")));
    let mut valid = Vec::with_capacity(ports.len());
    for &port in ports {
        match u16::try_from(port) {
            Ok(AGENT_PORT) => {
                return invalid(format!("{AGENT_PORT} is the sandbox agent's port (envd) and cannot be listed"));
            }
            Ok(port) if port != 0 => valid.push(port),
            _ => return invalid(format!("{port} is not a port (1 to 65535)")),
        }
    }
    valid.sort_unstable();
    valid.dedup();
    if valid.len() > MAX_HTTPS_PORTS {
        return invalid(format!("at most {MAX_HTTPS_PORTS} ports, got {}", valid.len()));
    }
    Ok(valid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn https_ports_are_real_ports_other_than_the_agents() {
        assert_eq!(validate_https_ports(&[8443, 3000, 8443, 1, 65535]).unwrap(), [1, 3000, 8443, 65535]);
        assert_eq!(validate_https_ports(&[]).unwrap(), Vec::<u16>::new());
        for bad in [0, -1, 65536, 70000, i64::from(AGENT_PORT)] {
            let error = validate_https_ports(&[3000, bad]).unwrap_err().to_string();
            assert!(error.contains("network.httpsPorts") && error.contains(&bad.to_string()), "{bad}: {error}");
        }
    }

    #[test]
    fn https_ports_are_bounded_after_duplicates_collapse() {
        let many: Vec<i64> = (1..=MAX_HTTPS_PORTS as i64).collect();
        assert_eq!(validate_https_ports(&many).unwrap().len(), MAX_HTTPS_PORTS);
        let repeated: Vec<i64> = many.iter().chain(&many).copied().collect();
        assert_eq!(validate_https_ports(&repeated).unwrap().len(), MAX_HTTPS_PORTS);
        let one_more: Vec<i64> = (1..=MAX_HTTPS_PORTS as i64 + 1).collect();
        assert!(validate_https_ports(&one_more).unwrap_err().to_string().contains("at most"));
    }
}
