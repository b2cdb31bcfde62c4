use super::*;

/// The exchange, byte for byte: what the host writes and the guest parses.
const GOLDEN: &str = concat!(
    r#"{"hostname":"sb-1","mac":"58:9c:fc:00:00:11","address":"10.78.0.3/16","gateway":"10.78.0.1","#,
    r#""machine_id":"0123456789abcdef0123456789abcdef","rng_seed":"00017f80ff","agent_token":"tok-1"}"#,
    "\n"
);

fn identity() -> Identity {
    Identity {
        hostname: "sb-1".into(),
        net: GuestNet { mac: "58:9c:fc:00:00:11".into(), address: "10.78.0.3/16".into(), gateway: "10.78.0.1".into() },
        machine_id: Some("0123456789abcdef0123456789abcdef".into()),
        rng_seed: vec![0, 1, 0x7f, 0x80, 0xff],
        agent_token: Some("tok-1".into()),
    }
}

#[test]
fn golden_line_both_ways() {
    assert_eq!(identity().control_line(), GOLDEN);
    assert_eq!(Identity::parse(GOLDEN).unwrap(), identity());
}

#[test]
fn optional_fields_are_left_out_and_parse_back_as_none() {
    let id = Identity { machine_id: None, agent_token: None, ..identity() };
    let line = id.control_line();
    assert!(!line.contains("machine_id") && !line.contains("agent_token"));
    assert_eq!(Identity::parse(&line).unwrap(), id);
}

#[test]
fn steps_in_order_network_last() {
    let net = identity().net;
    assert_eq!(
        identity().steps(),
        [
            GuestStep::ReseedRng(vec![0, 1, 0x7f, 0x80, 0xff]),
            GuestStep::SetHostname("sb-1".into()),
            GuestStep::WriteFile { path: "/etc/machine-id", contents: "0123456789abcdef0123456789abcdef\n".into() },
            GuestStep::WriteFile { path: "/etc/hostid", contents: "01234567-89ab-cdef-0123-456789abcdef\n".into() },
            GuestStep::RotateAgentToken("tok-1".into()),
            GuestStep::SetNetwork(net.clone()),
        ]
    );
    let bare = Identity { machine_id: None, agent_token: None, ..identity() };
    assert_eq!(bare.steps().len(), 3);
    assert_eq!(bare.steps().last(), Some(&GuestStep::SetNetwork(net)));
}

#[test]
fn refusals() {
    let with = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut v: serde_json::Value = serde_json::from_str(GOLDEN).unwrap();
        f(&mut v);
        Identity::parse(&v.to_string())
    };
    assert!(Identity::parse("login: ").is_err());
    assert!(Identity::parse("").is_err());
    assert!(with(&|v| v["hostname"] = "a b".into()).is_err());
    assert!(with(&|v| v["hostname"] = "x".repeat(64).into()).is_err());
    assert!(with(&|v| v["hostname"] = "-x".into()).is_err());
    assert!(with(&|v| v["mac"] = "58:9c:fc:00:00".into()).is_err());
    assert!(with(&|v| v["address"] = "10.78.0.3".into()).is_err());
    assert!(with(&|v| v["address"] = "10.78.0.3/33".into()).is_err());
    assert!(with(&|v| v["gateway"] = "gw".into()).is_err());
    assert!(with(&|v| v["machine_id"] = "0123".into()).is_err());
    assert!(with(&|v| v["machine_id"] = "0123456789ABCDEF0123456789ABCDEF".into()).is_err());
    assert!(with(&|v| v["rng_seed"] = "".into()).is_err());
    assert!(with(&|v| v["rng_seed"] = "abc".into()).is_err());
    assert!(with(&|v| v["rng_seed"] = "+f".into()).is_err());
    assert!(with(&|v| v["agent_token"] = "".into()).is_err());
    assert!(with(&|v| v["agent_token"] = "a b".into()).is_err());
    assert!(with(&|v| v["hostname"] = "ok-2".into()).is_ok());
}
