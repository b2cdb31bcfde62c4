//! Sandbox addresses: how a sandbox subnet is laid out (the host's address
//! on the bridge, the addresses nobody gets) and the pool that hands the
//! rest out to sandboxes and takes them back. The one place that decides
//! which address a sandbox has; the gateway only persists the answer with
//! each sandbox's record.

use std::collections::{BTreeSet, HashMap};
use std::net::Ipv4Addr;
use std::ops::Range;

use ipnet::Ipv4Net;

/// The host's address on the bridge, the sandboxes' default route: the
/// subnet's first host address.
pub fn gateway(subnet: Ipv4Net) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(subnet.network()) + 1)
}

/// Whether `address` is one a sandbox of `subnet` can have: any of the
/// subnet but its network, gateway and broadcast addresses.
pub fn is_sandbox_address(subnet: Ipv4Net, address: Ipv4Addr) -> bool {
    sandbox_range(subnet).contains(&u32::from(address))
}

/// The addresses sandboxes draw from, as integers.
fn sandbox_range(subnet: Ipv4Net) -> Range<u32> {
    u32::from(gateway(subnet)) + 1..u32::from(subnet.broadcast())
}

/// Every sandbox address of the subnet is taken.
#[derive(Debug, thiserror::Error)]
#[error("the sandbox subnet has no free address left")]
pub struct SubnetFull;

/// Which sandbox holds which address of one subnet. Addresses are handed
/// out round-robin: the first free one after the last handed out
/// (wrapping), so an address comes back only after the rest of the subnet.
/// The veth of a killed sandbox, named after its address, is deleted by
/// the kernel some time after the kill, and its successor would otherwise
/// wait for it.
#[derive(Debug)]
pub struct AddressPool {
    subnet: Ipv4Net,
    held: HashMap<String, Ipv4Addr>,
    used: BTreeSet<Ipv4Addr>,
    last: Option<Ipv4Addr>,
}

impl AddressPool {
    pub fn new(subnet: Ipv4Net) -> Self {
        Self { subnet, held: HashMap::new(), used: BTreeSet::new(), last: None }
    }

    /// A free address for sandbox `id`, now held by it.
    pub fn take(&mut self, id: &str) -> Result<Ipv4Addr, SubnetFull> {
        let range = sandbox_range(self.subnet);
        let start = self.last.map_or(range.start, |a| u32::from(a) + 1).clamp(range.start, range.end);
        let free = (start..range.end)
            .chain(range.start..start)
            .map(Ipv4Addr::from)
            .find(|a| !self.used.contains(a))
            .ok_or(SubnetFull)?;
        self.used.insert(free);
        self.last = Some(free);
        self.held.insert(id.to_string(), free);
        Ok(free)
    }

    /// Records the address of a sandbox re-adopted after a restart (read
    /// back from where the gateway persisted it). An address outside the
    /// subnet is remembered for `id` but keeps nothing from being handed
    /// out.
    pub fn hold(&mut self, id: &str, address: Ipv4Addr) {
        if self.subnet.contains(&address) {
            self.used.insert(address);
        }
        self.held.insert(id.to_string(), address);
    }

    /// Gives back the address of sandbox `id`, if it holds one.
    pub fn release(&mut self, id: &str) {
        if let Some(address) = self.held.remove(id) {
            self.used.remove(&address);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subnet(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }

    fn addr(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    /// Takes addresses for sandboxes `fill0`, `fill1`, … until none is left.
    fn fill(pool: &mut AddressPool) -> Vec<Ipv4Addr> {
        (0..).map_while(|n| pool.take(&format!("fill{n}")).ok()).collect()
    }

    #[test]
    fn gateway_and_reserved_addresses() {
        let net = subnet("10.9.0.0/29");
        assert_eq!(gateway(net), addr("10.9.0.1"));
        for reserved in ["10.9.0.0", "10.9.0.1", "10.9.0.7", "10.9.0.8", "10.8.255.255"] {
            assert!(!is_sandbox_address(net, addr(reserved)), "{reserved}");
        }
        assert!(is_sandbox_address(net, addr("10.9.0.2")));
        assert!(is_sandbox_address(net, addr("10.9.0.6")));
    }

    #[test]
    fn pool_skips_network_gateway_and_broadcast_and_reuses_released_when_full() {
        let mut pool = AddressPool::new(subnet("10.9.0.0/29"));
        pool.hold("old", addr("10.9.0.3"));
        let want: Vec<Ipv4Addr> = ["10.9.0.2", "10.9.0.4", "10.9.0.5", "10.9.0.6"].map(addr).to_vec();
        assert_eq!(fill(&mut pool), want);
        assert!(pool.take("one more").is_err());
        pool.release("old");
        assert_eq!(pool.take("next").unwrap(), addr("10.9.0.3"));
    }

    #[test]
    fn addresses_are_unique_and_handed_out_round_robin() {
        let mut pool = AddressPool::new(subnet("10.9.0.0/29"));
        let a = pool.take("a").unwrap();
        pool.hold("b", addr("10.9.0.3"));
        let c = pool.take("c").unwrap();
        assert_eq!((a, c), (addr("10.9.0.2"), addr("10.9.0.4")));
        pool.release("a");
        // Round-robin: a released address comes back only after the rest
        // of the subnet (so a dying veth is rarely met again).
        let next = ["d", "e"].map(|id| pool.take(id).unwrap());
        assert_eq!(next, [addr("10.9.0.5"), addr("10.9.0.6")]);
        assert_eq!(pool.take("f").unwrap(), a);
    }

    #[test]
    fn released_addresses_come_back_last() {
        let mut pool = AddressPool::new(subnet("10.9.0.0/29"));
        let a = pool.take("a").unwrap();
        pool.release("a");
        assert_eq!(pool.take("b").unwrap(), addr("10.9.0.3"));
        // The rest of the subnet, then `a` again once nothing else is left.
        assert_eq!(fill(&mut pool).last(), Some(&a));
        pool.release("fill3");
        assert_eq!(pool.take("a again").unwrap(), a);
    }

    #[test]
    fn addresses_outside_the_subnet_are_remembered_but_reserve_nothing() {
        let mut pool = AddressPool::new(subnet("10.9.0.0/29"));
        pool.hold("elsewhere", addr("192.0.2.2"));
        assert_eq!(pool.take("here").unwrap(), addr("10.9.0.2"));
        pool.release("elsewhere");
        pool.release("unknown");
        assert_eq!(pool.take("next").unwrap(), addr("10.9.0.3"));
    }
}
