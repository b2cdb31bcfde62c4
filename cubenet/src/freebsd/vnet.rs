//! The FreeBSD backend's plumbing, as command lines (pure; golden-tested on
//! Linux through [`super::jailnet`], **not run on FreeBSD**).
//!
//! One `if_bridge` per network holds the gateway address. Each sandbox gets
//! an `epair`: the `a` end stays on the host, renamed to the attachment's
//! `host_if`, tagged (description `copse:<id>`, group [`GROUP`]) and made a
//! *private* bridge member (private members cannot talk to each other);
//! the `b` end moves into the sandbox's VNET jail and keeps its kernel name
//! `epairNb`, which stays unique while the pair lives, so an end returned to
//! the host by a removed jail can never clash with another interface.
//! Inside the jail, the host's own `ifconfig -j` and `route -j` set the
//! address and default route: no binary of the sandbox runs for it.

use crate::freebsd::cmd::Cmd;
use crate::freebsd::pf;
use crate::net::{Attachment, Listeners, NetConfig};
use crate::policy::ResolvedPolicy;

pub const IFCONFIG: &str = "/sbin/ifconfig";
pub const ROUTE: &str = "/sbin/route";
pub const SYSCTL: &str = "/sbin/sysctl";

/// Interface group of every host end copse creates: how they are found
/// again after a crash (`ifconfig -g`). Group names may not end in a digit.
pub const GROUP: &str = "copse";

/// Longest interface name FreeBSD takes (`IFNAMSIZ` less the NUL).
const MAX_IF_NAME: usize = 15;

/// Both ends of an epair as `ifconfig epair create` named them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Epair {
    pub host: String,
    pub jail: String,
}

/// `ifconfig -l`: every interface name on one line.
pub fn list_interfaces() -> Cmd {
    Cmd::new(&[IFCONFIG, "-l"])
}

pub fn parse_interfaces(out: &str) -> Vec<String> {
    out.split_whitespace().map(str::to_string).collect()
}

/// `ifconfig -g copse`: the host ends of copse's epairs, one per line.
pub fn list_group() -> Cmd {
    Cmd::new(&[IFCONFIG, "-g", GROUP])
}

pub fn parse_group(out: &str) -> Vec<String> {
    out.lines().map(str::trim).filter(|l| !l.is_empty()).map(str::to_string).collect()
}

/// `ifconfig bridge create` prints the new bridge's name.
pub fn create_bridge() -> Cmd {
    Cmd::new(&[IFCONFIG, "bridge", "create"])
}

/// `ifconfig epair create` prints the `a` end's name.
pub fn create_epair() -> Cmd {
    Cmd::new(&[IFCONFIG, "epair", "create"])
}

/// The one interface name a `create` printed.
pub fn parse_created(out: &str) -> Result<String, String> {
    let mut words = out.split_whitespace();
    match (words.next(), words.next()) {
        (Some(name), None) if is_if_name(name) => Ok(name.to_string()),
        _ => Err(format!("expected one interface name from ifconfig create, got {out:?}")),
    }
}

/// An `epairNa` name and its peer `epairNb`.
pub fn parse_epair(out: &str) -> Result<Epair, String> {
    let host = parse_created(out)?;
    let unit = host.strip_prefix("epair").and_then(|rest| rest.strip_suffix('a'));
    match unit {
        Some(n) if !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()) => {
            Ok(Epair { jail: format!("epair{n}b"), host })
        }
        _ => Err(format!("{host} is not the a end of an epair")),
    }
}

fn is_if_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_IF_NAME
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
}

/// Host set-up (idempotent): the bridge, renamed from `created` when this
/// start made it, with the gateway address; forwarding for NAT; pf on the
/// bridge's members, not on the bridge itself.
pub fn bridge_setup(cfg: &NetConfig, created: Option<&str>) -> Vec<Cmd> {
    let gateway = format!("{}/{}", cfg.gateway(), cfg.subnet.prefix_len());
    let mut steps = Vec::new();
    if let Some(name) = created {
        steps.push(Cmd::new(&[IFCONFIG, name, "name", &cfg.bridge]));
    }
    steps.push(Cmd::new(&[
        SYSCTL,
        "net.inet.ip.forwarding=1",
        "net.link.bridge.pfil_member=1",
        "net.link.bridge.pfil_bridge=0",
    ]));
    steps.push(Cmd::new(&[IFCONFIG, &cfg.bridge, "inet", &gateway, "up"]));
    steps
}

/// After [`create_epair`]: names the host end and loads the sandbox's
/// anchor for it first, then tags it, puts it on the bridge, moves the
/// other end into jail `jid` and configures it there. The jail may hold
/// running processes (a restore, a fork): the first packet they can send,
/// once the route exists, already meets the sandbox's rules, never only
/// the operator's main ruleset. `listeners`: see [`pf::anchor`].
pub fn attach(
    cfg: &NetConfig,
    a: &Attachment,
    epair: &Epair,
    jid: i32,
    policy: &ResolvedPolicy,
    listeners: Option<Listeners>,
) -> Vec<Cmd> {
    let (host, jail, jid) = (a.host_if.as_str(), epair.jail.as_str(), jid.to_string());
    let addr = format!("{}/{}", a.address, cfg.subnet.prefix_len());
    let description = format!("copse:{}", a.id);
    vec![
        Cmd::new(&[IFCONFIG, &epair.host, "name", host]),
        pf::load(cfg, a, policy, listeners),
        Cmd::new(&[IFCONFIG, host, "description", &description, "group", GROUP, "up"]),
        Cmd::new(&[IFCONFIG, &cfg.bridge, "addm", host, "private", host]),
        Cmd::new(&[IFCONFIG, jail, "vnet", &jid]),
        Cmd::new(&[IFCONFIG, "-j", &jid, jail, "inet", &addr, "up"]),
        Cmd::new(&[ROUTE, "-j", &jid, "add", "default", &cfg.gateway().to_string()]),
    ]
}

/// After a failed [`attach`]: the epair under whichever name it has by
/// now (`interfaces` is `ifconfig -l` read after the failure) and the
/// anchor, in case it was loaded.
pub fn attach_undo(cfg: &NetConfig, a: &Attachment, epair: &Epair, interfaces: &[String]) -> Vec<Cmd> {
    let mut steps: Vec<Cmd> = pf::flush(cfg, &a.id).into();
    for name in [&epair.host, &a.host_if] {
        if interfaces.contains(name) {
            steps.push(Cmd::new(&[IFCONFIG, name, "destroy"]));
        }
    }
    steps
}

/// Replaces the sandbox's anchor; kills its states when the new policy
/// refuses something the previous one admitted, or sends to the proxy
/// what the previous one let through directly (pf lets an established
/// state pass without looking at the rules, or the `rdr` rules, again).
pub fn update(
    cfg: &NetConfig,
    a: &Attachment,
    policy: &ResolvedPolicy,
    previous: &ResolvedPolicy,
    listeners: Option<Listeners>,
) -> Vec<Cmd> {
    let mut steps = vec![pf::load(cfg, a, policy, listeners)];
    if policy.tightens(previous) || (listeners.is_some() && pf::starts_proxying(policy, previous)) {
        steps.push(pf::kill_states(a.address));
    }
    steps
}

/// Removes the anchor, the sandbox's states and its epair (destroying the
/// host end destroys the end in the jail too) if `present`.
pub fn detach(cfg: &NetConfig, a: &Attachment, present: bool) -> Vec<Cmd> {
    let mut steps: Vec<Cmd> = pf::flush(cfg, &a.id).into();
    steps.push(pf::kill_states(a.address));
    if present {
        steps.push(Cmd::new(&[IFCONFIG, &a.host_if, "destroy"]));
    }
    steps
}

/// After a gateway restart: reloads the anchors of the `known` sandboxes;
/// flushes every other anchor found under this network's parent
/// (`anchors`, from [`pf::parse_anchors`]); destroys every host end of
/// this network in group [`GROUP`] (`members`) that no known sandbox owns,
/// after killing the states of the address it stood for, so a sandbox
/// given that address later inherits no flow.
pub fn reconcile(
    cfg: &NetConfig,
    known: &[(Attachment, ResolvedPolicy)],
    anchors: &[String],
    members: &[String],
    listeners: Option<Listeners>,
) -> Vec<Cmd> {
    let mut steps: Vec<Cmd> = known.iter().map(|(a, policy)| pf::load(cfg, a, policy, listeners)).collect();
    for id in anchors.iter().filter(|id| !known.iter().any(|(a, _)| &a.id == *id)) {
        steps.extend(pf::flush(cfg, id));
    }
    let stray = members.iter().filter(|name| cfg.owns_if(name) && !known.iter().any(|(a, _)| &a.host_if == *name));
    for name in stray {
        if let Some(address) = cfg.address_of_if(name) {
            steps.push(pf::kill_states(address));
        }
        steps.push(Cmd::new(&[IFCONFIG, name, "destroy"]));
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_listings_parse() {
        assert_eq!(parse_interfaces("em0 lo0 copse0 copse0-7\n"), ["em0", "lo0", "copse0", "copse0-7"]);
        assert!(parse_interfaces("\n").is_empty());
        assert_eq!(parse_group("copse0-7\ncopse0-1a\n\n"), ["copse0-7", "copse0-1a"]);
        assert!(parse_group("").is_empty());
    }

    #[test]
    fn created_names_parse() {
        assert_eq!(parse_created("bridge3\n").unwrap(), "bridge3");
        assert!(parse_created("").is_err());
        assert!(parse_created("bridge0 bridge1\n").is_err());
        assert!(parse_created("ifconfig: SIOCIFCREATE2: File exists").is_err());
        assert_eq!(parse_epair("epair12a\n").unwrap(), Epair { host: "epair12a".into(), jail: "epair12b".into() });
        assert!(parse_epair("epair12b\n").is_err());
        assert!(parse_epair("epaira\n").is_err());
        assert!(parse_epair("bridge0\n").is_err());
    }
}
