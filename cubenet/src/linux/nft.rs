//! The Linux backend's rules, as `nft -f` scripts (pure; golden-tested).
//!
//! One table, `inet copse_<bridge>`, holds everything of one network:
//! - `forward` sends packets from the bridge to `from_sandbox`, which drops
//!   what no sandbox may reach (`always_blocked`: the sandbox subnet itself,
//!   loopback, "this network", multicast and broadcast), then what the
//!   operator has not opened of the host's neighbourhood (`protected`, see
//!   [`crate::neighbourhood`]; the host's resolvers in it, `resolvers`, pass
//!   on port 53 only), and then jumps, by source address, to the sandbox's
//!   own `egress_<id>` chain through the `egress` verdict map. Both blocks
//!   come before the sandbox's chain, so no tenant policy reopens them.
//!   Packets towards a sandbox go through `ingress_<id>`, which admits
//!   replies only, and only from peers the policy still admits.
//! - Policies are checked on every packet, not only a connection's first:
//!   tightening a policy cuts flows it no longer admits at their next packet
//!   without touching conntrack.
//! - A tenant's DNS servers (`dns_<id>`) are admitted on port 53 only, TCP
//!   and UDP.
//! - `input` refuses everything that arrives from the bridge: the host
//!   offers sandboxes no service (the gateway talks to them over unix
//!   sockets), and every address of the host, on any interface, is local
//!   delivery, so this covers them all.
//! - `spoof_<id>`, an ingress hook on the sandbox's host-side interface,
//!   drops IPv4 and ARP not sourced from the sandbox's address, and IPv6,
//!   so a sandbox can neither spoof nor poison the host's ARP cache.
//! - `postrouting` masquerades the subnet towards every other interface.
//!
//! Sandbox-to-sandbox frames never reach these hooks: bridge ports are
//! `isolated`, so the bridge does not switch between them at all.
//!
//! - Sandboxes whose policy names hosts are in `proxied`: their TCP to
//!   ports 80 and 443 is redirected (`prerouting`) to the egress proxy's
//!   port on the bridge address, which `input` admits for redirected
//!   connections only (`ct status dnat`), so the proxy is not a service a
//!   sandbox can address. Redirected flows never cross `forward`: the
//!   proxy's own connections carry [`PROXY_MARK`], and `output` refuses
//!   them what `from_sandbox` refuses every sandbox (`always_blocked`,
//!   `protected`) and every address of the host itself.
//! - Sandboxes with a SOCKS5 upstream are in `tunnelled`: all their TCP
//!   is redirected to the same proxy, which checks the destination
//!   against the sandbox's policy and the blocks above itself (the
//!   connection it makes goes to the upstream, not the destination) and
//!   tunnels it.
//!
//! - Every sandbox's TCP and UDP to port 53, whatever the destination, is
//!   redirected (`prerouting`, before the proxy's redirects) to copse's
//!   resolver on the bridge address (see [`crate::dnsfilter`]), so naming
//!   another server does not bypass it. `input` admits redirected packets
//!   only, at most [`DNS_RATE`] per second from each sandbox (`dns_rate`),
//!   so one sandbox's flood never fills the resolver's queue for others.
//!
//! Every change is one script, which `nft -f` applies as one transaction.

use std::fmt::Write;

use ipnet::Ipv4Net;

use crate::neighbourhood::always_blocked;
use crate::net::{Attachment, NetConfig};
use crate::policy::ResolvedPolicy;

/// TCP or UDP to the DNS port, as one nft match.
const DNS: &str = "meta l4proto { tcp, udp } th dport 53";
const DNS_REPLY: &str = "meta l4proto { tcp, udp } th sport 53";

const REJECT: &str = "reject with icmpx admin-prohibited";

/// The fwmark of the egress proxy's upstream connections ("cops").
pub const PROXY_MARK: u32 = 0x636f_7073;

pub use crate::dnsfilter::DNS_RATE;

pub use crate::net::Listeners;

/// The whole table with `sandboxes` attached, replacing whatever table of
/// that name exists (at start-up, and to reconcile after a crash), with
/// DNS and the web traffic of proxied sandboxes sent to `listeners` if
/// given.
pub fn table(cfg: &NetConfig, listeners: Option<Listeners>, sandboxes: &[(Attachment, ResolvedPolicy)]) -> String {
    let t = cfg.table();
    let mut out = String::new();
    // Declaring first makes the delete valid when no table exists yet.
    let _ = writeln!(out, "table inet {t}\ndelete table inet {t}");
    let _ = writeln!(out, "table inet {t} {{");
    let _ = writeln!(out, "\tmap egress {{\n\t\ttype ipv4_addr : verdict\n{}\t}}", map_elements(sandboxes, "egress"));
    let _ = writeln!(out, "\tmap ingress {{\n\t\ttype ipv4_addr : verdict\n{}\t}}", map_elements(sandboxes, "ingress"));
    out.push_str(&interval_set("always_blocked", &always_blocked(cfg.subnet)));
    out.push_str(&interval_set("protected", &cfg.neighbourhood.blocked()));
    out.push_str(&interval_set("resolvers", &cfg.neighbourhood.exempt_resolvers()));
    out.push_str(&address_set("proxied", sandboxes, |p| p.proxied));
    out.push_str(&address_set("tunnelled", sandboxes, |p| p.tunnelled));
    let bridge = &cfg.bridge;
    let _ = writeln!(
        out,
        "\tchain forward {{\n\t\ttype filter hook forward priority filter; policy accept;\n\
         \t\tiifname \"{bridge}\" jump from_sandbox\n\t\toifname \"{bridge}\" jump to_sandbox\n\t}}"
    );
    let _ = writeln!(
        out,
        "\tchain from_sandbox {{\n\t\tip daddr @always_blocked {REJECT}\n\t\tmeta nfproto ipv6 drop\n\
         \t\tip daddr @resolvers {DNS} ip saddr vmap @egress\n\t\tip daddr @protected {REJECT}\n\
         \t\tip saddr vmap @egress\n\t\tdrop\n\t}}"
    );
    let _ = writeln!(
        out,
        "\tchain to_sandbox {{\n\t\tip saddr @resolvers {DNS_REPLY} ip daddr vmap @ingress\n\
         \t\tip saddr @protected drop\n\t\tip daddr vmap @ingress\n\t\tdrop\n\t}}"
    );
    let admit_proxy = match listeners {
        Some(Listeners { proxy: port, dns }) => {
            let _ = writeln!(
                out,
                "\tset dns_rate {{\n\t\ttype ipv4_addr\n\t\tsize 65536\n\t\tflags dynamic,timeout\n\t\ttimeout 1m\n\t}}"
            );
            let _ = writeln!(
                out,
                "\tchain prerouting {{\n\t\ttype nat hook prerouting priority dstnat; policy accept;\n\
                 \t\tiifname \"{bridge}\" {DNS} redirect to :{dns}\n\
                 \t\tiifname \"{bridge}\" ip saddr @tunnelled meta l4proto tcp redirect to :{port}\n\
                 \t\tiifname \"{bridge}\" ip saddr @proxied tcp dport {{ 80, 443 }} redirect to :{port}\n\t}}"
            );
            let m = format!("meta mark {PROXY_MARK:#x}");
            let _ = writeln!(
                out,
                "\tchain output {{\n\t\ttype filter hook output priority filter; policy accept;\n\
                 \t\t{m} ip daddr @always_blocked {REJECT}\n\t\t{m} ip daddr @protected {REJECT}\n\
                 \t\t{m} fib daddr type local {REJECT}\n\t}}"
            );
            let to_dns = format!("iifname \"{bridge}\" meta l4proto {{ tcp, udp }} th dport {dns} ct status dnat");
            let burst = 2 * DNS_RATE;
            format!(
                "\t\tiifname \"{bridge}\" tcp dport {port} ct status dnat accept\n\
                 \t\t{to_dns} update @dns_rate {{ ip saddr limit rate over {DNS_RATE}/second burst {burst} packets }} drop\n\
                 \t\t{to_dns} accept\n"
            )
        }
        None => String::new(),
    };
    let _ = writeln!(
        out,
        "\tchain input {{\n\t\ttype filter hook input priority filter; policy accept;\n\
         {admit_proxy}\t\tiifname \"{bridge}\" {REJECT}\n\t}}"
    );
    let _ = writeln!(
        out,
        "\tchain postrouting {{\n\t\ttype nat hook postrouting priority srcnat; policy accept;\n\
         \t\tip saddr {} oifname != \"{bridge}\" masquerade\n\t}}",
        cfg.subnet
    );
    for (attachment, policy) in sandboxes {
        out.push_str(&policy_objects(attachment, policy));
        out.push_str(&spoof_chain(attachment));
    }
    out.push_str("}\n");
    out
}

/// Adds one sandbox to an existing table.
pub fn attach(cfg: &NetConfig, attachment: &Attachment, policy: &ResolvedPolicy) -> String {
    let t = cfg.table();
    let (addr, id) = (attachment.address, &attachment.id);
    format!(
        "table inet {t} {{\n{}{}}}\nadd element inet {t} egress {{ {addr} : jump egress_{id} }}\n\
         add element inet {t} ingress {{ {addr} : jump ingress_{id} }}\n{}",
        policy_objects(attachment, policy),
        spoof_chain(attachment),
        join_sets(cfg, attachment, policy)
    )
}

/// Puts a new sandbox in the sets its policy names. Nothing is deleted:
/// every detach (and every table rewrite) has already taken the address out
/// of both sets, and a deleted element would make the create wait an RCU
/// grace period (≈ 10 ms here) for the transaction to return.
fn join_sets(cfg: &NetConfig, attachment: &Attachment, policy: &ResolvedPolicy) -> String {
    let (t, addr) = (cfg.table(), attachment.address);
    let mut out = String::new();
    for (set, member) in [("proxied", policy.proxied), ("tunnelled", policy.tunnelled)] {
        if member {
            let _ = writeln!(out, "add element inet {t} {set} {{ {addr} }}");
        }
    }
    out
}

/// Puts the sandbox in or out of `proxied`, whether it was there or not
/// (adding an element that exists is no error; deleting one that does not
/// is, hence the add first).
fn set_proxied(cfg: &NetConfig, attachment: &Attachment, policy: &ResolvedPolicy) -> String {
    let (t, addr) = (cfg.table(), attachment.address);
    let mut out = String::new();
    for (set, member) in [("proxied", policy.proxied), ("tunnelled", policy.tunnelled)] {
        let _ = writeln!(out, "add element inet {t} {set} {{ {addr} }}");
        if !member {
            let _ = writeln!(out, "delete element inet {t} {set} {{ {addr} }}");
        }
    }
    out
}

/// A set of the addresses of the `sandboxes` whose policy is `member`.
fn address_set(name: &str, sandboxes: &[(Attachment, ResolvedPolicy)], member: fn(&ResolvedPolicy) -> bool) -> String {
    let members: Vec<String> =
        sandboxes.iter().filter(|(_, p)| member(p)).map(|(a, _)| a.address.to_string()).collect();
    let mut out = format!("\tset {name} {{\n\t\ttype ipv4_addr\n");
    if !members.is_empty() {
        let _ = writeln!(out, "\t\telements = {{ {} }}", members.join(", "));
    }
    out.push_str("\t}\n");
    out
}

/// Replaces one sandbox's policy; effective from the next packet.
pub fn update(cfg: &NetConfig, attachment: &Attachment, policy: &ResolvedPolicy) -> String {
    let t = cfg.table();
    let id = &attachment.id;
    let mut out = String::new();
    for object in
        [format!("set inet {t} allow_{id}"), format!("set inet {t} deny_{id}"), format!("set inet {t} dns_{id}")]
    {
        let _ = writeln!(out, "flush {object}");
    }
    for object in [format!("chain inet {t} egress_{id}"), format!("chain inet {t} ingress_{id}")] {
        let _ = writeln!(out, "flush {object}");
    }
    let _ = write!(out, "table inet {t} {{\n{}}}\n", policy_objects(attachment, policy));
    out.push_str(&set_proxied(cfg, attachment, policy));
    out
}

/// Removes one sandbox from the table.
pub fn detach(cfg: &NetConfig, attachment: &Attachment) -> String {
    let t = cfg.table();
    let (addr, id) = (attachment.address, &attachment.id);
    format!(
        "{}delete element inet {t} egress {{ {addr} }}\ndelete element inet {t} ingress {{ {addr} }}\n\
         delete chain inet {t} spoof_{id}\ndelete chain inet {t} egress_{id}\ndelete chain inet {t} ingress_{id}\n\
         delete set inet {t} allow_{id}\ndelete set inet {t} deny_{id}\ndelete set inet {t} dns_{id}\n",
        set_proxied(cfg, attachment, &ResolvedPolicy::default())
    )
}

/// Removes the whole network's rules.
pub fn delete_table(cfg: &NetConfig) -> String {
    let t = cfg.table();
    format!("table inet {t}\ndelete table inet {t}\n")
}

/// The sandbox's allow, DNS and deny sets and the chains that consult
/// them.
fn policy_objects(a: &Attachment, p: &ResolvedPolicy) -> String {
    let id = &a.id;
    let mut out = String::new();
    for (name, nets) in [("allow", &p.allow), ("dns", &p.dns), ("deny", &p.deny)] {
        out.push_str(&interval_set(&format!("{name}_{id}"), nets));
    }
    let refuse = if p.deny_all { REJECT.to_string() } else { format!("ip daddr @deny_{id} {REJECT}\n\t\taccept") };
    let _ = writeln!(
        out,
        "\tchain egress_{id} {{\n\t\tip daddr @allow_{id} accept\n\t\tip daddr @dns_{id} {DNS} accept\n\
         \t\t{refuse}\n\t}}"
    );
    // Only replies come in, and only from peers still admitted.
    let closing = if p.deny_all { "drop".to_string() } else { format!("ip saddr @deny_{id} drop\n\t\taccept") };
    let _ = writeln!(
        out,
        "\tchain ingress_{id} {{\n\t\tct state != {{ established, related }} drop\n\
         \t\tip saddr @allow_{id} accept\n\t\tip saddr @dns_{id} {DNS_REPLY} accept\n\t\t{closing}\n\t}}"
    );
    out
}

fn interval_set(name: &str, nets: &[Ipv4Net]) -> String {
    let mut out = format!("\tset {name} {{\n\t\ttype ipv4_addr\n\t\tflags interval\n");
    if !nets.is_empty() {
        let _ = writeln!(out, "\t\telements = {{ {} }}", join(nets));
    }
    out.push_str("\t}\n");
    out
}

fn spoof_chain(a: &Attachment) -> String {
    let (id, addr, dev) = (&a.id, a.address, &a.host_if);
    // The inet family has no `arp` matches: the sender address is the 32
    // bits at offset 14 of the ARP header (Ethernet/IPv4 ARP).
    let arp_sender = u32::from(addr);
    format!(
        "\tchain spoof_{id} {{\n\t\ttype filter hook ingress device \"{dev}\" priority -500; policy accept;\n\
         \t\tmeta protocol ip ip saddr != {addr} drop\n\t\tmeta protocol arp @nh,112,32 != {arp_sender:#010x} drop\n\
         \t\tmeta protocol ip6 drop\n\t}}\n"
    )
}

fn map_elements(sandboxes: &[(Attachment, ResolvedPolicy)], chain: &str) -> String {
    if sandboxes.is_empty() {
        return String::new();
    }
    let elements: Vec<String> =
        sandboxes.iter().map(|(a, _)| format!("{} : jump {chain}_{}", a.address, a.id)).collect();
    format!("\t\telements = {{ {} }}\n", elements.join(", "))
}

fn join(nets: &[Ipv4Net]) -> String {
    nets.iter().map(Ipv4Net::to_string).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::golden::check as golden;
    use crate::neighbourhood::Neighbourhood;
    use crate::policy::Policy;
    use crate::upstream::Upstream;

    fn cfg() -> NetConfig {
        NetConfig::new("copse0", "10.88.0.0/16").unwrap()
    }

    fn sandbox(n: u8, policy: Policy) -> (Attachment, ResolvedPolicy) {
        let a = cfg().attachment(&format!("sbx{n}"), std::net::Ipv4Addr::new(10, 88, 0, n));
        (a, policy.resolve(|_| vec!["93.184.216.34".parse().unwrap()]))
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn sandboxes() -> Vec<(Attachment, ResolvedPolicy)> {
        vec![
            sandbox(2, Policy::open()),
            sandbox(
                3,
                Policy::from_e2b(Some(false), &strings(&["example.com", "198.51.100.0/24"]), &[], None).unwrap(),
            ),
            sandbox(4, Policy::from_e2b(None, &[], &strings(&["203.0.113.0/24", "192.0.2.7"]), None).unwrap()),
            sandbox(
                5,
                Policy { upstream: Some(Upstream::from_e2b("192.0.2.10:1080", None, None).unwrap()), ..Policy::open() },
            ),
        ]
    }

    #[test]
    fn full_table() {
        golden("table.nft", &table(&cfg(), Some(Listeners { proxy: 40080, dns: 40053 }), &sandboxes()));
    }

    #[test]
    fn empty_table() {
        golden("table-empty.nft", &table(&cfg(), None, &[]));
    }

    #[test]
    fn opened_ranges_and_exempt_resolvers() {
        // An operator who opened a metadata address and one /16 of 10/8, on
        // a host whose resolver sits in 10/8 (and one in 127/8, which stays
        // blocked: the sandbox's loopback is its own).
        let neighbourhood = Neighbourhood::new(
            &strings(&["169.254.169.254", "10.20.0.0/16"]),
            "nameserver 10.255.255.53\nnameserver 127.0.0.53\n",
        )
        .unwrap();
        let cfg = cfg().with_neighbourhood(neighbourhood);
        golden("table-neighbourhood.nft", &table(&cfg, None, &[]));
    }

    #[test]
    fn attach_update_detach() {
        let (a, p) = sandboxes().remove(1);
        golden("attach.nft", &attach(&cfg(), &a, &p));
        golden("update.nft", &update(&cfg(), &a, &ResolvedPolicy::open()));
        golden("detach.nft", &detach(&cfg(), &a));
    }
}
