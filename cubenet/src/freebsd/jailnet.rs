//! The FreeBSD backend's executor logic: which plan of [`super::vnet`] and
//! [`super::pf`] to run when, what to read back, and what to undo. It runs
//! every command through a [`Runner`], so it compiles and is tested on any
//! OS with a scripted one; the runner that spawns the real tools is in
//! `super::system` (**not run on FreeBSD**).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail};

use crate::dns::resolve;
use crate::egress::Policies;
use crate::freebsd::cmd::Cmd;
use crate::freebsd::{pf, vnet};
use crate::net::{Attachment, Listeners, NetConfig, SandboxNetwork};
use crate::policy::{Policy, ResolvedPolicy};

pub trait Runner: Send + Sync {
    /// Runs one command; its stdout, or an error naming it.
    fn run(&self, cmd: &Cmd) -> anyhow::Result<String>;
}

struct Attached {
    attachment: Attachment,
    /// As asked for: the egress proxy and the resolver match its names.
    wanted: Policy,
    policy: ResolvedPolicy,
}

type AttachedMap = Arc<Mutex<HashMap<String, Attached>>>;

/// One gateway's sandbox network on a FreeBSD host: what is attached, with
/// which policy.
pub struct JailNetwork<R> {
    cfg: NetConfig,
    runner: R,
    /// Where the anchors redirect DNS and proxied web traffic; none until
    /// [`Self::with_redirects`].
    listeners: Option<Listeners>,
    attached: AttachedMap,
}

impl<R: Runner> JailNetwork<R> {
    /// Checks pf enforces this network's anchors, then creates the bridge
    /// unless it exists and (re)applies the host settings. Leaves existing
    /// anchors and epairs alone until [`Self::reconcile`].
    pub fn open(cfg: NetConfig, runner: R) -> anyhow::Result<Self> {
        if !pf::is_enabled(&runner.run(&pf::status())?) {
            bail!("pf is not enabled (pf_enable=\"YES\" in rc.conf, `service pf start`); see docs/freebsd.md");
        }
        if !pf::references_anchor(&cfg, &runner.run(&pf::main_rules())?) {
            bail!(
                "the pf ruleset does not evaluate copse's anchors, so no sandbox policy would apply; \
                 add this to /etc/pf.conf and run `pfctl -f /etc/pf.conf`:\n{}",
                pf::pf_conf_fragment(&cfg)
            );
        }
        let interfaces = vnet::parse_interfaces(&runner.run(&vnet::list_interfaces())?);
        let created = match interfaces.contains(&cfg.bridge) {
            true => None,
            false => Some(vnet::parse_created(&runner.run(&vnet::create_bridge())?).map_err(|e| anyhow!(e))?),
        };
        let network = Self { cfg, runner, listeners: None, attached: AttachedMap::default() };
        network.run_all(&vnet::bridge_setup(&network.cfg, created.as_deref()))?;
        Ok(network)
    }

    pub fn config(&self) -> &NetConfig {
        &self.cfg
    }

    /// The policies of the attached sandboxes by address, as asked for:
    /// what the egress proxy and the resolver serving this network consult.
    pub fn policies(&self) -> Policies {
        let attached = self.attached.clone();
        Arc::new(move |address| {
            let attached = attached.lock().unwrap_or_else(|p| p.into_inner());
            attached.values().find(|a| a.attachment.address == address).map(|a| a.wanted.clone())
        })
    }

    /// From now on, anchors send DNS and the web traffic of proxied
    /// policies to `listeners` on the bridge address (call it before the
    /// first attach or reconcile: anchors loaded earlier are not
    /// rewritten). Checks the operator's ruleset evaluates the anchors'
    /// `rdr` rules.
    pub fn with_redirects(mut self, listeners: Listeners) -> anyhow::Result<Self> {
        if !pf::references_rdr_anchor(&self.cfg, &self.runner.run(&pf::main_translation_rules())?) {
            bail!(
                "the pf ruleset does not evaluate copse's rdr-anchor, so no sandbox traffic would reach the \
                 egress proxy or resolver; add this to /etc/pf.conf and run `pfctl -f /etc/pf.conf`:\n{}",
                pf::pf_conf_fragment(&self.cfg)
            );
        }
        self.listeners = Some(listeners);
        Ok(self)
    }

    /// Puts the VNET jail `jid` of sandbox `id` on the bridge with
    /// `network.policy`. On error, whatever was made is removed.
    pub fn attach(&self, id: &str, jid: i32, network: &SandboxNetwork) -> anyhow::Result<()> {
        self.refuse_unenforceable(&network.policy)?;
        let attachment = self.cfg.attachment(id, network.address);
        let policy = resolve(&self.cfg, &network.policy);
        let epair = vnet::parse_epair(&self.runner.run(&vnet::create_epair())?).map_err(|e| anyhow!(e))?;
        if let Err(e) = self.run_all(&vnet::attach(&self.cfg, &attachment, &epair, jid, &policy, self.listeners)) {
            let interfaces = self.interfaces().unwrap_or_default();
            if let Err(undo) = self.run_each(&vnet::attach_undo(&self.cfg, &attachment, &epair, &interfaces)) {
                tracing::error!(sandbox = %id, "after a failed network attach: {undo:#}");
            }
            return Err(e.context(format!("attaching sandbox {id} to {}", self.cfg.bridge)));
        }
        let wanted = network.policy.clone();
        self.lock().insert(id.to_string(), Attached { attachment, wanted, policy });
        Ok(())
    }

    /// Replaces a sandbox's policy in one transaction. Host names are
    /// resolved now.
    pub fn update(&self, id: &str, policy: &Policy) -> anyhow::Result<()> {
        let mut attached = self.lock();
        let Some(entry) = attached.get_mut(id) else { bail!("sandbox {id} has no network attachment") };
        self.refuse_unenforceable(policy)?;
        let resolved = resolve(&self.cfg, policy);
        self.run_all(&vnet::update(&self.cfg, &entry.attachment, &resolved, &entry.policy, self.listeners))?;
        entry.policy = resolved;
        entry.wanted = policy.clone();
        Ok(())
    }

    /// Removes the sandbox's anchor, states and epair. Unknown ids are a
    /// no-op; every step is tried even if one fails.
    pub fn detach(&self, id: &str) -> anyhow::Result<()> {
        let Some(Attached { attachment, .. }) = self.lock().remove(id) else { return Ok(()) };
        let present = self.interfaces()?.contains(&attachment.host_if);
        self.run_each(&vnet::detach(&self.cfg, &attachment, present))
    }

    /// After a restart: the `known` sandboxes (whose epairs survived with
    /// their jails) get their anchors reloaded; every other anchor of this
    /// network is flushed and every other epair of it destroyed.
    pub fn reconcile(&self, known: &[(String, SandboxNetwork)]) -> anyhow::Result<()> {
        let known: Vec<(Attachment, ResolvedPolicy, Policy)> = known
            .iter()
            .map(|(id, n)| (self.cfg.attachment(id, n.address), resolve(&self.cfg, &n.policy), n.policy.clone()))
            .collect();
        *self.lock() = known
            .iter()
            .map(|(a, p, wanted)| {
                (a.id.clone(), Attached { attachment: a.clone(), wanted: wanted.clone(), policy: p.clone() })
            })
            .collect();
        let known: Vec<(Attachment, ResolvedPolicy)> = known.into_iter().map(|(a, p, _)| (a, p)).collect();
        // No parent anchor yet just means no sandbox was ever attached.
        let anchors = match self.runner.run(&pf::list_anchors(&self.cfg)) {
            Ok(listing) => pf::parse_anchors(&self.cfg, &listing),
            Err(e) => {
                tracing::warn!("listing pf anchors: {e:#}");
                Vec::new()
            }
        };
        let members = vnet::parse_group(&self.runner.run(&vnet::list_group())?);
        self.run_each(&vnet::reconcile(&self.cfg, &known, &anchors, &members, self.listeners))
    }

    fn interfaces(&self) -> anyhow::Result<Vec<String>> {
        Ok(vnet::parse_interfaces(&self.runner.run(&vnet::list_interfaces())?))
    }

    /// Stops at the first failure.
    fn run_all(&self, steps: &[Cmd]) -> anyhow::Result<()> {
        for step in steps {
            self.runner.run(step)?;
        }
        Ok(())
    }

    /// Runs every step; fails afterwards if any did (clean-ups, where one
    /// thing already gone must not keep the rest in place).
    fn run_each(&self, steps: &[Cmd]) -> anyhow::Result<()> {
        let failed: Vec<String> =
            steps.iter().filter_map(|step| self.runner.run(step).err()).map(|e| format!("{e:#}")).collect();
        match failed.is_empty() {
            true => Ok(()),
            false => bail!("{}", failed.join("; ")),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Attached>> {
        self.attached.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Entries only the egress proxy can enforce (denied names, wildcards,
    /// an upstream, rules) are refused rather than dropped while the
    /// anchors redirect nothing to it: a network opened without
    /// [`Self::with_redirects`] (`freebsd::open` always redirects).
    fn refuse_unenforceable(&self, policy: &Policy) -> anyhow::Result<()> {
        if self.listeners.is_some() {
            return Ok(());
        }
        let wildcard = policy.allow.iter().any(|t| matches!(t, crate::policy::Target::Host(h) if h.starts_with("*.")));
        if wildcard || !policy.deny_hosts.is_empty() {
            bail!("host names in deny_out and wildcard hosts need the egress proxy, which this network runs without");
        }
        if policy.upstream.is_some() {
            bail!("egress_proxy needs the egress proxy, which this network runs without");
        }
        if policy.rules.is_some() {
            bail!("network.rules needs the egress proxy, which this network runs without");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::egress::rules::{HeaderRules, Rule};
    use crate::golden::check as golden;
    use crate::upstream::Upstream;

    /// Records every command and answers from a script: `(argv prefix,
    /// reply)` pairs, first match wins; unmatched commands print nothing.
    struct Scripted {
        replies: Vec<(&'static str, Result<&'static str, &'static str>)>,
        log: Mutex<Vec<String>>,
    }

    impl Scripted {
        fn new(replies: Vec<(&'static str, Result<&'static str, &'static str>)>) -> Self {
            Self { replies, log: Mutex::new(Vec::new()) }
        }

        /// Everything run since the last call, one command per line.
        fn take(&self) -> String {
            std::mem::take(&mut *self.log.lock().unwrap()).iter().map(|c| format!("{c}\n")).collect()
        }
    }

    impl Runner for Scripted {
        fn run(&self, cmd: &Cmd) -> anyhow::Result<String> {
            self.log.lock().unwrap().push(cmd.to_string());
            let line = cmd.argv.join(" ");
            match self.replies.iter().find(|(prefix, _)| line.starts_with(prefix)) {
                Some((_, Ok(out))) => Ok(out.to_string()),
                Some((_, Err(e))) => bail!("`{line}`: {e}"),
                None => Ok(String::new()),
            }
        }
    }

    const ENABLED: &str = "Status: Enabled for 0 days 00:01:02           Debug: Urgent\n";
    const MAIN_RULES: &str = "anchor \"copse/copse0/*\" all\n";

    fn host(extra: Vec<(&'static str, Result<&'static str, &'static str>)>) -> Scripted {
        let mut replies = extra;
        replies.extend([
            ("/sbin/pfctl -s info", Ok(ENABLED)),
            ("/sbin/pfctl -s rules", Ok(MAIN_RULES)),
            ("/sbin/ifconfig -l", Ok("em0 lo0 copse0 copse0-7\n")),
            ("/sbin/ifconfig epair create", Ok("epair4a\n")),
        ]);
        Scripted::new(replies)
    }

    fn cfg() -> NetConfig {
        NetConfig::new("copse0", "10.88.0.0/16").unwrap()
    }

    fn sandbox(address: &str, policy: Policy) -> SandboxNetwork {
        SandboxNetwork { address: address.parse().unwrap(), policy }
    }

    fn only_example() -> Policy {
        let allow = ["198.51.100.10".to_string()];
        Policy::from_e2b(Some(false), &allow, &[], None).unwrap()
    }

    #[test]
    fn open_creates_a_missing_bridge() {
        let runner = Scripted::new(vec![
            ("/sbin/pfctl -s info", Ok(ENABLED)),
            ("/sbin/pfctl -s rules", Ok(MAIN_RULES)),
            ("/sbin/ifconfig -l", Ok("em0 lo0\n")),
            ("/sbin/ifconfig bridge create", Ok("bridge0\n")),
        ]);
        let network = JailNetwork::open(cfg(), runner).unwrap();
        golden("pf-open.plan", &network.runner.take());
    }

    #[test]
    fn open_reuses_the_bridge() {
        let network = JailNetwork::open(cfg(), host(vec![])).unwrap();
        golden("pf-open-existing.plan", &network.runner.take());
    }

    #[test]
    fn open_refuses_a_host_where_pf_would_not_enforce() {
        let disabled = host(vec![("/sbin/pfctl -s info", Ok("Status: Disabled for 0 days\n"))]);
        assert!(JailNetwork::open(cfg(), disabled).err().unwrap().to_string().contains("pf is not enabled"));
        let no_anchor = host(vec![("/sbin/pfctl -s rules", Ok("pass all\n"))]);
        let err = JailNetwork::open(cfg(), no_anchor).err().unwrap().to_string();
        assert!(err.contains("anchor \"copse/copse0/*\""), "{err}");
    }

    #[test]
    fn attach_update_detach() {
        let network = JailNetwork::open(cfg(), host(vec![])).unwrap();
        network.runner.take();
        network.attach("i3k2m9x", 12, &sandbox("10.88.0.7", Policy::open())).unwrap();
        golden("pf-attach.plan", &network.runner.take());

        network.update("i3k2m9x", &only_example()).unwrap();
        golden("pf-update-tighten.plan", &network.runner.take());
        // Widening keeps the states the sandbox has.
        network.update("i3k2m9x", &Policy::open()).unwrap();
        assert!(!network.runner.take().contains("-k"));
        assert!(network.update("other", &Policy::open()).is_err());

        network.detach("i3k2m9x").unwrap();
        golden("pf-detach.plan", &network.runner.take());
        network.detach("i3k2m9x").unwrap();
        assert_eq!(network.runner.take(), "", "a second detach does nothing");
    }

    const LISTENERS: Listeners = Listeners { proxy: 40080, dns: 40053 };

    fn redirecting(extra: Vec<(&'static str, Result<&'static str, &'static str>)>) -> JailNetwork<Scripted> {
        let mut replies = extra;
        replies.push(("/sbin/pfctl -s nat", Ok("rdr-anchor \"copse/copse0/*\" all\n")));
        // A name the test resolves without the host's resolver.
        let cfg = cfg().with_static_hosts(vec![("api.example.test".into(), "198.51.100.10".parse().unwrap())]);
        let network = JailNetwork::open(cfg, host(replies)).unwrap().with_redirects(LISTENERS).unwrap();
        network.runner.take();
        network
    }

    #[test]
    fn a_policy_update_switches_proxying_on_and_off() {
        let network = redirecting(vec![]);
        network.attach("i3k2m9x", 12, &sandbox("10.88.0.7", Policy::open())).unwrap();
        let attached = network.runner.take();
        assert!(
            attached.contains("port 53 tag copse_dns -> 10.88.0.1 port 40053") && !attached.contains("40080"),
            "{attached}"
        );
        // Naming a host sends web traffic to the proxy, in one anchor
        // load; flows opened directly before it are cut, or they would
        // carry on unchecked by name.
        let names = Policy::from_e2b(None, &["api.example.test".to_string()], &[], None).unwrap();
        network.update("i3k2m9x", &names).unwrap();
        golden("pf-update-proxy-on.plan", &network.runner.take());
        // Back to addresses only: the redirect goes, the flows stay (the
        // open policy admits where they go).
        network.update("i3k2m9x", &Policy::open()).unwrap();
        golden("pf-update-proxy-off.plan", &network.runner.take());
    }

    /// Everything only the egress proxy enforces: a wildcard, denied names,
    /// a rule's headers, a SOCKS5 upstream.
    fn name_matching(upstream: bool) -> Policy {
        let allow = ["*.api.example.test".to_string(), "198.51.100.20".to_string()];
        let deny = ["tracker.example.test".to_string(), "*.ads.example.test".to_string()];
        let mut policy = Policy::from_e2b(Some(false), &allow, &deny, None).unwrap();
        let rule = Rule { headers: Some(vec![("Authorization".into(), "Bearer ${e2b.secrets.token}".into())]) };
        policy.rules = Some(HeaderRules::from_e2b("team-a", vec![("api.example.test".into(), vec![rule])]).unwrap());
        if upstream {
            policy.upstream = Some(Upstream::from_e2b("socks.example.test:1080", Some("u"), Some("p")).unwrap());
        }
        policy
    }

    #[test]
    fn name_matching_policies_are_redirected_to_the_proxy() {
        let network = redirecting(vec![]);
        network.attach("i3k2m9x", 12, &sandbox("10.88.0.7", name_matching(false))).unwrap();
        golden("pf-attach-name-matching.plan", &network.runner.take());
        // With an upstream, all its TCP goes to the proxy, which tunnels it.
        network.update("i3k2m9x", &name_matching(true)).unwrap();
        golden("pf-update-tunnelled.plan", &network.runner.take());
    }

    #[test]
    fn the_proxy_and_resolver_see_the_policy_as_asked_for() {
        let network = redirecting(vec![]);
        let policies = network.policies();
        let at: std::net::Ipv4Addr = "10.88.0.7".parse().unwrap();
        assert!(policies(at).is_none());
        network.attach("i3k2m9x", 12, &sandbox("10.88.0.7", name_matching(false))).unwrap();
        // Names and rules unresolved: the proxy matches them per connection.
        assert_eq!(policies(at), Some(name_matching(false)));
        network.update("i3k2m9x", &name_matching(true)).unwrap();
        assert_eq!(policies(at), Some(name_matching(true)));
        assert!(policies("10.88.0.8".parse().unwrap()).is_none());
        network.reconcile(&[("i3k2m9x".to_string(), sandbox("10.88.0.7", Policy::open()))]).unwrap();
        assert_eq!(policies(at), Some(Policy::open()), "a restart re-adopts the stored policy");
        network.detach("i3k2m9x").unwrap();
        assert!(policies(at).is_none());
    }

    #[test]
    fn without_redirects_what_only_the_proxy_enforces_is_refused() {
        let network = JailNetwork::open(cfg(), host(vec![])).unwrap();
        network.runner.take();
        let err = network.attach("i3k2m9x", 12, &sandbox("10.88.0.7", name_matching(false))).unwrap_err();
        assert!(err.to_string().contains("need the egress proxy"), "{err:#}");
        assert_eq!(network.runner.take(), "", "refused before anything is made");
        let mut rules_only = Policy::open();
        rules_only.rules = name_matching(false).rules;
        assert!(network.attach("i3k2m9x", 12, &sandbox("10.88.0.7", rules_only)).is_err());
        let mut tunnelled = Policy::open();
        tunnelled.upstream = name_matching(true).upstream;
        assert!(network.attach("i3k2m9x", 12, &sandbox("10.88.0.7", tunnelled)).is_err());
        // Plain names still work there: pf enforces their addresses.
        let names = Policy::from_e2b(Some(false), &["198.51.100.20".to_string()], &[], None).unwrap();
        network.attach("i3k2m9x", 12, &sandbox("10.88.0.7", names)).unwrap();
    }

    #[test]
    fn redirects_need_the_operators_rdr_anchor() {
        let network = JailNetwork::open(cfg(), host(vec![("/sbin/pfctl -s nat", Ok("nat on em0 all -> (em0)\n"))]));
        let err = network.unwrap().with_redirects(LISTENERS).err().unwrap().to_string();
        assert!(err.contains("rdr-anchor \"copse/copse0/*\""), "{err}");
    }

    #[test]
    fn reconcile_reloads_the_known_anchors_with_their_redirects() {
        let network = redirecting(vec![("/sbin/ifconfig -g copse", Ok("copse0-7\n"))]);
        let names = Policy::from_e2b(None, &["api.example.test".to_string()], &[], None).unwrap();
        network.reconcile(&[("keep".to_string(), sandbox("10.88.0.7", names))]).unwrap();
        let steps = network.runner.take();
        assert!(steps.contains("port { 80, 443 } -> 10.88.0.1 port 40080"), "{steps}");
    }

    #[test]
    fn a_sandbox_is_under_its_anchor_before_it_has_a_route() {
        // A restored or forked jail has processes running while it is
        // attached: nothing may carry their packets before the anchor.
        let network = JailNetwork::open(cfg(), host(vec![])).unwrap();
        network.runner.take();
        let closed = Policy::from_e2b(Some(false), &[], &[], None).unwrap();
        network.attach("i3k2m9x", 12, &sandbox("10.88.0.7", closed)).unwrap();
        let steps = network.runner.take();
        let at = |needle: &str| steps.find(needle).unwrap_or_else(|| panic!("{needle} missing from\n{steps}"));
        let anchor = at("/sbin/pfctl -a copse/copse0/i3k2m9x -f -");
        for later in ["group copse up", "addm copse0-7", "epair4b vnet 12", "-j 12 epair4b inet", "/sbin/route -j 12"] {
            assert!(anchor < at(later), "the anchor must be loaded before `{later}`:\n{steps}");
        }
        assert!(at("/sbin/ifconfig epair4a name copse0-7") < anchor, "the anchor names the renamed host end");
    }

    #[test]
    fn a_failed_attach_removes_what_it_made() {
        let network = JailNetwork::open(
            cfg(),
            host(vec![
                ("/sbin/route -j 12 add default", Err("route: writing to routing socket: File exists")),
                ("/sbin/ifconfig -l", Ok("em0 lo0 copse0 copse0-7\n")),
            ]),
        )
        .unwrap();
        network.runner.take();
        let err = network.attach("i3k2m9x", 12, &sandbox("10.88.0.7", Policy::open())).unwrap_err();
        assert!(format!("{err:#}").contains("File exists"));
        golden("pf-attach-undo.plan", &network.runner.take());
        assert!(network.update("i3k2m9x", &Policy::open()).is_err(), "nothing is left attached");
    }

    #[test]
    fn reconcile_keeps_the_known_and_removes_the_rest() {
        let network = JailNetwork::open(
            cfg(),
            host(vec![
                ("/sbin/pfctl -a copse/copse0 -s Anchors", Ok("  copse/copse0/keep\n  copse/copse0/gone\n")),
                // copse1-3 belongs to another gateway's network.
                ("/sbin/ifconfig -g copse", Ok("copse0-7\ncopse0-a\ncopse1-3\n")),
            ]),
        )
        .unwrap();
        network.runner.take();
        network.reconcile(&[("keep".to_string(), sandbox("10.88.0.7", only_example()))]).unwrap();
        golden("pf-reconcile.plan", &network.runner.take());
        // The re-adopted sandbox is attached again.
        network.update("keep", &Policy::open()).unwrap();
    }

    #[test]
    fn reconcile_without_a_parent_anchor_still_removes_stray_epairs() {
        let network = JailNetwork::open(
            cfg(),
            host(vec![
                ("/sbin/pfctl -a copse/copse0 -s Anchors", Err("pfctl: DIOCGETRULESETS: Invalid argument")),
                ("/sbin/ifconfig -g copse", Ok("copse0-a\n")),
            ]),
        )
        .unwrap();
        network.runner.take();
        network.reconcile(&[]).unwrap();
        assert!(network.runner.take().ends_with("/sbin/pfctl -k 10.88.0.10\n/sbin/ifconfig copse0-a destroy\n"));
    }
}
