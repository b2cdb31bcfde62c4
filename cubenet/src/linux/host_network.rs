//! The Linux backend's effects: the bridge, one veth per sandbox, and the
//! nftables table rendered by [`super::nft`].
//!
//! Per change: one `nft -f` transaction. Per attach: rtnetlink requests
//! (see [`super::netlink`]) in the host namespace (veth with its peer
//! created straight in the sandbox's netns, enslaved as an isolated bridge
//! port) and from a thread that entered the sandbox's netns (address,
//! default route). Detaches are batched in the background
//! ([`super::janitor`]).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::claim::{self, BridgeClaim};
use crate::dns::resolve;
use crate::dns_proxy::DnsProxy;
use crate::egress::proxy::{EgressProxy, Policies};
use crate::linux::janitor::Janitor;
use crate::linux::netlink::{self, Rtnl};
use crate::linux::nft;
use crate::linux::tools::{ip_batch, nft_apply, nft_table_exists};
use crate::net::{Attachment, NetConfig, SandboxNetwork};
use crate::policy::{Policy, ResolvedPolicy};
use anyhow::{Context, bail};

struct Attached {
    attachment: Attachment,
    /// As asked for: the egress proxy matches its names.
    wanted: Policy,
    policy: ResolvedPolicy,
}

type AttachedMap = Arc<Mutex<HashMap<String, Attached>>>;

/// An attach's steps and their times.
pub type AttachSteps = Vec<(&'static str, Duration)>;

pub struct HostNetwork {
    cfg: NetConfig,
    attached: AttachedMap,
    janitor: Arc<Janitor>,
    proxy: EgressProxy,
    resolver: DnsProxy,
    _claim: BridgeClaim,
}

impl HostNetwork {
    /// Creates the bridge (and an empty table) unless they exist; leaves
    /// existing rules alone until [`Self::reconcile`].
    pub fn open(cfg: NetConfig) -> anyhow::Result<Self> {
        let claim = claim::claim(Path::new(claim::CLAIMS_DIR), &cfg.bridge)?;
        let bridge = &cfg.bridge;
        if netlink::index_of(bridge).is_err() {
            ip_batch(&format!("link add {bridge} type bridge\n"))?;
        }
        let gateway = format!("{}/{}", cfg.gateway(), cfg.subnet.prefix_len());
        ip_batch(&format!("addr replace {gateway} dev {bridge}\nlink set {bridge} up\n"))?;
        // Sandboxes are IPv4 only; the bridge must not offer link-local v6.
        let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{bridge}/disable_ipv6"), "1");
        // NAT needs forwarding; this is host-wide (documented in cubenet/README.md).
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").context("enabling IPv4 forwarding")?;
        let janitor = Janitor::start(cfg.clone())?;
        let attached: AttachedMap = Arc::default();
        let proxy = EgressProxy::start(cfg.clone(), policies_of(attached.clone()))?;
        let resolver = DnsProxy::start(cfg.clone(), policies_of(attached.clone()))?;
        let network = Self { cfg, attached, janitor, proxy, resolver, _claim: claim };
        // An existing table is rewritten by `reconcile`, which a restarted
        // gateway runs before attaching anything (it also points the
        // redirects at this proxy's and resolver's ports).
        if !network.table_exists() {
            nft_apply(&nft::table(&network.cfg, Some(network.listeners()), &[]))?;
        }
        Ok(network)
    }

    pub fn config(&self) -> &NetConfig {
        &self.cfg
    }

    /// See [`EgressProxy::set_secret_resolver`].
    pub fn set_secret_resolver(&self, resolver: crate::egress::rules::SecretResolver) {
        self.proxy.set_secret_resolver(resolver);
    }

    /// See [`EgressProxy::set_interceptor`].
    pub fn set_interceptor(&self, interceptor: std::sync::Arc<crate::egress::intercept::Interceptor>) {
        self.proxy.set_interceptor(interceptor);
    }

    /// Puts the sandbox whose init is `init_pid` on the bridge with
    /// `network.policy`. On error, whatever was made is removed. Returns
    /// how long each step took, in the order they started (`rules` and
    /// `inside` run side by side).
    ///
    /// The sandbox may already run processes (a restore, a fork), and root
    /// in it may configure its end of the veth as soon as it appears: the
    /// host end stays down, so no frame crosses, until the sandbox's rules
    /// (its policy, its spoofing guard) are in place.
    pub fn attach(&self, id: &str, init_pid: i32, network: &SandboxNetwork) -> anyhow::Result<AttachSteps> {
        let attachment = self.cfg.attachment(id, network.address);
        let policy = resolve(&self.cfg, &network.policy);
        let mut steps = AttachSteps::default();
        let timed = |f: &dyn Fn() -> anyhow::Result<()>| {
            let started = Instant::now();
            f().map(|()| started.elapsed())
        };
        let started = Instant::now();
        self.janitor.wait_for(&attachment);
        steps.push(("janitor", started.elapsed()));
        let result = (|| {
            let started = Instant::now();
            let host_index = self.plumb_host(&attachment, init_pid)?;
            steps.push(("veth", started.elapsed()));
            let ns = std::fs::File::open(format!("/proc/{init_pid}/ns/net"))
                .with_context(|| format!("opening the network namespace of {init_pid}"))?;
            // The inside needs no rule and the rules need only the host
            // end: both at once, since `nft` is most of an attach.
            let (rules, inside) = std::thread::scope(|s| {
                let inside = s.spawn(|| timed(&|| self.configure_inside(&attachment, &ns)));
                let rules = timed(&|| nft_apply(&nft::attach(&self.cfg, &attachment, &policy)));
                let inside = inside.join().map_err(|_| anyhow::anyhow!("netns thread panicked"))?;
                anyhow::Ok((rules?, inside?))
            })?;
            steps.extend([("rules", rules), ("inside", inside)]);
            let started = Instant::now();
            Rtnl::open()?.set_up(host_index)?;
            steps.push(("up", started.elapsed()));
            let wanted = network.policy.clone();
            self.lock().insert(id.to_string(), Attached { attachment: attachment.clone(), wanted, policy });
            Ok(())
        })();
        if result.is_err() {
            let _ = delete_link(&attachment.host_if);
        }
        result.map(|()| steps)
    }

    /// The veth, its host end an isolated bridge port, still down; returns
    /// the host end's index.
    fn plumb_host(&self, a: &Attachment, init_pid: i32) -> anyhow::Result<u32> {
        let mut rtnl = Rtnl::open()?;
        if let Ok(index) = netlink::index_of(&a.host_if) {
            // Left by a sandbox whose namespace the kernel has not finished
            // tearing down (detach leaves the veth to it).
            let _ = rtnl.delete_link(index);
        }
        rtnl.add_veth(&a.host_if, init_pid, netlink::index_of(&self.cfg.bridge)?)?;
        let index = netlink::index_of(&a.host_if)?;
        rtnl.isolate_port(index)?;
        Ok(index)
    }

    /// Address and default route inside the sandbox, from the calling
    /// thread, which is left in the sandbox's namespace `ns`: namespaces
    /// are per thread, and a netlink socket stays in the one it was opened
    /// in, so this runs on a throwaway thread.
    fn configure_inside(&self, a: &Attachment, ns: &std::fs::File) -> anyhow::Result<()> {
        nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).context("entering the sandbox netns")?;
        let mut rtnl = Rtnl::open()?;
        rtnl.add_address(netlink::index_of("eth0")?, a.address, self.cfg.subnet.prefix_len())?;
        rtnl.set_up(netlink::index_of("eth0")?)?;
        rtnl.set_up(netlink::index_of("lo")?)?;
        rtnl.add_default_route(self.cfg.gateway())
    }

    /// Replaces a sandbox's policy in one transaction. Host names are
    /// resolved now.
    pub fn update(&self, id: &str, policy: &Policy) -> anyhow::Result<()> {
        let mut attached = self.lock();
        let Some(entry) = attached.get_mut(id) else { bail!("sandbox {id} has no network attachment") };
        let resolved = resolve(&self.cfg, policy);
        nft_apply(&nft::update(&self.cfg, &entry.attachment, &resolved))?;
        entry.policy = resolved;
        entry.wanted = policy.clone();
        Ok(())
    }

    /// Removes the sandbox's rules, in the background (see `Janitor`);
    /// the veth is left to the kernel, which deletes it with the sandbox's
    /// namespace once its processes are gone (deleting it here waited for
    /// RCU grace periods, tens of ms, on every kill). Unknown ids are a
    /// no-op.
    pub fn detach(&self, id: &str) -> anyhow::Result<()> {
        if let Some(entry) = self.lock().remove(id) {
            self.janitor.push(entry.attachment);
        }
        Ok(())
    }

    /// Returns once every queued detach is done.
    pub fn settle(&self) {
        self.janitor.wait_all();
    }

    /// After a restart: the table is rewritten for `known` sandboxes (whose
    /// veths survived with them) and every veth of this network that belongs
    /// to none of them is deleted.
    pub fn reconcile(&self, known: &[(String, SandboxNetwork)]) -> anyhow::Result<()> {
        {
            let mut attached = self.lock();
            attached.clear();
            for (id, network) in known {
                let attachment = self.cfg.attachment(id, network.address);
                let policy = resolve(&self.cfg, &network.policy);
                attached.insert(id.clone(), Attached { attachment, wanted: network.policy.clone(), policy });
            }
        }
        self.rewrite()?;
        let keep: Vec<String> = self.lock().values().map(|a| a.attachment.host_if.clone()).collect();
        let stray: String = netlink::link_names()
            .into_iter()
            .filter(|name| self.cfg.owns_if(name) && !keep.contains(name))
            .map(|name| format!("link del {name}\n"))
            .collect();
        // A veth whose namespace is dying may vanish while this runs.
        if !stray.is_empty()
            && let Err(e) = ip_batch(&stray)
        {
            tracing::warn!("removing stray veths: {e:#}");
        }
        Ok(())
    }

    /// Removes the bridge and the table (tests and rigs with their own
    /// network; the gateway keeps them across restarts).
    pub fn remove(&self) -> anyhow::Result<()> {
        self.janitor.wait_all();
        nft_apply(&nft::delete_table(&self.cfg))?;
        delete_link(&self.cfg.bridge)?;
        Ok(())
    }

    fn rewrite(&self) -> anyhow::Result<()> {
        self.janitor.wait_all();
        let sandboxes: Vec<(Attachment, ResolvedPolicy)> =
            self.lock().values().map(|a| (a.attachment.clone(), a.policy.clone())).collect();
        // An ingress hook needs its device: leave out sandboxes whose veth
        // vanished (they are being destroyed).
        let present: Vec<(Attachment, ResolvedPolicy)> =
            sandboxes.into_iter().filter(|(a, _)| netlink::index_of(&a.host_if).is_ok()).collect();
        nft_apply(&nft::table(&self.cfg, Some(self.listeners()), &present))
    }

    fn listeners(&self) -> nft::Listeners {
        nft::Listeners { proxy: self.proxy.port(), dns: self.resolver.port() }
    }

    fn table_exists(&self) -> bool {
        nft_table_exists(&self.cfg.table())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Attached>> {
        self.attached.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The egress proxy's and the resolver's view of the attached sandboxes:
/// their policies by address.
fn policies_of(attached: AttachedMap) -> Policies {
    Arc::new(move |address| {
        let attached = attached.lock().unwrap_or_else(|p| p.into_inner());
        attached.values().find(|a| a.attachment.address == address).map(|a| a.wanted.clone())
    })
}

/// Deletes interface `name` of the host's namespace, if it exists.
pub(crate) fn delete_link(name: &str) -> anyhow::Result<()> {
    match netlink::index_of(name) {
        Ok(index) => Rtnl::open()?.delete_link(index),
        Err(_) => Ok(()),
    }
}
