//! Sandbox addresses and egress policies, in the gateway's terms: the
//! address pool of the gateway's network, if it has one (cubenet's
//! [`AddressPool`] decides which address a sandbox gets; the gateway
//! persists it with the sandbox's record, so a restarted gateway hands the
//! pool back what its sandboxes hold), and E2B's network inputs turned
//! into a [`Policy`]. The substrate does the rest.

use std::net::Ipv4Addr;
use std::sync::Mutex;

use copse_cubenet::{AddressPool, HeaderRules, Rule};
use copse_cubenet::{Upstream, UpstreamError};
use copse_substrate::{NetConfig, Policy};

use crate::model::SandboxError;

/// E2B's network inputs, as the create and update bodies carry them.
#[derive(Debug, Default, Clone)]
pub struct NetworkRequest {
    pub allow_internet_access: Option<bool>,
    pub allow_out: Option<Vec<String>>,
    pub deny_out: Option<Vec<String>>,
    pub dns_servers: Option<Vec<String>>,
    pub egress_proxy: Option<EgressProxyRequest>,
    /// E2B's `network.rules`: host → ordered rules.
    pub rules: Option<Vec<(String, Vec<Rule>)>>,
}

/// E2B's `egress_proxy`, as asked for. `Debug` leaves the password out.
#[derive(Clone)]
pub struct EgressProxyRequest {
    pub address: String,
    pub username: Option<String>,
    pub password: Option<String>,
    pub tls: Option<EgressProxyTlsRequest>,
}

/// E2B's `egress_proxy.tls`, as asked for.
#[derive(Clone, Default)]
pub struct EgressProxyTlsRequest {
    pub enabled: bool,
    pub server_name: Option<String>,
    /// PEM. Public, but long: `Debug` gives its length.
    pub ca_cert: Option<String>,
}

impl std::fmt::Debug for EgressProxyRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EgressProxyRequest")
            .field("address", &self.address)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("tls", &self.tls)
            .finish()
    }
}

impl std::fmt::Debug for EgressProxyTlsRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EgressProxyTlsRequest")
            .field("enabled", &self.enabled)
            .field("server_name", &self.server_name)
            .field("ca_cert", &self.ca_cert.as_ref().map(String::len))
            .finish()
    }
}

impl EgressProxyRequest {
    fn upstream(&self) -> Result<Upstream, UpstreamError> {
        let upstream = Upstream::from_e2b(&self.address, self.username.as_deref(), self.password.as_deref())?;
        match &self.tls {
            Some(tls) if tls.enabled => upstream.with_tls(tls.server_name.as_deref(), tls.ca_cert.as_deref()),
            Some(tls) if tls.server_name.is_some() || tls.ca_cert.is_some() => Err(UpstreamError::TlsDisabled),
            _ => Ok(upstream),
        }
    }
}

impl NetworkRequest {
    /// `owner`: the team whose secrets the rules' placeholders name.
    pub fn policy(&self, owner: &str) -> Result<Policy, SandboxError> {
        let invalid = |e: &dyn std::fmt::Display| SandboxError::Invalid(e.to_string());
        let mut policy = Policy::from_e2b(
            self.allow_internet_access,
            self.allow_out.as_deref().unwrap_or_default(),
            self.deny_out.as_deref().unwrap_or_default(),
            self.dns_servers.as_deref(),
        )
        .map_err(|e| invalid(&e))?;
        if let Some(p) = &self.egress_proxy {
            policy.upstream = Some(p.upstream().map_err(|e| invalid(&e))?);
        }
        if let Some(rules) = self.rules.as_ref().filter(|r| !r.is_empty()) {
            policy.rules = Some(HeaderRules::from_e2b(owner, rules.clone()).map_err(|e| invalid(&e))?);
        }
        Ok(policy)
    }
}

/// The address pool of the gateway's network, shared by its requests.
/// Without a network, nobody gets an address.
pub struct Addresses {
    pool: Mutex<Option<AddressPool>>,
    config: Option<NetConfig>,
}

impl Addresses {
    pub fn new(config: Option<&NetConfig>) -> Self {
        Self { pool: Mutex::new(config.map(|c| AddressPool::new(c.subnet))), config: config.cloned() }
    }

    /// Refuses a SOCKS5 upstream the host may not dial for a sandbox: one
    /// at an address no sandbox reaches, or any without a sandbox network
    /// (no proxy runs then).
    pub fn check_upstream(&self, policy: &Policy) -> Result<(), SandboxError> {
        let Some(upstream) = &policy.upstream else { return Ok(()) };
        let Some(config) = &self.config else {
            return Err(SandboxError::Invalid("egress_proxy needs a gateway with a sandbox network".into()));
        };
        upstream.check_reachable(config).map_err(|e| SandboxError::Invalid(e.to_string()))
    }

    /// A free address for sandbox `id`; `None` when there is no network.
    pub fn take(&self, id: &str) -> Result<Option<Ipv4Addr>, SandboxError> {
        let mut pool = self.lock();
        let Some(pool) = pool.as_mut() else { return Ok(None) };
        Ok(Some(pool.take(id).map_err(anyhow::Error::from)?))
    }

    /// Records the address of a sandbox re-adopted after a restart.
    pub fn hold(&self, id: &str, address: Ipv4Addr) {
        if let Some(pool) = self.lock().as_mut() {
            pool.hold(id, address);
        }
    }

    /// Whether `address` is of this gateway's subnet (one a sandbox paused
    /// on another node holds is of that node's).
    pub fn is_local(&self, address: Ipv4Addr) -> bool {
        self.config.as_ref().is_some_and(|c| c.subnet.contains(&address))
    }

    pub fn release(&self, id: &str) {
        if let Some(pool) = self.lock().as_mut() {
            pool.release(id);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<AddressPool>> {
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which address comes next is cubenet's (see its `addresses` tests);
    /// the gateway adds only "no network, no address" and the error kind.
    #[test]
    fn addresses_come_from_the_network_if_there_is_one() {
        assert_eq!(Addresses::new(None).take("x").unwrap(), None);
        let addresses = Addresses::new(Some(&NetConfig::new("t", "10.9.0.0/29").unwrap()));
        addresses.hold("a", "10.9.0.2".parse().unwrap());
        let taken: Vec<String> = ["b", "c", "d", "e"].map(|id| addresses.take(id).unwrap().unwrap().to_string()).into();
        assert_eq!(taken, ["10.9.0.3", "10.9.0.4", "10.9.0.5", "10.9.0.6"]);
        assert!(matches!(addresses.take("f"), Err(SandboxError::Internal(_))), "the subnet is full");
        addresses.release("a");
        assert_eq!(addresses.take("f").unwrap(), Some("10.9.0.2".parse().unwrap()));
    }

    #[test]
    fn bad_targets_are_invalid_requests() {
        let request = NetworkRequest { deny_out: Some(vec!["not a host".into()]), ..Default::default() };
        assert!(matches!(request.policy("team"), Err(SandboxError::Invalid(_))));
    }

    #[test]
    fn rules_become_the_policys_with_the_team_that_owns_their_secrets() {
        let rule = |value: &str| Rule { headers: Some(vec![("X-Key".into(), value.into())]) };
        let with = |value: &str| NetworkRequest {
            rules: Some(vec![("API.test".into(), vec![rule(value)])]),
            ..Default::default()
        };
        let policy = with("${e2b.secrets.k}").policy("team-a").unwrap();
        let rules = policy.rules.as_ref().unwrap();
        assert_eq!((rules.owner.as_str(), rules.hosts[0].host.as_str()), ("team-a", "api.test"));
        assert!(policy.proxied(), "rules need the egress proxy");
        let identity = with("${e2b.identity.tokens.aws}").policy("t");
        assert!(matches!(identity, Err(SandboxError::Invalid(m)) if m.contains("workload identity is not supported")));
        let empty = NetworkRequest { rules: Some(vec![]), ..Default::default() };
        assert_eq!(empty.policy("t").unwrap().rules, None, "an empty map asks for nothing");
    }

    fn with_proxy(address: &str) -> NetworkRequest {
        let egress_proxy = EgressProxyRequest {
            address: address.into(),
            username: Some("user".into()),
            password: Some("s3cret-pw".into()),
            tls: None,
        };
        NetworkRequest { egress_proxy: Some(egress_proxy), ..Default::default() }
    }

    #[test]
    fn an_egress_proxy_becomes_the_policys_upstream_and_is_checked() {
        let request = with_proxy("192.0.2.10:1080");
        assert!(!format!("{request:?}").contains("s3cret"), "Debug redacts the password");
        let policy = request.policy("team").unwrap();
        assert_eq!(policy.upstream.as_ref().unwrap().address(), "192.0.2.10:1080");
        let addresses = Addresses::new(Some(&NetConfig::new("t", "10.9.0.0/29").unwrap()));
        addresses.check_upstream(&policy).unwrap();
        let on_the_host = with_proxy("127.0.0.1:1080").policy("team").unwrap();
        assert!(matches!(addresses.check_upstream(&on_the_host), Err(SandboxError::Invalid(_))));
        assert!(matches!(Addresses::new(None).check_upstream(&policy), Err(SandboxError::Invalid(_))));
        assert!(matches!(with_proxy("no-port").policy("team"), Err(SandboxError::Invalid(_))));
    }

    #[test]
    fn egress_proxy_tls_is_checked_and_off_means_no_fields() {
        let with_tls = |enabled: bool, server_name: Option<&str>, ca_cert: Option<&str>| {
            let mut request = with_proxy("proxy.test:1080");
            let tls = EgressProxyTlsRequest {
                enabled,
                server_name: server_name.map(str::to_string),
                ca_cert: ca_cert.map(str::to_string),
            };
            request.egress_proxy.as_mut().unwrap().tls = Some(tls);
            request.policy("team")
        };
        let on = with_tls(true, Some("Other.Test"), None).unwrap();
        assert_eq!(on.upstream.unwrap().tls.unwrap().server_name.as_deref(), Some("other.test"));
        assert_eq!(with_tls(false, None, None).unwrap().upstream.unwrap().tls, None);
        for refused in [
            with_tls(false, Some("other.test"), None),
            with_tls(true, Some("bad name"), None),
            with_tls(true, None, Some("not a certificate")),
        ] {
            assert!(matches!(refused, Err(SandboxError::Invalid(m)) if m.contains("egress_proxy.tls")));
        }
    }
}
