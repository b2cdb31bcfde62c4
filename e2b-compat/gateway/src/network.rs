//! Sandbox addresses and egress policies, in the gateway's terms: which
//! address each sandbox holds (persisted with its record, so a restarted
//! gateway knows them), and E2B's network inputs turned into a
//! [`Policy`]. The substrate does the rest.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::Mutex;

use copse_cubenet::AddressPool;
use copse_substrate::{NetConfig, Policy};

use crate::sandboxes::SandboxError;

/// E2B's network inputs, as the create and update bodies carry them.
#[derive(Debug, Default, Clone)]
pub struct NetworkRequest {
    pub allow_internet_access: Option<bool>,
    pub allow_out: Option<Vec<String>>,
    pub deny_out: Option<Vec<String>>,
    pub dns_servers: Option<Vec<String>>,
}

impl NetworkRequest {
    pub fn policy(&self) -> Result<Policy, SandboxError> {
        Policy::from_e2b(
            self.allow_internet_access,
            self.allow_out.as_deref().unwrap_or_default(),
            self.deny_out.as_deref().unwrap_or_default(),
            self.dns_servers.as_deref(),
        )
        .map_err(|e| SandboxError::Invalid(e.to_string()))
    }
}

/// Which sandbox holds which address. Without a network, nobody gets one.
pub struct Addresses {
    inner: Mutex<Option<(AddressPool, HashMap<String, Ipv4Addr>)>>,
}

impl Addresses {
    pub fn new(config: Option<&NetConfig>) -> Self {
        Self { inner: Mutex::new(config.map(|c| (AddressPool::new(c.clone()), HashMap::new()))) }
    }

    /// A free address for sandbox `id`; `None` when there is no network.
    pub fn take(&self, id: &str) -> Result<Option<Ipv4Addr>, SandboxError> {
        let mut inner = self.lock();
        let Some((pool, held)) = inner.as_mut() else { return Ok(None) };
        let address = pool.take().ok_or_else(|| anyhow::anyhow!("the sandbox subnet has no free address left"))?;
        held.insert(id.to_string(), address);
        Ok(Some(address))
    }

    /// Records the address of a sandbox re-adopted after a restart.
    pub fn hold(&self, id: &str, address: Ipv4Addr) {
        if let Some((pool, held)) = self.lock().as_mut() {
            pool.mark_used(address);
            held.insert(id.to_string(), address);
        }
    }

    pub fn release(&self, id: &str) {
        if let Some((pool, held)) = self.lock().as_mut()
            && let Some(address) = held.remove(id)
        {
            pool.release(address);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(AddressPool, HashMap<String, Ipv4Addr>)>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_unique_and_come_back_on_release() {
        let addresses = Addresses::new(Some(&NetConfig::new("t", "10.9.0.0/29").unwrap()));
        let a = addresses.take("a").unwrap().unwrap();
        addresses.hold("b", "10.9.0.3".parse().unwrap());
        let c = addresses.take("c").unwrap().unwrap();
        assert_eq!((a.to_string(), c.to_string()), ("10.9.0.2".into(), "10.9.0.4".into()));
        addresses.release("a");
        // Handed out round-robin: a released address comes back only after
        // the rest of the subnet (so a dying veth is rarely met again).
        let next: Vec<String> = ["d", "e"].iter().map(|id| addresses.take(id).unwrap().unwrap().to_string()).collect();
        assert_eq!(next, ["10.9.0.5", "10.9.0.6"]);
        assert_eq!(addresses.take("f").unwrap(), Some(a));
        assert_eq!(Addresses::new(None).take("x").unwrap(), None);
    }

    #[test]
    fn bad_targets_are_invalid_requests() {
        let request = NetworkRequest { deny_out: Some(vec!["example.com".into()]), ..Default::default() };
        assert!(matches!(request.policy(), Err(SandboxError::Invalid(_))));
    }
}
