use std::io::Write;
use std::path::Path;
use std::sync::mpsc;

use copse_identity_line::GuestNet;

use super::*;
use crate::AgentConfig;
use crate::state::SharedState;

/// Records effects instead of touching the machine; fails the step named
/// in `fail`.
#[derive(Default)]
struct Recorder {
    log: Vec<String>,
    fail: Option<&'static str>,
}

impl Recorder {
    fn note(&mut self, step: &'static str, what: String) -> io::Result<()> {
        if self.fail == Some(step) {
            return Err(io::Error::other("refused"));
        }
        self.log.push(format!("{step} {what}"));
        Ok(())
    }
}

impl Effects for Recorder {
    fn reseed(&mut self, seed: &[u8]) -> io::Result<()> {
        self.note("reseed", copse_identity_line::hex(seed))
    }
    fn set_hostname(&mut self, name: &str) -> io::Result<()> {
        self.note("hostname", name.into())
    }
    fn write_file(&mut self, path: &Path, contents: &str) -> io::Result<()> {
        self.note("write", format!("{} {contents:?}", path.display()))
    }
    fn set_network(&mut self, net: &GuestNet) -> io::Result<()> {
        self.note("net", format!("{} {} {}", net.mac, net.address, net.gateway))
    }
}

fn state() -> SharedState {
    let config = AgentConfig { access_token: Some("checkpointed".into()), confine: false, ..AgentConfig::default() };
    AgentState::new(config).unwrap()
}

fn identity(hostname: &str, n: u8) -> Identity {
    Identity {
        hostname: hostname.into(),
        net: GuestNet {
            mac: format!("58:9c:fc:00:00:{n:02x}"),
            address: format!("10.78.0.{n}/16"),
            gateway: "10.78.0.1".into(),
        },
        machine_id: Some("0123456789abcdef0123456789abcdef".into()),
        rng_seed: vec![0xab; 4],
        agent_token: None,
    }
}

/// Feeds `input` through a pipe, as the console would deliver it.
fn through_pipe(input: Vec<u8>, effects: &mut Recorder, state: &AgentState) -> Vec<Result<String, String>> {
    let (reader, mut writer) = io::pipe().unwrap();
    let feeder = std::thread::spawn(move || writer.write_all(&input).unwrap());
    let mut outcomes = Vec::new();
    read_lines(reader, |line| outcomes.push(handle(line, effects, state).map_err(|e| format!("{e:#}")))).unwrap();
    feeder.join().unwrap();
    outcomes
}

#[test]
fn lines_from_the_console_are_applied_in_order() {
    let first = Identity { agent_token: Some("fresh".into()), ..identity("sb-1", 3) };
    let second = Identity { machine_id: None, ..identity("sb-2", 4) };
    let mut input = b"\r\nlogin: \r\n".to_vec();
    input.extend(first.control_line().replace('\n', "\r\n").bytes());
    input.extend(vec![b'x'; 20_000]);
    input.extend(b"\n\n");
    // The last line without its newline: end of input ends it.
    input.extend(second.control_line().trim_end().bytes());

    let (mut effects, state) = (Recorder::default(), state());
    let outcomes = through_pipe(input, &mut effects, &state);

    assert_eq!(outcomes.len(), 3, "blank and overlong lines are skipped: {outcomes:?}");
    assert!(outcomes[0].as_ref().is_err_and(|e| e.contains("not valid JSON")));
    assert_eq!(outcomes[1], Ok("sb-1".into()));
    assert_eq!(outcomes[2], Ok("sb-2".into()));
    assert_eq!(
        effects.log,
        [
            "reseed abababab",
            "hostname sb-1",
            r#"write /etc/machine-id "0123456789abcdef0123456789abcdef\n""#,
            r#"write /etc/hostid "01234567-89ab-cdef-0123-456789abcdef\n""#,
            "net 58:9c:fc:00:00:03 10.78.0.3/16 10.78.0.1",
            "reseed abababab",
            "hostname sb-2",
            "net 58:9c:fc:00:00:04 10.78.0.4/16 10.78.0.1",
        ]
    );
    assert_eq!(state.access_token().as_deref(), Some("fresh"), "what /init checks next");
}

#[test]
fn a_failed_step_leaves_token_and_network_alone() {
    let line = Identity { agent_token: Some("fresh".into()), ..identity("sb-1", 3) }.control_line();
    let (mut effects, state) = (Recorder { fail: Some("write"), ..Recorder::default() }, state());
    let outcomes = through_pipe(line.into_bytes(), &mut effects, &state);
    assert!(outcomes[0].as_ref().is_err_and(|e| e.contains("writing /etc/machine-id")), "{outcomes:?}");
    assert_eq!(effects.log, ["reseed abababab", "hostname sb-1"]);
    assert_eq!(state.access_token().as_deref(), Some("checkpointed"));
}

/// A pty stands in for the serial port: raw mode must pass the line through
/// whole and echo nothing back to the host's side.
#[test]
fn pty_console_is_raw_and_silent() {
    let pty = nix::pty::openpty(None, None).unwrap();
    make_raw(&pty.slave).unwrap();
    let (tx, rx) = mpsc::channel();
    let slave = File::from(pty.slave);
    let reader = std::thread::spawn(move || read_lines(slave, |line| tx.send(line.to_string()).unwrap()));

    let line = identity("sb-7", 7).control_line();
    let mut master = File::from(pty.master);
    master.write_all(line.as_bytes()).unwrap();
    let got = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(Identity::parse(&got).unwrap(), identity("sb-7", 7));

    nix::fcntl::fcntl(&master, nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK)).unwrap();
    let mut echo = [0u8; 64];
    let echoed = master.read(&mut echo);
    assert!(echoed.as_ref().is_err_and(|e| e.kind() == io::ErrorKind::WouldBlock), "echoed: {echoed:?}");

    drop(master);
    // Linux reports the hangup as EIO, others as end of input.
    let _ = reader.join().unwrap();
}

#[test]
fn open_leaves_a_non_terminal_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("console");
    std::fs::write(&path, identity("sb-8", 8).control_line()).unwrap();
    let mut lines = Vec::new();
    read_lines(open(&path).unwrap(), |l| lines.push(l.to_string())).unwrap();
    assert_eq!(lines.len(), 1);
}
