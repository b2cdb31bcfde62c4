//! The FreeBSD backend's effects: [`System`] runs the command lines of
//! [`super::vnet`] and [`super::pf`] for [`super::jailnet::JailNetwork`],
//! and [`HostNetwork`] runs the egress proxy and the resolver its anchors
//! redirect to. Compiled for FreeBSD only; **never run on a FreeBSD host
//! yet**.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use anyhow::{Context, anyhow};

use crate::claim::{self, BridgeClaim};
use crate::dns_proxy::DnsProxy;
use crate::egress::intercept::Interceptor;
use crate::egress::proxy::EgressProxy;
use crate::egress::rules::SecretResolver;
use crate::freebsd::cmd::Cmd;
use crate::freebsd::jailnet::{JailNetwork, Runner};
use crate::net::{Listeners, NetConfig, SandboxNetwork};
use crate::policy::Policy;
use crate::process;

/// The only `PATH` the tools see; plans name them by absolute path anyway.
const HOST_PATH: &str = "/sbin:/bin:/usr/sbin:/usr/bin";

pub struct System;

impl Runner for System {
    fn run(&self, cmd: &Cmd) -> anyhow::Result<String> {
        let (program, args) = cmd.argv.split_first().ok_or_else(|| anyhow!("empty command"))?;
        let mut command = Command::new(program);
        command.args(args).env_clear().env("PATH", HOST_PATH);
        process::run(&mut command, cmd.stdin.as_deref()).with_context(|| format!("`{}`", cmd.argv.join(" ")))
    }
}

/// The host's sandbox network, with the egress proxy and the resolver on
/// the bridge address that every anchor's `rdr` rules send traffic to: the
/// same executors, and the same policies by address, as Linux's.
pub struct HostNetwork {
    network: JailNetwork<System>,
    _claim: BridgeClaim,
    proxy: EgressProxy,
    /// Kept for its listeners; dropping it stops them.
    _resolver: DnsProxy,
}

/// Opens the host's sandbox network ([`JailNetwork::open`]), starts the
/// proxy and the resolver on its bridge address (which the open assigned),
/// and points the anchors' redirects at them; fails if the operator's
/// pf.conf does not evaluate copse's `rdr-anchor`, or if another copse
/// process has the bridge.
pub fn open(cfg: NetConfig) -> anyhow::Result<HostNetwork> {
    let claim = claim::claim(Path::new(claim::CLAIMS_DIR), &cfg.bridge)?;
    let network = JailNetwork::open(cfg.clone(), System)?;
    let proxy = EgressProxy::start(cfg.clone(), network.policies())?;
    let resolver = DnsProxy::start(cfg, network.policies())?;
    let network = network.with_redirects(Listeners { proxy: proxy.port(), dns: resolver.port() })?;
    Ok(HostNetwork { network, _claim: claim, proxy, _resolver: resolver })
}

impl HostNetwork {
    pub fn config(&self) -> &NetConfig {
        self.network.config()
    }

    /// See [`EgressProxy::set_secret_resolver`].
    pub fn set_secret_resolver(&self, resolver: SecretResolver) {
        self.proxy.set_secret_resolver(resolver);
    }

    /// See [`EgressProxy::set_interceptor`].
    pub fn set_interceptor(&self, interceptor: Arc<Interceptor>) {
        self.proxy.set_interceptor(interceptor);
    }

    /// See [`JailNetwork::attach`].
    pub fn attach(&self, id: &str, jid: i32, network: &SandboxNetwork) -> anyhow::Result<()> {
        self.network.attach(id, jid, network)
    }

    /// See [`JailNetwork::update`].
    pub fn update(&self, id: &str, policy: &Policy) -> anyhow::Result<()> {
        self.network.update(id, policy)
    }

    /// See [`JailNetwork::detach`].
    pub fn detach(&self, id: &str) -> anyhow::Result<()> {
        self.network.detach(id)
    }

    /// See [`JailNetwork::reconcile`].
    pub fn reconcile(&self, known: &[(String, SandboxNetwork)]) -> anyhow::Result<()> {
        self.network.reconcile(known)
    }
}
