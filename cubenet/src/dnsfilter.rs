//! What copse's resolver answers a sandbox (pure; the Linux executor is
//! `dns_proxy`).
//!
//! Every DNS query a sandbox sends, to whatever server it names, lands at
//! one resolver per network on the host (nftables redirects port 53), which
//! knows the sandbox by its source address. [`decide`] says what it gets:
//! - a name the policy refuses gets NXDOMAIN without leaving the host. A
//!   name is refused when a `deny_out` name entry covers it (and no
//!   `allow_out` one), or when no name entry matches it and the policy
//!   blocks the internet (`deny_out` 0.0.0.0/0 or `allow_internet_access:
//!   false`): such a sandbox resolves only the names it was allowed, so a
//!   query is no channel out of an air-gapped sandbox (DNS tunnelling).
//!   NXDOMAIN rather than REFUSED: stub resolvers stop at it at once,
//!   where REFUSED sends them through every other `nameserver` line (which
//!   land here too) before failing.
//! - the operator's static names (`--egress-hosts-file`) are answered from
//!   that table, so private and test names work without any resolver;
//! - other admitted names are forwarded: for a policy whose `allow_out`
//!   names hosts, to its `dns_servers` (E2B's "servers the sandbox can
//!   reach when allow_out contains a domain", 8.8.8.8 by default; `[]`
//!   means none, and then such names are REFUSED); otherwise to the host's
//!   own resolvers, which the sandbox's resolv.conf (copied from the host)
//!   names anyway.
//!
//! Answers are relayed as the upstream gave them: addresses in them open
//! nothing, since nftables and the egress proxy check every connection's
//! destination against the policy (a rebinding answer pointing at the host
//! or a protected range is refused there).

use std::net::Ipv4Addr;

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{RData, Record, RecordType};

use crate::policy::Policy;

/// The largest query accepted. A real query is a name (≤ 255 bytes) and an
/// EDNS record; anything near this is padding or an attack.
pub const MAX_QUERY: usize = 1232;

/// Packets per second one sandbox may send to the resolver (nftables
/// allows twice that as a burst): far above what a busy build resolves,
/// far below a flood. Enforced by the firewall, before the resolver's
/// socket queue (see the renderers).
pub const DNS_RATE: u32 = 200;

/// The largest answer relayed over UDP (EDNS's customary ceiling); the
/// upstream sizes its answer to what the client's query advertised.
pub const MAX_ANSWER: usize = 4096;

/// TTL of answers from the static table.
const STATIC_TTL: u32 = 30;

/// Where a query's answer comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Answer at once with these bytes (refused, static, malformed).
    Reply(Vec<u8>),
    /// Send the query to these servers, in turn, and relay the first answer.
    Forward(Upstreams),
    /// Not a DNS query: nothing to answer.
    Ignore,
}

/// Servers a query is forwarded to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Upstreams {
    /// The tenant's `dns_servers`: reached from a socket that nftables
    /// treats like sandbox traffic (no host, no protected range).
    Tenant(Vec<Ipv4Addr>),
    /// The host's own resolvers (the operator's).
    Host(Vec<Ipv4Addr>),
}

impl Upstreams {
    pub fn servers(&self) -> &[Ipv4Addr] {
        match self {
            Upstreams::Tenant(s) | Upstreams::Host(s) => s,
        }
    }
}

/// What the sandbox with `policy` gets for the query `packet`.
/// `static_hosts` are the operator's names, `host_resolvers` the host's.
pub fn decide(
    policy: &Policy,
    static_hosts: &[(String, Ipv4Addr)],
    host_resolvers: &[Ipv4Addr],
    packet: &[u8],
) -> Decision {
    if packet.len() > MAX_QUERY {
        return Decision::Ignore;
    }
    let Ok(query) = Message::from_vec(packet) else {
        // A header at least: answer FORMERR so the client does not retry.
        return match packet.get(..2) {
            Some(id) if packet.len() >= 12 => {
                Decision::Reply(error(u16::from_be_bytes([id[0], id[1]]), OpCode::Query, ResponseCode::FormErr, None))
            }
            _ => Decision::Ignore,
        };
    };
    if query.metadata.message_type != MessageType::Query {
        return Decision::Ignore;
    }
    let id = query.metadata.id;
    if query.metadata.op_code != OpCode::Query {
        return Decision::Reply(error(id, query.metadata.op_code, ResponseCode::NotImp, None));
    }
    let [question] = query.queries.as_slice() else {
        return Decision::Reply(error(id, OpCode::Query, ResponseCode::FormErr, None));
    };
    let name = normalise(&question.name().to_ascii());
    let reply = |code| Decision::Reply(error(id, OpCode::Query, code, Some((&query, question))));
    if !admitted(policy, &name) {
        return reply(ResponseCode::NXDomain);
    }
    let fixed: Vec<Ipv4Addr> = static_hosts.iter().filter(|(n, _)| *n == name).map(|(_, a)| *a).collect();
    if !fixed.is_empty() {
        return Decision::Reply(static_answer(&query, question, &fixed));
    }
    let upstreams = match policy.has_hosts() {
        true => Upstreams::Tenant(policy.dns_servers.clone()),
        false => Upstreams::Host(host_resolvers.to_vec()),
    };
    if upstreams.servers().is_empty() {
        return reply(ResponseCode::Refused);
    }
    Decision::Forward(upstreams)
}

/// Whether the policy lets the sandbox resolve `name` (see the module
/// header).
pub fn admitted(policy: &Policy, name: &str) -> bool {
    policy.name_verdict(name).unwrap_or_else(|| policy.internet_access())
}

/// Whether `answer` is the upstream's answer to `query` (same id and
/// question), so a stray or spoofed datagram is not relayed.
pub fn answers(query: &[u8], answer: &[u8]) -> bool {
    let (Ok(q), Ok(a)) = (Message::from_vec(query), Message::from_vec(answer)) else { return false };
    a.metadata.message_type == MessageType::Response && a.metadata.id == q.metadata.id && a.queries == q.queries
}

/// SERVFAIL for `packet` (when no upstream answered), if it is a query.
pub fn server_failure(packet: &[u8]) -> Option<Vec<u8>> {
    let query = Message::from_vec(packet).ok()?;
    let question = query.queries.first()?;
    Some(error(query.metadata.id, OpCode::Query, ResponseCode::ServFail, Some((&query, question))))
}

fn normalise(name: &str) -> String {
    name.trim_end_matches('.').to_ascii_lowercase()
}

fn response_to(query: &Message, question: &Query) -> Message {
    let mut m = Message::response(query.metadata.id, OpCode::Query);
    m.metadata.recursion_desired = query.metadata.recursion_desired;
    m.metadata.recursion_available = true;
    m.add_query(question.clone());
    m
}

fn error(id: u16, op_code: OpCode, code: ResponseCode, query: Option<(&Message, &Query)>) -> Vec<u8> {
    let mut m = match query {
        Some((query, question)) => response_to(query, question),
        None => Message::error_msg(id, op_code, code),
    };
    m.metadata.response_code = code;
    m.to_vec().unwrap_or_default()
}

/// The static addresses for an A query; no data (NOERROR, no answer) for
/// other types, since the name exists.
fn static_answer(query: &Message, question: &Query, addrs: &[Ipv4Addr]) -> Vec<u8> {
    let mut m = response_to(query, question);
    m.metadata.authoritative = true;
    if question.query_type() == RecordType::A {
        for addr in addrs {
            m.add_answer(Record::from_rdata(question.name().clone(), STATIC_TTL, RData::A(A(*addr))));
        }
    }
    m.to_vec().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::rr::Name;

    fn query(name: &str, rtype: RecordType) -> Vec<u8> {
        let mut m = Message::query();
        m.metadata.recursion_desired = true;
        m.add_query(Query::query(Name::from_ascii(name).unwrap(), rtype));
        m.to_vec().unwrap()
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn hosts() -> Vec<(String, Ipv4Addr)> {
        vec![
            ("allowed.test".into(), Ipv4Addr::new(203, 0, 113, 10)),
            ("denied.test".into(), Ipv4Addr::new(203, 0, 113, 20)),
        ]
    }

    const HOST_RESOLVER: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 53);

    fn reply(policy: &Policy, packet: &[u8]) -> Message {
        match decide(policy, &hosts(), &[HOST_RESOLVER], packet) {
            Decision::Reply(bytes) => Message::from_vec(&bytes).unwrap(),
            other => panic!("expected a reply, got {other:?}"),
        }
    }

    fn air_gapped(allow: &[&str]) -> Policy {
        Policy::from_e2b(Some(false), &strings(allow), &[], None).unwrap()
    }

    #[test]
    fn an_allow_list_answers_its_names_only() {
        let policy = air_gapped(&["allowed.test", "*.wild.test"]);
        let q = query("Allowed.Test.", RecordType::A);
        let answer = reply(&policy, &q);
        assert_eq!(answer.metadata.response_code, ResponseCode::NoError);
        assert_eq!(answer.metadata.id, Message::from_vec(&q).unwrap().metadata.id);
        assert_eq!(answer.answers.len(), 1);
        assert_eq!(answer.answers[0].data, RData::A(A(Ipv4Addr::new(203, 0, 113, 10))));
        let aaaa = reply(&policy, &query("allowed.test", RecordType::AAAA));
        assert!(aaaa.answers.is_empty() && aaaa.metadata.response_code == ResponseCode::NoError);

        for refused in ["denied.test", "wild.test", "exfil.data.attacker.example"] {
            let answer = reply(&policy, &query(refused, RecordType::A));
            assert_eq!(answer.metadata.response_code, ResponseCode::NXDomain, "{refused}");
            assert!(answer.answers.is_empty());
            assert_eq!(answer.queries.len(), 1);
        }
        // An allowed name not in the table goes to the tenant's servers.
        assert_eq!(
            decide(&policy, &hosts(), &[HOST_RESOLVER], &query("api.wild.test", RecordType::A)),
            Decision::Forward(Upstreams::Tenant(vec![crate::policy::DEFAULT_DNS]))
        );
    }

    #[test]
    fn without_an_allow_list_names_go_to_the_host_resolvers() {
        let open = Policy::open();
        assert_eq!(reply(&open, &query("denied.test", RecordType::A)).answers.len(), 1);
        assert_eq!(
            decide(&open, &hosts(), &[HOST_RESOLVER], &query("example.com", RecordType::A)),
            Decision::Forward(Upstreams::Host(vec![HOST_RESOLVER]))
        );
        // allow_out alone restricts nothing in E2B (nothing is denied), so
        // it filters no name either.
        let allow_only = Policy::from_e2b(None, &strings(&["allowed.test"]), &[], None).unwrap();
        assert!(matches!(
            decide(&allow_only, &hosts(), &[HOST_RESOLVER], &query("example.com", RecordType::A)),
            Decision::Forward(Upstreams::Tenant(_))
        ));
        // A deny_out name is refused by name, here too.
        let deny_name = Policy::from_e2b(None, &[], &strings(&["denied.test"]), None).unwrap();
        assert_eq!(
            reply(&deny_name, &query("denied.test", RecordType::A)).metadata.response_code,
            ResponseCode::NXDomain
        );
        // An air-gapped sandbox with no names resolves nothing.
        let closed = air_gapped(&["198.51.100.1"]);
        assert_eq!(
            reply(&closed, &query("allowed.test", RecordType::A)).metadata.response_code,
            ResponseCode::NXDomain
        );
    }

    #[test]
    fn no_dns_servers_means_static_names_only() {
        let policy =
            Policy::from_e2b(Some(false), &strings(&["allowed.test", "elsewhere.test"]), &[], Some(&[])).unwrap();
        assert_eq!(reply(&policy, &query("allowed.test", RecordType::A)).answers.len(), 1);
        assert_eq!(
            reply(&policy, &query("elsewhere.test", RecordType::A)).metadata.response_code,
            ResponseCode::Refused
        );
        let chosen =
            Policy::from_e2b(Some(false), &strings(&["elsewhere.test"]), &[], Some(&strings(&["198.51.100.53"])))
                .unwrap();
        assert_eq!(
            decide(&chosen, &[], &[], &query("elsewhere.test", RecordType::A)),
            Decision::Forward(Upstreams::Tenant(vec![Ipv4Addr::new(198, 51, 100, 53)]))
        );
    }

    #[test]
    fn malformed_and_oversized_packets() {
        let open = Policy::open();
        assert_eq!(decide(&open, &[], &[], &[0u8; MAX_QUERY + 1]), Decision::Ignore);
        assert_eq!(decide(&open, &[], &[], b"\x12"), Decision::Ignore);
        // A header that promises a question it lacks: FORMERR with its id.
        let garbage = [0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0, 0xff];
        let Decision::Reply(bytes) = decide(&open, &[], &[], &garbage) else { panic!() };
        let m = Message::from_vec(&bytes).unwrap();
        assert_eq!((m.metadata.id, m.metadata.response_code), (0x1234, ResponseCode::FormErr));
        // Two questions.
        let mut two = Message::query();
        two.add_query(Query::query(Name::from_ascii("a.test").unwrap(), RecordType::A));
        two.add_query(Query::query(Name::from_ascii("b.test").unwrap(), RecordType::A));
        assert_eq!(reply(&open, &two.to_vec().unwrap()).metadata.response_code, ResponseCode::FormErr);
        // A response sent to the resolver is not answered.
        let mut response = Message::from_vec(&query("a.test", RecordType::A)).unwrap();
        response.metadata.message_type = MessageType::Response;
        assert_eq!(decide(&open, &[], &[], &response.to_vec().unwrap()), Decision::Ignore);
    }

    #[test]
    fn only_the_matching_answer_is_relayed() {
        let q = query("allowed.test", RecordType::A);
        let parsed = Message::from_vec(&q).unwrap();
        let mut good = response_to(&parsed, &parsed.queries[0]);
        good.add_answer(Record::from_rdata(parsed.queries[0].name().clone(), 5, RData::A(A(Ipv4Addr::LOCALHOST))));
        assert!(answers(&q, &good.to_vec().unwrap()));
        let other = Message::from_vec(&query("allowed.test", RecordType::A)).unwrap();
        let mut wrong_id = response_to(&other, &other.queries[0]);
        wrong_id.metadata.id = parsed.metadata.id.wrapping_add(1);
        assert!(!answers(&q, &wrong_id.to_vec().unwrap()));
        let wrong_name = Message::from_vec(&query("denied.test", RecordType::A)).unwrap();
        let mut wrong_name = response_to(&wrong_name, &wrong_name.queries[0]);
        wrong_name.metadata.id = parsed.metadata.id;
        assert!(!answers(&q, &wrong_name.to_vec().unwrap()));
        assert!(!answers(&q, &q), "a query is no answer");
        let fail = Message::from_vec(&server_failure(&q).unwrap()).unwrap();
        assert_eq!((fail.metadata.id, fail.metadata.response_code), (parsed.metadata.id, ResponseCode::ServFail));
    }
}
