//! The agent socket of a bhyve sandbox: a host unix socket (what the
//! gateway dials for every sandbox, `SandboxSpec::agent_socket`) relayed to
//! the guest agent's TCP port on the guest's private address.
//!
//! Why TCP over the guest NIC and not a virtio-console socket: the gateway
//! opens many concurrent connections to an agent, a console port is one
//! byte stream, and bhyve cannot checkpoint a virtio-console device.

use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Port the guest agent listens on (E2B's envd port).
pub const AGENT_PORT: u16 = 49983;

/// Runs until dropped; dropping removes the socket.
pub struct Relay {
    path: PathBuf,
    stop: Arc<AtomicBool>,
}

impl Relay {
    pub fn start(path: &Path, target: SocketAddr) -> io::Result<Self> {
        let _ = std::fs::remove_file(path);
        let listener = UnixListener::bind(path)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if stopping.load(Ordering::Acquire) {
                    break;
                }
                if let Ok(conn) = conn {
                    std::thread::spawn(move || splice(conn, target));
                }
            }
        });
        Ok(Self { path: path.to_path_buf(), stop })
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wakes the accept loop so it sees the flag.
        let _ = UnixStream::connect(&self.path);
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Polls `GET /health` until the agent answers 2xx.
pub fn wait_health(addr: SocketAddr, timeout: Duration) -> anyhow::Result<()> {
    use std::io::{Read, Write};
    let start = std::time::Instant::now();
    loop {
        let answered = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).and_then(|mut s| {
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            s.write_all(format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())?;
            let mut head = [0u8; 12];
            s.read_exact(&mut head)?;
            Ok(head.starts_with(b"HTTP/1.1 2") || head.starts_with(b"HTTP/1.0 2"))
        });
        if answered.unwrap_or(false) {
            return Ok(());
        }
        if start.elapsed() > timeout {
            anyhow::bail!("agent at {addr} did not answer /health within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn splice(unix: UnixStream, target: SocketAddr) {
    let Ok(tcp) = TcpStream::connect_timeout(&target, Duration::from_secs(5)) else { return };
    let _ = tcp.set_nodelay(true);
    let (Ok(mut unix_r), Ok(mut tcp_w)) = (unix.try_clone(), tcp.try_clone()) else { return };
    let up = std::thread::spawn(move || {
        let _ = io::copy(&mut unix_r, &mut tcp_w);
        let _ = tcp_w.shutdown(Shutdown::Write);
    });
    let (mut tcp_r, mut unix_w) = (tcp, unix);
    let _ = io::copy(&mut tcp_r, &mut unix_w);
    let _ = unix_w.shutdown(Shutdown::Write);
    let _ = up.join();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    #[test]
    fn bytes_go_both_ways_and_drop_removes_the_socket() {
        let echo = TcpListener::bind("127.0.0.1:0").unwrap();
        let target = echo.local_addr().unwrap();
        std::thread::spawn(move || {
            for conn in echo.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut w = conn.try_clone().unwrap();
                    let mut r = conn;
                    let _ = io::copy(&mut r, &mut w);
                });
            }
        });
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("agent.sock");
        let relay = Relay::start(&sock, target).unwrap();
        for _ in 0..2 {
            let mut c = UnixStream::connect(&sock).unwrap();
            c.write_all(b"GET /health").unwrap();
            c.shutdown(Shutdown::Write).unwrap();
            let mut back = String::new();
            c.read_to_string(&mut back).unwrap();
            assert_eq!(back, "GET /health");
        }
        drop(relay);
        assert!(!sock.exists());
    }

    #[test]
    fn health_waits_for_a_2xx() {
        let agent = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = agent.local_addr().unwrap();
        std::thread::spawn(move || {
            for (i, conn) in agent.incoming().flatten().enumerate() {
                let mut conn = conn;
                let mut buf = [0u8; 256];
                let _ = conn.read(&mut buf);
                let status = if i == 0 { "503 Service Unavailable" } else { "204 No Content" };
                let _ = conn.write_all(format!("HTTP/1.1 {status}\r\n\r\n").as_bytes());
            }
        });
        wait_health(addr, Duration::from_secs(5)).unwrap();
        let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        assert!(wait_health(closed, Duration::from_millis(200)).is_err());
    }
}
