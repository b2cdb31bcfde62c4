//! `copse-agent guest` serves over TCP: the same router as on the unix
//! socket, reached through the new listener path, and settings changed
//! outside HTTP (the console's identity) are what requests see.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::Duration;

use copse_agent::AgentConfig;

fn get(addr: SocketAddr, path: &str, token: Option<&str>) -> String {
    let mut conn = TcpStream::connect(addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let auth = token.map(|t| format!("X-Access-Token: {t}\r\n")).unwrap_or_default();
    write!(conn, "GET {path} HTTP/1.1\r\nHost: sandbox\r\n{auth}Connection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    conn.read_to_string(&mut response).unwrap();
    response
}

#[test]
fn health_and_a_token_set_from_outside_over_tcp() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let config = AgentConfig { confine: false, ..AgentConfig::default() };
        copse_agent::serve_blocking_with(listener, config, move |state| tx.send(state).unwrap())
    });
    let state = rx.recv_timeout(Duration::from_secs(10)).unwrap();

    assert!(get(addr, "/health", None).starts_with("HTTP/1.1 204"));
    assert!(get(addr, "/envs", None).starts_with("HTTP/1.1 200"), "no token yet, as in a template checkpoint");

    // What the console thread does with a line that carries a token.
    state.update_settings(|s| s.access_token = Some("fresh".into()));
    assert!(get(addr, "/envs", None).starts_with("HTTP/1.1 401"));
    assert!(get(addr, "/envs", Some("fresh")).starts_with("HTTP/1.1 200"));
    assert!(get(addr, "/health", None).starts_with("HTTP/1.1 204"), "the host's readiness probe needs no token");
}
