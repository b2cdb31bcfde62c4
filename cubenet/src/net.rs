//! The sandbox network of one gateway: a bridge, a subnet, and the
//! host-side interface each sandbox gets on it (which address it gets is
//! [`crate::addresses`]'s business).

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};

use crate::addresses;
use crate::neighbourhood::Neighbourhood;
use crate::policy::Policy;

pub const DEFAULT_BRIDGE: &str = "copse0";
pub const DEFAULT_SUBNET: &str = "10.88.0.0/16";

/// Host interface names are `<bridge>-<index in hex>`: the index of a /16
/// needs four digits and Linux allows 15 characters.
const MAX_BRIDGE_NAME: usize = 10;

/// The host's ports, on the bridge address, that sandbox traffic is
/// redirected to (nftables `redirect` on Linux, pf `rdr` on FreeBSD).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Listeners {
    /// The egress proxy (TCP).
    pub proxy: u16,
    /// copse's resolver (UDP and TCP).
    pub dns: u16,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetConfig {
    /// Bridge name; also names the nftables table and the pf root anchor's
    /// members, so two gateways with different bridges never touch each
    /// other's state.
    pub bridge: String,
    pub subnet: Ipv4Net,
    /// What sandboxes may reach of the host's own networks.
    #[serde(default)]
    pub neighbourhood: Neighbourhood,
    /// Names the operator pins to addresses (`--egress-hosts-file`), used
    /// before the host's resolver when policies name hosts.
    #[serde(default)]
    pub static_hosts: Vec<(String, Ipv4Addr)>,
}

impl Default for NetConfig {
    fn default() -> Self {
        Self {
            bridge: DEFAULT_BRIDGE.into(),
            subnet: DEFAULT_SUBNET.parse().expect("valid default subnet"),
            neighbourhood: Neighbourhood::default(),
            static_hosts: Vec::new(),
        }
    }
}

impl NetConfig {
    pub fn new(bridge: &str, subnet: &str) -> anyhow::Result<Self> {
        let subnet: Ipv4Net = subnet.parse().map_err(|_| anyhow::anyhow!("invalid subnet '{subnet}'"))?;
        if !(16..=29).contains(&subnet.prefix_len()) {
            anyhow::bail!("the sandbox subnet must be a /16 to /29, got /{}", subnet.prefix_len());
        }
        let valid = !bridge.is_empty()
            && bridge.len() <= MAX_BRIDGE_NAME
            && bridge.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && bridge.starts_with(|c: char| c.is_ascii_alphabetic());
        if !valid {
            anyhow::bail!(
                "bridge name '{bridge}' must be 1-{MAX_BRIDGE_NAME} letters, digits or '_', starting with a letter"
            );
        }
        Ok(Self {
            bridge: bridge.into(),
            subnet: subnet.trunc(),
            neighbourhood: Neighbourhood::default(),
            static_hosts: Vec::new(),
        })
    }

    /// The same network with the operator's decisions about the host's
    /// neighbourhood (by default every protected range is blocked and no
    /// resolver is exempt).
    pub fn with_neighbourhood(self, neighbourhood: Neighbourhood) -> Self {
        Self { neighbourhood, ..self }
    }

    /// The same network with names pinned to addresses (see
    /// [`crate::dns::parse_hosts`]).
    pub fn with_static_hosts(self, static_hosts: Vec<(String, Ipv4Addr)>) -> Self {
        Self { static_hosts, ..self }
    }

    /// The host's address on the bridge: the sandboxes' default route.
    pub fn gateway(&self) -> Ipv4Addr {
        addresses::gateway(self.subnet)
    }

    /// Name of the nftables table (Linux) holding every rule of this network.
    pub fn table(&self) -> String {
        format!("copse_{}", self.bridge)
    }

    /// Host-side interface of the sandbox at `address`.
    pub fn host_if(&self, address: Ipv4Addr) -> String {
        format!("{}-{:x}", self.bridge, self.index(address))
    }

    /// Whether `name` is a host-side interface this network would create.
    pub fn owns_if(&self, name: &str) -> bool {
        name.strip_prefix(&self.bridge)
            .and_then(|rest| rest.strip_prefix('-'))
            .is_some_and(|hex| !hex.is_empty() && hex.chars().all(|c| c.is_ascii_hexdigit()))
    }

    /// The sandbox address behind a host-side interface of this network
    /// (the inverse of [`Self::host_if`]), if it names one.
    pub fn address_of_if(&self, name: &str) -> Option<Ipv4Addr> {
        if !self.owns_if(name) {
            return None;
        }
        let index = u32::from_str_radix(&name[self.bridge.len() + 1..], 16).ok()?;
        let address = Ipv4Addr::from(u32::from(self.subnet.network()).checked_add(index)?);
        addresses::is_sandbox_address(self.subnet, address).then_some(address)
    }

    pub fn attachment(&self, id: &str, address: Ipv4Addr) -> Attachment {
        Attachment { id: id.to_string(), address, host_if: self.host_if(address) }
    }

    fn index(&self, address: Ipv4Addr) -> u32 {
        u32::from(address) - u32::from(self.subnet.network())
    }
}

/// What a substrate needs to put a sandbox on the network: the address the
/// gateway allocated (and persisted) and the policy to start with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxNetwork {
    pub address: Ipv4Addr,
    pub policy: Policy,
}

/// One sandbox on the network.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    pub id: String,
    pub address: Ipv4Addr,
    /// Host end of the sandbox's veth (Linux) or epair (FreeBSD).
    pub host_if: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_names_fit_linux_and_are_recognised() {
        let cfg = NetConfig::new("copse0", "10.88.0.0/16").unwrap();
        let last = cfg.host_if("10.88.255.254".parse().unwrap());
        assert_eq!(last, "copse0-fffe");
        assert!(last.len() <= 15);
        assert!(cfg.owns_if(&last));
        assert!(!cfg.owns_if("copse0"));
        assert!(!cfg.owns_if("copse01-5"));
        assert!(!cfg.owns_if("eth0"));
        assert_eq!(cfg.address_of_if(&last), Some("10.88.255.254".parse().unwrap()));
        assert_eq!(cfg.address_of_if("copse0-7"), Some("10.88.0.7".parse().unwrap()));
        // The network, gateway and broadcast addresses, and past the subnet.
        for name in ["copse0-0", "copse0-1", "copse0-ffff", "copse0-10000", "copse0-ffffffffff", "eth0"] {
            assert_eq!(cfg.address_of_if(name), None, "{name}");
        }
    }

    #[test]
    fn bad_configs_are_refused() {
        assert!(NetConfig::new("a-very-long-bridge", "10.88.0.0/16").is_err());
        assert!(NetConfig::new("copse0", "10.0.0.0/8").is_err());
        assert!(NetConfig::new("copse 0", "10.88.0.0/16").is_err());
        assert_eq!(NetConfig::new("t1", "10.89.3.4/24").unwrap().subnet.to_string(), "10.89.3.0/24");
    }
}
