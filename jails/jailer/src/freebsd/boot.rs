//! `copse-agent boot` on FreeBSD: the first process of a new jail.
//!
//! Unlike on Linux there is nothing left to set up from inside: the host
//! already built the jail (root, /dev, limits, loopback) before starting
//! this process in it with `jail_attach`. What remains is to take the
//! listening socket from fd 3 and serve.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;

use crate::handoff::AGENT_SOCKET_FD;

/// Never returns: exits 0 when `serve` returns, 1 on error.
pub fn run(serve: impl FnOnce(UnixListener) -> anyhow::Result<()>) -> ! {
    let result = take_listener().map_err(anyhow::Error::from).and_then(serve);
    match result {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("copse boot: {e:#}");
            std::process::exit(1)
        }
    }
}

fn take_listener() -> io::Result<UnixListener> {
    // The substrate cleared FD_CLOEXEC so the socket survived our exec.
    // Set it again: every process the agent starts for a user must not
    // inherit the socket the gateway connects to, or user code could
    // accept the gateway's connections and impersonate the agent.
    // SAFETY: fcntl on an integer fd; fails with EBADF if nothing is there.
    crate::syscall::check(unsafe { libc::fcntl(AGENT_SOCKET_FD, libc::F_SETFD, libc::FD_CLOEXEC) })?;
    // SAFETY: fd 3 was placed by the substrate and nothing else owns it.
    Ok(UnixListener::from(unsafe { OwnedFd::from_raw_fd(AGENT_SOCKET_FD) }))
}
