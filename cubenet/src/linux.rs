//! The Linux backend's effects: the bridge, one veth per sandbox, and the
//! nftables table rendered by [`crate::nft`].
//!
//! Per change: one `nft -f` transaction. Per attach: one `ip -batch` in the
//! host namespace (veth with its peer created straight in the sandbox's
//! netns, enslaved as an isolated bridge port) and one in the sandbox's
//! netns (address, default route), spawned from a thread that entered it.

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Mutex;

use crate::dns::resolve;
use crate::net::{Attachment, NetConfig, SandboxNetwork};
use crate::nft;
use crate::policy::{Policy, ResolvedPolicy};
use crate::process;
use anyhow::{Context, bail};

struct Attached {
    attachment: Attachment,
    policy: ResolvedPolicy,
}

pub struct HostNetwork {
    cfg: NetConfig,
    attached: Mutex<HashMap<String, Attached>>,
}

impl HostNetwork {
    /// Creates the bridge (and an empty table) unless they exist; leaves
    /// existing rules alone until [`Self::reconcile`].
    pub fn open(cfg: NetConfig) -> anyhow::Result<Self> {
        let bridge = &cfg.bridge;
        if !Path::new("/sys/class/net").join(bridge).exists() {
            ip_batch(&format!("link add {bridge} type bridge\n"), None)?;
        }
        let gateway = format!("{}/{}", cfg.gateway(), cfg.subnet.prefix_len());
        ip_batch(&format!("addr replace {gateway} dev {bridge}\nlink set {bridge} up\n"), None)?;
        // Sandboxes are IPv4 only; the bridge must not offer link-local v6.
        let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{bridge}/disable_ipv6"), "1");
        // NAT needs forwarding; this is host-wide (documented in cubenet/README.md).
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").context("enabling IPv4 forwarding")?;
        let network = Self { cfg, attached: Mutex::new(HashMap::new()) };
        if !network.table_exists() {
            nft_apply(&nft::table(&network.cfg, &[]))?;
        }
        Ok(network)
    }

    pub fn config(&self) -> &NetConfig {
        &self.cfg
    }

    /// Puts the sandbox whose init is `init_pid` on the bridge with
    /// `network.policy`. On error, whatever was made is removed.
    pub fn attach(&self, id: &str, init_pid: i32, network: &SandboxNetwork) -> anyhow::Result<()> {
        let attachment = self.cfg.attachment(id, network.address);
        let policy = resolve(&network.policy);
        let result = self.plumb(&attachment, init_pid).and_then(|()| {
            nft_apply(&nft::attach(&self.cfg, &attachment, &policy))?;
            self.lock().insert(id.to_string(), Attached { attachment: attachment.clone(), policy });
            Ok(())
        });
        if result.is_err() {
            let _ = ip_batch(&format!("link del {}\n", attachment.host_if), None);
        }
        result
    }

    fn plumb(&self, a: &Attachment, init_pid: i32) -> anyhow::Result<()> {
        let (dev, bridge) = (&a.host_if, &self.cfg.bridge);
        ip_batch(
            &format!(
                "link add {dev} type veth peer name eth0 netns {init_pid}\nlink set {dev} master {bridge}\n\
                 link set dev {dev} type bridge_slave isolated on learning off\nlink set {dev} up\n"
            ),
            None,
        )?;
        let inside = format!(
            "addr add {}/{} dev eth0\nlink set eth0 up\nlink set lo up\nroute add default via {}\n",
            a.address,
            self.cfg.subnet.prefix_len(),
            self.cfg.gateway()
        );
        ip_batch(&inside, Some(init_pid))
    }

    /// Replaces a sandbox's policy in one transaction. Host names are
    /// resolved now.
    pub fn update(&self, id: &str, policy: &Policy) -> anyhow::Result<()> {
        let mut attached = self.lock();
        let Some(entry) = attached.get_mut(id) else { bail!("sandbox {id} has no network attachment") };
        let resolved = resolve(policy);
        nft_apply(&nft::update(&self.cfg, &entry.attachment, &resolved))?;
        entry.policy = resolved;
        Ok(())
    }

    /// Removes the sandbox's rules and veth. Unknown ids are a no-op.
    pub fn detach(&self, id: &str) -> anyhow::Result<()> {
        let Some(entry) = self.lock().remove(id) else { return Ok(()) };
        if let Err(e) = nft_apply(&nft::detach(&self.cfg, &entry.attachment)) {
            // Something of it was already gone: rebuild from what is known.
            tracing::warn!("detaching {id} incrementally failed ({e:#}); rewriting the table");
            self.rewrite()?;
        }
        if Path::new("/sys/class/net").join(&entry.attachment.host_if).exists() {
            ip_batch(&format!("link del {}\n", entry.attachment.host_if), None)?;
        }
        Ok(())
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
                attached.insert(id.clone(), Attached { attachment, policy: resolve(&network.policy) });
            }
        }
        self.rewrite()?;
        let keep: Vec<String> = self.lock().values().map(|a| a.attachment.host_if.clone()).collect();
        let stray: String = self
            .interfaces()
            .into_iter()
            .filter(|name| self.cfg.owns_if(name) && !keep.contains(name))
            .map(|name| format!("link del {name}\n"))
            .collect();
        // A veth whose namespace is dying may vanish while this runs.
        if !stray.is_empty()
            && let Err(e) = ip_batch(&stray, None)
        {
            tracing::warn!("removing stray veths: {e:#}");
        }
        Ok(())
    }

    /// Re-resolves the host names of every policy that has some, and
    /// applies the ones whose addresses changed.
    pub fn refresh_hosts(&self, policies: &[(String, Policy)]) -> anyhow::Result<()> {
        for (id, policy) in policies.iter().filter(|(_, p)| p.has_hosts()) {
            let resolved = resolve(policy);
            let changed = self.lock().get(id).is_some_and(|a| a.policy != resolved);
            if changed {
                self.update(id, policy)?;
            }
        }
        Ok(())
    }

    /// Removes the bridge and the table (tests and rigs with their own
    /// network; the gateway keeps them across restarts).
    pub fn remove(&self) -> anyhow::Result<()> {
        nft_apply(&nft::delete_table(&self.cfg))?;
        if Path::new("/sys/class/net").join(&self.cfg.bridge).exists() {
            ip_batch(&format!("link del {}\n", self.cfg.bridge), None)?;
        }
        Ok(())
    }

    fn rewrite(&self) -> anyhow::Result<()> {
        let sandboxes: Vec<(Attachment, ResolvedPolicy)> =
            self.lock().values().map(|a| (a.attachment.clone(), a.policy.clone())).collect();
        // An ingress hook needs its device: leave out sandboxes whose veth
        // vanished (they are being destroyed).
        let present: Vec<(Attachment, ResolvedPolicy)> =
            sandboxes.into_iter().filter(|(a, _)| Path::new("/sys/class/net").join(&a.host_if).exists()).collect();
        nft_apply(&nft::table(&self.cfg, &present))
    }

    fn table_exists(&self) -> bool {
        Command::new("nft")
            .args(["list", "table", "inet", &self.cfg.table()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    fn interfaces(&self) -> Vec<String> {
        std::fs::read_dir("/sys/class/net")
            .map(|d| d.filter_map(Result::ok).filter_map(|e| e.file_name().into_string().ok()).collect())
            .unwrap_or_default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Attached>> {
        self.attached.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Applies one nft script as one transaction.
pub fn nft_apply(script: &str) -> anyhow::Result<()> {
    process::run(Command::new("nft").args(["-f", "-"]), Some(script)).map(drop).context("nft")
}

/// Runs `ip -batch -`, in the network namespace of `netns_pid` if given.
fn ip_batch(script: &str, netns_pid: Option<i32>) -> anyhow::Result<()> {
    let mut command = Command::new("ip");
    command.args(["-batch", "-"]);
    match netns_pid {
        None => process::run(&mut command, Some(script)).map(drop),
        Some(pid) => {
            let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))
                .with_context(|| format!("opening the network namespace of {pid}"))?;
            // Namespaces are per thread, and a child inherits its spawning
            // thread's: enter in a throwaway thread, spawn, leave.
            std::thread::scope(|s| {
                s.spawn(|| {
                    nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
                        .context("entering the sandbox netns")?;
                    process::run(&mut command, Some(script)).map(drop)
                })
                .join()
                .map_err(|_| anyhow::anyhow!("netns thread panicked"))?
            })
        }
    }
    .with_context(|| format!("ip -batch: {}", script.lines().next().unwrap_or_default()))
}
