//! The FreeBSD backend, as plans (pure; golden-tested on Linux, **not run
//! on FreeBSD**).
//!
//! - The operator adds [`pf_conf_fragment`] to `/etc/pf.conf` once: NAT for
//!   the subnet and `anchor "copse/*"`, under which each sandbox gets its
//!   own anchor `copse/<id>`.
//! - Each anchor ([`anchor`]) holds the sandbox's `<allow>` and `<deny>`
//!   tables and its rules: anti-spoofing, the always-blocked destinations
//!   (the host itself, the subnet, loopback, link-local, multicast), then
//!   the policy, then `block` for anything else. Rules match on the
//!   sandbox's epair end as it enters the host (`net.link.bridge.pfil_member=1`).
//! - An anchor is replaced atomically with `pfctl -a copse/<id> -f -`;
//!   when a policy tightens, the sandbox's states are killed (`pfctl -k`).
//! - Plumbing: one `if_bridge` per network, one `epair` per sandbox whose
//!   host end is a *private* bridge member (private members cannot talk to
//!   each other) and whose other end moves into the VNET jail.

use std::fmt;

use ipnet::Ipv4Net;

use crate::net::{Attachment, NetConfig};
use crate::policy::ResolvedPolicy;

pub const ROOT_ANCHOR: &str = "copse";

const ALWAYS_BLOCKED: &[&str] = &["0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/3"];

/// One step of a plan. `Run` arguments may name `${jail_if}`, the jail-side
/// interface an earlier `CreateEpair` produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Run {
        argv: Vec<String>,
        stdin: Option<String>,
    },
    /// `ifconfig epair create` prints `epairNa`, whose peer is `epairNb`:
    /// rename the `a` end to `host_if`; remember the `b` end as `${jail_if}`.
    CreateEpair {
        host_if: String,
    },
    /// `ifconfig bridge create` prints `bridgeN`: rename it to `name`.
    CreateBridge {
        name: String,
    },
}

fn run(argv: &[&str]) -> Step {
    Step::Run { argv: argv.iter().map(|s| s.to_string()).collect(), stdin: None }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Run { argv, stdin: None } => write!(f, "{}", argv.join(" ")),
            Step::Run { argv, stdin: Some(input) } => {
                write!(f, "{} <<EOF\n{input}EOF", argv.join(" "))
            }
            Step::CreateEpair { host_if } => {
                write!(f, "ifconfig epair create  # epairNa -> {host_if}, epairNb -> ${{jail_if}}")
            }
            Step::CreateBridge { name } => write!(f, "ifconfig bridge create  # bridgeN -> {name}"),
        }
    }
}

/// What the operator adds to `/etc/pf.conf` once (with `ext_if` set to the
/// host's uplink).
pub fn pf_conf_fragment(cfg: &NetConfig) -> String {
    format!(
        "# copse sandboxes ({bridge}, {subnet}); add once, then `pfctl -f /etc/pf.conf`\n\
         copse_net = \"{subnet}\"\n\
         nat on $ext_if inet from $copse_net to any -> ($ext_if)\n\
         anchor \"{ROOT_ANCHOR}/*\"\n",
        bridge = cfg.bridge,
        subnet = cfg.subnet
    )
}

/// Creates the bridge and lets it route (once per host boot).
pub fn network_setup(cfg: &NetConfig) -> Vec<Step> {
    let gateway = format!("{}/{}", cfg.gateway(), cfg.subnet.prefix_len());
    vec![
        run(&["sysctl", "net.inet.ip.forwarding=1", "net.link.bridge.pfil_member=1", "net.link.bridge.pfil_bridge=0"]),
        Step::CreateBridge { name: cfg.bridge.clone() },
        run(&["ifconfig", &cfg.bridge, "inet", &gateway, "up"]),
    ]
}

/// Connects jail `jail` (a VNET jail) and loads its anchor.
pub fn attach(cfg: &NetConfig, a: &Attachment, policy: &ResolvedPolicy, jail: &str) -> Vec<Step> {
    let addr = format!("{}/{}", a.address, cfg.subnet.prefix_len());
    let gateway = cfg.gateway().to_string();
    vec![
        Step::CreateEpair { host_if: a.host_if.clone() },
        run(&["ifconfig", &cfg.bridge, "addm", &a.host_if, "private", &a.host_if]),
        run(&["ifconfig", &a.host_if, "up"]),
        run(&["ifconfig", "${jail_if}", "vnet", jail]),
        run(&["jexec", jail, "ifconfig", "${jail_if}", "name", "eth0"]),
        run(&["jexec", jail, "ifconfig", "eth0", "inet", &addr, "up"]),
        run(&["jexec", jail, "ifconfig", "lo0", "up"]),
        run(&["jexec", jail, "route", "add", "default", &gateway]),
        load_anchor(cfg, a, policy),
    ]
}

/// Replaces the sandbox's anchor; kills its states when the new policy
/// refuses something the previous one admitted.
pub fn update(cfg: &NetConfig, a: &Attachment, policy: &ResolvedPolicy, previous: &ResolvedPolicy) -> Vec<Step> {
    let mut steps = vec![load_anchor(cfg, a, policy)];
    if policy.tightens(previous) {
        steps.push(run(&["pfctl", "-k", &a.address.to_string()]));
    }
    steps
}

/// Removes the anchor, the sandbox's states and its epair (destroying one
/// end destroys both). Safe to run when any of them is gone.
pub fn detach(a: &Attachment) -> Vec<Step> {
    let anchor = anchor_name(a);
    vec![
        run(&["pfctl", "-a", &anchor, "-F", "all"]),
        run(&["pfctl", "-k", &a.address.to_string()]),
        run(&["ifconfig", &a.host_if, "destroy"]),
    ]
}

pub fn anchor_name(a: &Attachment) -> String {
    format!("{ROOT_ANCHOR}/{}", a.id)
}

fn load_anchor(cfg: &NetConfig, a: &Attachment, policy: &ResolvedPolicy) -> Step {
    Step::Run {
        argv: ["pfctl", "-a", &anchor_name(a), "-f", "-"].iter().map(|s| s.to_string()).collect(),
        stdin: Some(anchor(cfg, a, policy)),
    }
}

/// The rules of one sandbox's anchor. pf evaluates `quick` rules in order.
pub fn anchor(cfg: &NetConfig, a: &Attachment, policy: &ResolvedPolicy) -> String {
    let mut blocked: Vec<Ipv4Net> = ALWAYS_BLOCKED.iter().map(|s| s.parse().expect("valid constant")).collect();
    blocked.push(cfg.subnet);
    let (on, me) = (format!("on \"{}\"", a.host_if), a.address);
    let refuse = if policy.deny_all { "any".to_string() } else { "<deny>".to_string() };
    let mut out = String::new();
    out.push_str(&table_line("allow", &policy.allow));
    out.push_str(&table_line("deny", &policy.deny));
    out.push_str(&format!("table <blocked> const {{ {} }}\n", join(&Ipv4Net::aggregate(&blocked))));
    out.push_str(&format!("block drop in quick {on} inet6 all\n"));
    out.push_str(&format!("block drop in quick {on} inet from ! {me} to any\n"));
    out.push_str(&format!("block return in quick {on} inet from {me} to {{ self, <blocked> }}\n"));
    out.push_str(&format!("pass in quick {on} inet from {me} to <allow> keep state\n"));
    out.push_str(&format!("block return in quick {on} inet from {me} to {refuse}\n"));
    if !policy.deny_all {
        out.push_str(&format!("pass in quick {on} inet from {me} to any keep state\n"));
    }
    out.push_str(&format!("block in {on} all\n"));
    out
}

fn table_line(name: &str, nets: &[Ipv4Net]) -> String {
    if nets.is_empty() {
        format!("table <{name}> persist\n")
    } else {
        format!("table <{name}> persist {{ {} }}\n", join(nets))
    }
}

fn join(nets: &[Ipv4Net]) -> String {
    nets.iter().map(Ipv4Net::to_string).collect::<Vec<_>>().join(", ")
}

pub fn render(steps: &[Step]) -> String {
    steps.iter().map(|s| format!("{s}\n")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Policy;

    fn cfg() -> NetConfig {
        NetConfig::new("copse0", "10.88.0.0/16").unwrap()
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn golden(name: &str, actual: &str) {
        crate::nft::tests::golden(name, actual)
    }

    #[test]
    fn operator_fragment_and_setup() {
        golden("pf.conf.fragment", &pf_conf_fragment(&cfg()));
        golden("pf-setup.plan", &render(&network_setup(&cfg())));
    }

    #[test]
    fn attach_update_detach_plans() {
        let a = cfg().attachment("i3k2m9x", "10.88.0.7".parse().unwrap());
        let only = Policy::from_e2b(Some(false), &strings(&["198.51.100.10", "example.com"]), &[], None).unwrap();
        let only = only.resolve(|_| vec!["93.184.216.34".parse().unwrap()]);
        golden("pf-attach.plan", &render(&attach(&cfg(), &a, &ResolvedPolicy::open(), "copse-i3k2m9x")));
        golden("pf-update-tighten.plan", &render(&update(&cfg(), &a, &only, &ResolvedPolicy::open())));
        // Widening keeps the states it already has.
        assert_eq!(update(&cfg(), &a, &ResolvedPolicy::open(), &only).len(), 1);
        golden("pf-detach.plan", &render(&detach(&a)));
    }

    #[test]
    fn deny_list_anchor() {
        let a = cfg().attachment("i3k2m9x", "10.88.0.7".parse().unwrap());
        let deny = Policy::from_e2b(None, &strings(&["203.0.113.9"]), &strings(&["203.0.113.0/24"]), None).unwrap();
        golden("pf-anchor-deny.conf", &anchor(&cfg(), &a, &deny.resolve(|_| vec![])));
    }
}
