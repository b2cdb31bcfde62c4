//! The FreeBSD backend's pf side, as text and command lines (pure;
//! golden-tested on Linux, **not run on FreeBSD**).
//!
//! - The operator adds [`pf_conf_fragment`] to `/etc/pf.conf` once: NAT for
//!   the subnet and `anchor "copse/<bridge>/*"`, under which each sandbox
//!   gets its own anchor `copse/<bridge>/<id>`. The bridge level keeps two
//!   gateways with different networks from listing or flushing each
//!   other's anchors.
//! - Each anchor ([`anchor`]) holds the sandbox's `<allow>`, `<dns>` and
//!   `<deny>` tables and its rules: anti-spoofing, the always-blocked
//!   destinations (the host itself, the subnet, loopback, multicast), the
//!   host's neighbourhood the operator has not opened (`<protected>`, see
//!   [`crate::neighbourhood`]; the host's resolvers in it pass on port 53
//!   when the policy admits them), then the policy (DNS servers on port 53
//!   only), then `block` for anything else. Rules match on the sandbox's
//!   epair end as it enters the host (`net.link.bridge.pfil_member=1`). The
//!   neighbourhood rules come before the policy's, and every rule is
//!   `quick`, so no tenant policy reopens what the operator protects.
//! - With the host's [`Listeners`] given, the anchor also redirects
//!   (classic `rdr`, which FreeBSD keeps; the operator's `rdr-anchor`
//!   evaluates it) the sandbox's TCP and UDP to port 53, to any
//!   destination, to copse's resolver, and, when its policy is
//!   [`ResolvedPolicy::proxied`], its TCP to [`crate::egress::PORTS`] (all
//!   its TCP when [`ResolvedPolicy::tunnelled`]) to the egress proxy, both
//!   on the bridge address: the same redirects as Linux's nftables.
//!   Destinations no sandbox may reach (the host, `<blocked>`,
//!   `<protected>`) are excluded (`no rdr`) and meet the filter rules
//!   instead, so the proxy is never handed one. The proxy's redirect is
//!   `rdr pass`, which skips the filter rules (the proxy decides by name
//!   and address). The resolver's is tagged ([`DNS_TAG`]) and meets one
//!   filter rule, which passes tagged packets at most [`DNS_RATE`] per
//!   second (`max-pkt-rate`, counted per rule, so per sandbox; past it the
//!   packet is dropped), as Linux's `dns_rate` does. A sandbox connecting
//!   to a listener's port itself (untagged) is refused as any connection
//!   to the host is. The proxy's and the resolver's own connections leave
//!   from the host, not in on the sandbox's epair, so neither this
//!   anchor's `rdr` nor its filter rules (all `in on <epair>`) see them:
//!   pf cannot match them either (no socket mark), so they are held to
//!   what a sandbox may reach in user space ([`crate::egress`]'s
//!   `outbound`).
//! - An anchor and its tables are replaced atomically with
//!   `pfctl -a <anchor> -f -` (its `rdr` rules with them); pf keeps states
//!   past a rule change, so when a policy tightens, or starts sending the
//!   sandbox's web traffic to the proxy, the sandbox's states are killed
//!   (`pfctl -k`).

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;

use crate::dnsfilter::DNS_RATE;
use crate::egress;
use crate::freebsd::cmd::Cmd;
use crate::neighbourhood::always_blocked;
use crate::net::{Attachment, Listeners, NetConfig};
use crate::policy::{DNS_PORT, ResolvedPolicy};

pub const ROOT_ANCHOR: &str = "copse";
pub const PFCTL: &str = "/sbin/pfctl";

/// What the anchor's DNS `rdr` tags a redirected packet with, so its filter
/// rule passes redirected queries only.
pub const DNS_TAG: &str = "copse_dns";

/// Parent of this network's sandbox anchors.
pub fn parent_anchor(cfg: &NetConfig) -> String {
    format!("{ROOT_ANCHOR}/{}", cfg.bridge)
}

pub fn anchor_name(cfg: &NetConfig, id: &str) -> String {
    format!("{}/{id}", parent_anchor(cfg))
}

/// What the operator adds to `/etc/pf.conf` once (with `ext_if` set to the
/// host's uplink).
pub fn pf_conf_fragment(cfg: &NetConfig) -> String {
    format!(
        "# copse sandboxes ({bridge}, {subnet}); add once, then `pfctl -f /etc/pf.conf`\n\
         copse_net = \"{subnet}\"\n\
         nat on $ext_if inet from $copse_net to any -> ($ext_if)\n\
         rdr-anchor \"{parent}/*\"\n\
         anchor \"{parent}/*\"\n",
        bridge = cfg.bridge,
        subnet = cfg.subnet,
        parent = parent_anchor(cfg),
    )
}

/// The rules of one sandbox's anchor. pf evaluates `quick` rules in order;
/// every rule is `quick`, so nothing after the anchor in the operator's
/// ruleset can widen what it decided. Redirects to `listeners`, if given,
/// come first (pf wants translation before filtering; the first matching
/// one applies).
pub fn anchor(cfg: &NetConfig, a: &Attachment, policy: &ResolvedPolicy, listeners: Option<Listeners>) -> String {
    let (on, me) = (format!("on \"{}\"", a.host_if), a.address);
    let refuse = if policy.deny_all { "any".to_string() } else { "<deny>".to_string() };
    // pf has no jump back into a policy, so the resolver exemption is
    // decided here: only resolvers the policy admits on port 53 pass.
    let resolvers: Vec<Ipv4Net> =
        cfg.neighbourhood.exempt_resolvers().into_iter().filter(|r| policy.admits(r.addr(), DNS_PORT)).collect();
    let mut out = String::new();
    out.push_str(&table_line("allow", &policy.allow));
    out.push_str(&table_line("dns", &policy.dns));
    out.push_str(&table_line("deny", &policy.deny));
    out.push_str(&format!("table <blocked> const {{ {} }}\n", join(&always_blocked(cfg.subnet))));
    out.push_str(&const_table_line("protected", &cfg.neighbourhood.blocked()));
    if let Some(listeners) = listeners {
        out.push_str(&redirects(cfg, &on, me, policy, listeners));
    }
    out.push_str(&format!("block drop in quick {on} inet6 all\n"));
    out.push_str(&format!("block drop in quick {on} inet from ! {me} to any\n"));
    if let Some(listeners) = listeners {
        let (host, dns) = (cfg.gateway(), listeners.dns);
        let to_dns = format!("{on} inet proto {{ tcp, udp }} from {me} to {host} port {dns} tagged {DNS_TAG}");
        out.push_str(&format!("pass in quick {to_dns} max-pkt-rate {DNS_RATE}/1 keep state\n"));
        out.push_str(&format!("block drop in quick {to_dns}\n"));
    }
    out.push_str(&format!("block return in quick {on} inet from {me} to {{ self, <blocked> }}\n"));
    if !resolvers.is_empty() {
        out.push_str(&format!(
            "pass in quick {on} inet proto {{ tcp, udp }} from {me} to {{ {} }} port {DNS_PORT} keep state\n",
            join(&resolvers)
        ));
    }
    out.push_str(&format!("block return in quick {on} inet from {me} to <protected>\n"));
    out.push_str(&format!("pass in quick {on} inet from {me} to <allow> keep state\n"));
    out.push_str(&format!(
        "pass in quick {on} inet proto {{ tcp, udp }} from {me} to <dns> port {DNS_PORT} keep state\n"
    ));
    out.push_str(&format!("block return in quick {on} inet from {me} to {refuse}\n"));
    if !policy.deny_all {
        out.push_str(&format!("pass in quick {on} inet from {me} to any keep state\n"));
    }
    out.push_str(&format!("block drop in quick {on} all\n"));
    out
}

/// The `rdr` rules of one sandbox (see the module's documentation).
fn redirects(cfg: &NetConfig, on: &str, me: Ipv4Addr, policy: &ResolvedPolicy, listeners: Listeners) -> String {
    let host = cfg.gateway();
    let (proxy, dns) = (listeners.proxy, listeners.dns);
    let mut out = format!(
        "rdr {on} inet proto {{ tcp, udp }} from {me} to any port {DNS_PORT} tag {DNS_TAG} -> {host} port {dns}\n\
         no rdr {on} inet from {me} to {{ self, <blocked>, <protected> }}\n"
    );
    if policy.tunnelled {
        out.push_str(&format!("rdr pass {on} inet proto tcp from {me} to any -> {host} port {proxy}\n"));
    } else if policy.proxied {
        let ports = egress::PORTS.map(|p| p.to_string()).join(", ");
        out.push_str(&format!(
            "rdr pass {on} inet proto tcp from {me} to any port {{ {ports} }} -> {host} port {proxy}\n"
        ));
    }
    out
}

/// Whether `policy` sends web traffic to the proxy that `previous` let
/// through directly: the sandbox's open states would bypass the proxy.
pub fn starts_proxying(policy: &ResolvedPolicy, previous: &ResolvedPolicy) -> bool {
    (policy.proxied && !previous.proxied) || (policy.tunnelled && !previous.tunnelled)
}

fn table_line(name: &str, nets: &[Ipv4Net]) -> String {
    if nets.is_empty() {
        format!("table <{name}> persist\n")
    } else {
        format!("table <{name}> persist {{ {} }}\n", join(nets))
    }
}

/// A table the anchor never changes on its own (reloaded whole).
fn const_table_line(name: &str, nets: &[Ipv4Net]) -> String {
    if nets.is_empty() {
        format!("table <{name}> persist\n")
    } else {
        format!("table <{name}> const {{ {} }}\n", join(nets))
    }
}

fn join(nets: &[Ipv4Net]) -> String {
    nets.iter().map(Ipv4Net::to_string).collect::<Vec<_>>().join(", ")
}

/// Replaces the sandbox's anchor, rules (`rdr` ones included) and tables
/// in one transaction.
pub fn load(cfg: &NetConfig, a: &Attachment, policy: &ResolvedPolicy, listeners: Option<Listeners>) -> Cmd {
    Cmd::new(&[PFCTL, "-a", &anchor_name(cfg, &a.id), "-f", "-"]).stdin(anchor(cfg, a, policy, listeners))
}

/// Empties the anchor of sandbox `id`: its filter rules, its translation
/// (`rdr`) rules, then its tables (`-F all` is not used: whether it stays
/// inside the anchor is not documented). An anchor left without rules and
/// tables is removed by pf.
pub fn flush(cfg: &NetConfig, id: &str) -> [Cmd; 3] {
    let anchor = anchor_name(cfg, id);
    [
        Cmd::new(&[PFCTL, "-a", &anchor, "-F", "rules"]),
        Cmd::new(&[PFCTL, "-a", &anchor, "-F", "nat"]),
        Cmd::new(&[PFCTL, "-a", &anchor, "-F", "Tables"]),
    ]
}

/// Kills every state whose source is `address` (all of a sandbox's flows:
/// nothing reaches a sandbox that it did not open).
pub fn kill_states(address: Ipv4Addr) -> Cmd {
    Cmd::new(&[PFCTL, "-k", &address.to_string()])
}

/// `pfctl -s info`, for [`is_enabled`].
pub fn status() -> Cmd {
    Cmd::new(&[PFCTL, "-s", "info"])
}

/// `pfctl -s rules` (the main ruleset), for [`references_anchor`].
pub fn main_rules() -> Cmd {
    Cmd::new(&[PFCTL, "-s", "rules"])
}

/// `pfctl -s nat` (the main translation rules), for
/// [`references_rdr_anchor`].
pub fn main_translation_rules() -> Cmd {
    Cmd::new(&[PFCTL, "-s", "nat"])
}

/// `pfctl -a copse/<bridge> -s Anchors`: the sandbox anchors that exist.
pub fn list_anchors(cfg: &NetConfig) -> Cmd {
    Cmd::new(&[PFCTL, "-a", &parent_anchor(cfg), "-s", "Anchors"])
}

/// Whether `pfctl -s info` says pf is filtering. Its first line reads
/// `Status: Enabled for 0 days 01:02:03   Debug: Urgent`.
pub fn is_enabled(info: &str) -> bool {
    info.lines().any(|l| l.trim_start().starts_with("Status: Enabled"))
}

/// Whether the main ruleset (`pfctl -s rules`) evaluates this network's
/// anchors; without it a loaded anchor would enforce nothing.
pub fn references_anchor(cfg: &NetConfig, rules: &str) -> bool {
    let wanted = format!("anchor \"{}/*\"", parent_anchor(cfg));
    rules.lines().any(|l| l.trim_start().starts_with(&wanted))
}

/// Whether the main translation rules (`pfctl -s nat`) evaluate this
/// network's anchors' `rdr` rules; without it no sandbox traffic would
/// reach the proxy or the resolver, and names would go unchecked.
pub fn references_rdr_anchor(cfg: &NetConfig, rules: &str) -> bool {
    let wanted = format!("rdr-anchor \"{}/*\"", parent_anchor(cfg));
    rules.lines().any(|l| l.trim_start().starts_with(&wanted))
}

/// Sandbox ids from `pfctl -a copse/<bridge> -s Anchors`, which prints one
/// child per line as `  copse/<bridge>/<id>` (a bare `<id>` is accepted
/// too). Names pf reserves (leading `_`) and anything nested are skipped.
pub fn parse_anchors(cfg: &NetConfig, listing: &str) -> Vec<String> {
    let prefix = format!("{}/", parent_anchor(cfg));
    listing
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| l.strip_prefix(&prefix).unwrap_or(l))
        .filter(|id| !id.contains('/') && !id.starts_with('_'))
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::neighbourhood::Neighbourhood;
    use crate::policy::Policy;

    fn cfg() -> NetConfig {
        NetConfig::new("copse0", "10.88.0.0/16").unwrap()
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn operator_fragment() {
        crate::golden::check("pf.conf.fragment", &pf_conf_fragment(&cfg()));
    }

    #[test]
    fn deny_list_anchor() {
        let a = cfg().attachment("i3k2m9x", "10.88.0.7".parse().unwrap());
        let deny = Policy::from_e2b(None, &strings(&["203.0.113.9"]), &strings(&["203.0.113.0/24"]), None).unwrap();
        crate::golden::check("pf-anchor-deny.conf", &anchor(&cfg(), &a, &deny.resolve(|_| vec![]), None));
    }

    #[test]
    fn air_gapped_anchor_with_dns_and_an_opened_neighbourhood() {
        // The operator opened one metadata address; the host's resolver
        // sits in 10/8. The tenant blocks everything but one host name, so
        // its DNS servers pass on port 53 and the host's resolver does not
        // (the policy does not admit it).
        let neighbourhood = Neighbourhood::new(&strings(&["169.254.169.254"]), "nameserver 10.255.255.53\n").unwrap();
        let cfg = cfg().with_neighbourhood(neighbourhood);
        let a = cfg.attachment("i3k2m9x", "10.88.0.7".parse().unwrap());
        let closed = Policy::from_e2b(Some(false), &strings(&["example.com"]), &[], None).unwrap();
        let resolved = closed.resolve(|_| vec!["93.184.216.34".parse().unwrap()]);
        crate::golden::check("pf-anchor-dns.conf", &anchor(&cfg, &a, &resolved, None));
        // An open policy admits the host's resolver, on port 53 only.
        let open = anchor(&cfg, &a, &Policy::open().resolve(|_| vec![]), None);
        assert!(open.contains("proto { tcp, udp } from 10.88.0.7 to { 10.255.255.53/32 } port 53 keep state\n"));
        let resolver = open.find("to { 10.255.255.53/32 }").unwrap();
        assert!(resolver < open.find("to <protected>").unwrap(), "the exemption must come before the block");
    }

    const LISTENERS: Listeners = Listeners { proxy: 40080, dns: 40053 };

    fn allow_list() -> ResolvedPolicy {
        let policy = Policy::from_e2b(Some(false), &strings(&["example.com", "198.51.100.20"]), &[], None).unwrap();
        policy.resolve(|_| vec!["93.184.216.34".parse().unwrap()])
    }

    #[test]
    fn a_proxied_sandbox_sends_dns_and_web_traffic_to_the_host() {
        let a = cfg().attachment("i3k2m9x", "10.88.0.7".parse().unwrap());
        let names = Policy::from_e2b(None, &[], &strings(&["*.denied.test", "10.9.0.0/16"]), None).unwrap();
        let resolved = names.resolve(|_| vec![]);
        assert!(resolved.proxied, "a denied name is matched at the proxy");
        let text = anchor(&cfg(), &a, &resolved, Some(LISTENERS));
        crate::golden::check("pf-anchor-proxied.conf", &text);
        // pf refuses a ruleset whose translation rules follow filter rules.
        let last_rdr = text.rfind("rdr ").unwrap();
        assert!(
            text.lines()
                .filter(|l| l.starts_with("pass") || l.starts_with("block"))
                .all(|l| text.find(l).unwrap() > last_rdr)
        );
        // Where no sandbox may go is excluded before the web redirect, and
        // after the DNS one (copse's resolver answers every query).
        let (dns, excluded, web) = (
            text.find("port 53 tag copse_dns -> 10.88.0.1 port 40053").unwrap(),
            text.find("no rdr on \"copse0-7\" inet from 10.88.0.7 to { self, <blocked>, <protected> }").unwrap(),
            text.find("port { 80, 443 } -> 10.88.0.1 port 40080").unwrap(),
        );
        assert!(dns < excluded && excluded < web);
    }

    #[test]
    fn a_sandbox_that_is_not_proxied_only_has_its_dns_redirected() {
        let a = cfg().attachment("i3k2m9x", "10.88.0.7".parse().unwrap());
        let deny = Policy::from_e2b(None, &[], &strings(&["203.0.113.0/24"]), None).unwrap().resolve(|_| vec![]);
        assert!(!deny.proxied);
        let text = anchor(&cfg(), &a, &deny, Some(LISTENERS));
        crate::golden::check("pf-anchor-not-proxied.conf", &text);
        assert!(!text.contains("40080"), "no web redirect:\n{text}");
        // Without listeners (no proxy or resolver on this host) nothing is
        // redirected, whatever the policy.
        let without = anchor(&cfg(), &a, &allow_list(), None);
        assert!(!without.contains("rdr"), "{without}");
    }

    #[test]
    fn dns_goes_to_the_resolver_with_and_without_an_allow_list() {
        let a = cfg().attachment("i3k2m9x", "10.88.0.7".parse().unwrap());
        let listed = anchor(&cfg(), &a, &allow_list(), Some(LISTENERS));
        crate::golden::check("pf-anchor-allow-list.conf", &listed);
        let open = anchor(&cfg(), &a, &ResolvedPolicy::open(), Some(LISTENERS));
        let dns = "rdr on \"copse0-7\" inet proto { tcp, udp } from 10.88.0.7 to any port 53 tag copse_dns \
                   -> 10.88.0.1 port 40053\n";
        // The same redirect either way, to any destination: which names
        // resolve is the resolver's business (crate::dnsfilter), and
        // naming another server does not get around it.
        assert!(listed.contains(dns) && open.contains(dns));
        assert!(listed.contains("port { 80, 443 } -> 10.88.0.1 port 40080"), "host names are proxied");
        assert!(!open.contains("40080"));
    }

    #[test]
    fn redirected_dns_is_rate_limited_and_nothing_else_reaches_the_resolver() {
        let a = cfg().attachment("i3k2m9x", "10.88.0.7".parse().unwrap());
        let text = anchor(&cfg(), &a, &ResolvedPolicy::open(), Some(LISTENERS));
        let at = |needle: &str| text.find(needle).unwrap_or_else(|| panic!("{needle} missing from\n{text}"));
        // Only what the DNS rdr tagged passes, at the rate Linux allows;
        // past it the next rule drops it. Both before the block of the
        // host's own addresses, which the resolver's is.
        let pass = at("to 10.88.0.1 port 40053 tagged copse_dns max-pkt-rate 200/1 keep state\n");
        let over = at(
            "block drop in quick on \"copse0-7\" inet proto { tcp, udp } from 10.88.0.7 to 10.88.0.1 port 40053 tagged copse_dns\n",
        );
        let host = at("block return in quick on \"copse0-7\" inet from 10.88.0.7 to { self, <blocked> }");
        assert!(at("inet from ! 10.88.0.7 to any") < pass && pass < over && over < host);
        assert!(at("port 53 tag copse_dns -> 10.88.0.1 port 40053") < pass);
        assert_eq!(text.matches("copse_dns").count(), 3, "no other rule tags or passes by the tag");
        // Without listeners there is no resolver to admit.
        assert!(!anchor(&cfg(), &a, &ResolvedPolicy::open(), None).contains("copse_dns"));
    }

    #[test]
    fn proxying_starts_when_a_policy_names_hosts_or_tunnels() {
        let open = ResolvedPolicy::open();
        assert!(starts_proxying(&allow_list(), &open));
        assert!(!starts_proxying(&open, &allow_list()), "leaving the proxy keeps its flows");
        assert!(!starts_proxying(&allow_list(), &allow_list()));
        let tunnelled = ResolvedPolicy { tunnelled: true, ..ResolvedPolicy::default() };
        assert!(starts_proxying(&tunnelled, &allow_list()));
        let a = cfg().attachment("i3k2m9x", "10.88.0.7".parse().unwrap());
        let text = anchor(&cfg(), &a, &tunnelled, Some(LISTENERS));
        assert!(
            text.contains("rdr pass on \"copse0-7\" inet proto tcp from 10.88.0.7 to any -> 10.88.0.1 port 40080\n")
        );
    }

    #[test]
    fn status_and_main_ruleset_checks() {
        assert!(is_enabled("Status: Enabled for 0 days 00:12:01           Debug: Urgent\n\nState Table\n"));
        assert!(!is_enabled("Status: Disabled for 0 days 00:00:09          Debug: Urgent\n"));
        assert!(!is_enabled(""));
        let rules =
            "scrub in all fragment reassemble\nanchor \"copse/copse0/*\" all\npass out all flags S/SA keep state\n";
        assert!(references_anchor(&cfg(), rules));
        assert!(!references_anchor(&NetConfig::new("other", "10.9.0.0/16").unwrap(), rules));
        assert!(!references_anchor(&cfg(), "anchor \"copse/*\" all\n"));
        let nat = "nat on em0 inet from 10.88.0.0/16 to any -> (em0) round-robin\nrdr-anchor \"copse/copse0/*\" all\n";
        assert!(references_rdr_anchor(&cfg(), nat));
        assert!(!references_rdr_anchor(&cfg(), "nat on em0 inet from 10.88.0.0/16 to any -> (em0) round-robin\n"));
        assert!(!references_rdr_anchor(&cfg(), rules), "a filter anchor is no rdr-anchor");
    }

    #[test]
    fn anchors_are_parsed_to_sandbox_ids() {
        let listing = "  copse/copse0/i3k2m9x\n  copse/copse0/zz9\n  copse/copse0/_reserved\n  copse/copse0/a/b\n\n";
        assert_eq!(parse_anchors(&cfg(), listing), ["i3k2m9x", "zz9"]);
        assert_eq!(parse_anchors(&cfg(), "bare\n"), ["bare"]);
        assert!(parse_anchors(&cfg(), "").is_empty());
    }
}
