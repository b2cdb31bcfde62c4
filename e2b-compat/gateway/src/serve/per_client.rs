//! How many connections each client address has open, and the cap on it.
//! An IPv6 client is its /64: one host is usually handed a whole prefix.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

pub struct Clients {
    max: usize,
    open: Mutex<HashMap<IpAddr, usize>>,
}

/// One admitted connection; dropping it frees its place.
pub struct Slot {
    clients: Arc<Clients>,
    client: IpAddr,
}

impl Clients {
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self { max, open: Mutex::new(HashMap::new()) })
    }

    /// A place for a new connection from `ip`, unless it has `max` open.
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<Slot> {
        let client = client_of(ip);
        let mut open = self.lock();
        let count = open.entry(client).or_default();
        if *count >= self.max {
            return None;
        }
        *count += 1;
        Some(Slot { clients: self.clone(), client })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, usize>> {
        // Counts stay consistent: no code panics while holding the lock.
        self.open.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    #[cfg(test)]
    fn tracked(&self) -> usize {
        self.lock().len()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.clients.lock();
        if let Some(count) = open.get_mut(&self.client) {
            *count -= 1;
            // Addresses seen once must not accumulate.
            if *count == 0 {
                open.remove(&self.client);
            }
        }
    }
}

fn client_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_gets_max_connections_and_a_freed_place_back() {
        let clients = Clients::new(2);
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let a = clients.admit(ip).unwrap();
        let _b = clients.admit(ip).unwrap();
        assert!(clients.admit(ip).is_none());
        // Another address is counted apart.
        let _other = clients.admit("127.0.0.2".parse().unwrap()).unwrap();
        drop(a);
        assert!(clients.admit(ip).is_some());
    }

    #[test]
    fn an_ipv6_client_is_its_slash_64_and_mapped_ipv4_is_ipv4() {
        let clients = Clients::new(1);
        let _a = clients.admit("2001:db8:1:2::1".parse().unwrap()).unwrap();
        assert!(clients.admit("2001:db8:1:2:ffff::9".parse().unwrap()).is_none());
        assert!(clients.admit("2001:db8:1:3::1".parse().unwrap()).is_some());
        let _v4 = clients.admit("10.0.0.1".parse().unwrap()).unwrap();
        assert!(clients.admit("::ffff:10.0.0.1".parse().unwrap()).is_none());
    }

    #[test]
    fn closed_connections_leave_no_entry_behind() {
        let clients = Clients::new(4);
        for i in 0..100u8 {
            drop(clients.admit(IpAddr::from([10, 0, 0, i])).unwrap());
        }
        assert_eq!(clients.tracked(), 0);
    }
}
