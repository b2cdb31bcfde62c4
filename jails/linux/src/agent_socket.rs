//! Reaching a sandbox's agent socket without letting the sandbox choose
//! what the host connects to.
//!
//! The socket lives in `sandboxes/<id>/run/`, which the sandbox sees
//! read-write at `/.copse/run`, so its root can put anything there under
//! the socket's name — a symlink to a host socket included. `connect(2)`
//! follows symlinks, and the gateway runs as host root: a plain connect to
//! that path would hand the sandbox any socket on the host. So the name is
//! opened without following a final symlink (`O_PATH | O_NOFOLLOW`), must
//! be a socket, and the connect goes through `/proc/self/fd/<fd>`, which
//! names exactly that inode. A socket the sandbox binds there itself is
//! still the sandbox's own: it could answer as its agent anyway.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::fcntl::{OFlag, open, openat};
use nix::sys::stat::{Mode, SFlag, fstat};

/// The agent socket a gateway link names, pinned: [`AgentSocket::path`]
/// reaches that inode and no other while this value lives.
#[derive(Debug)]
pub struct AgentSocket {
    fd: OwnedFd,
}

impl AgentSocket {
    /// Pins the socket behind `link`: the gateway's own symlink (in a
    /// directory only the host writes) to the socket in the sandbox's run
    /// directory, or that socket's path itself.
    pub fn open(link: &Path) -> io::Result<Self> {
        let target = resolve_own_link(link)?;
        let (Some(dir), Some(name)) = (target.parent(), target.file_name()) else {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{} names no socket", target.display())));
        };
        // Every directory above the name is the host's; only the last
        // component is the sandbox's to change.
        let dir = open(dir, OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())?;
        let fd = openat(&dir, name, OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC, Mode::empty())?;
        let kind = SFlag::from_bits_truncate(fstat(&fd)?.st_mode) & SFlag::S_IFMT;
        if kind != SFlag::S_IFSOCK {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{} is not a socket; refusing to follow it", target.display()),
            ));
        }
        Ok(Self { fd })
    }

    /// A path that reaches the pinned socket (for `connect`).
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.fd.as_raw_fd()))
    }
}

/// Follows `link` once if it is a symlink (the gateway's own, made by
/// `link_socket`), never further.
fn resolve_own_link(link: &Path) -> io::Result<PathBuf> {
    match std::fs::read_link(link) {
        Ok(target) if target.is_absolute() => Ok(target),
        Ok(target) => Ok(link.parent().unwrap_or(Path::new("/")).join(target)),
        Err(e) if e.kind() == io::ErrorKind::InvalidInput => Ok(link.to_path_buf()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::{UnixListener, UnixStream};

    use super::*;

    /// The gateway's layout: `run/<id>.sock` → `sandboxes/<id>/run/agent.sock`.
    fn layout(dir: &Path) -> (PathBuf, PathBuf) {
        let run = dir.join("sandbox-run");
        std::fs::create_dir(&run).unwrap();
        let socket = run.join("agent.sock");
        let link = dir.join("id.sock");
        std::os::unix::fs::symlink(&socket, &link).unwrap();
        (socket, link)
    }

    #[test]
    fn reaches_the_agent_through_the_gateway_link() {
        let dir = tempfile::tempdir().unwrap();
        let (socket, link) = layout(dir.path());
        let listener = UnixListener::bind(&socket).unwrap();
        let pinned = AgentSocket::open(&link).unwrap();
        UnixStream::connect(pinned.path()).unwrap();
        listener.accept().unwrap();
    }

    #[test]
    fn a_symlink_planted_in_the_sandbox_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let (socket, link) = layout(dir.path());
        let host_socket = dir.path().join("host.sock");
        let _host = UnixListener::bind(&host_socket).unwrap();
        std::os::unix::fs::symlink(&host_socket, &socket).unwrap();
        let err = AgentSocket::open(&link).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{err}");
    }

    #[test]
    fn a_fifo_or_file_in_its_place_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (socket, link) = layout(dir.path());
        nix::unistd::mkfifo(&socket, Mode::from_bits_truncate(0o600)).unwrap();
        assert_eq!(AgentSocket::open(&link).unwrap_err().kind(), io::ErrorKind::PermissionDenied);
        std::fs::remove_file(&socket).unwrap();
        std::fs::write(&socket, "x").unwrap();
        assert_eq!(AgentSocket::open(&link).unwrap_err().kind(), io::ErrorKind::PermissionDenied);
    }

    #[test]
    fn a_missing_socket_is_not_found() {
        let dir = tempfile::tempdir().unwrap();
        let (_, link) = layout(dir.path());
        assert_eq!(AgentSocket::open(&link).unwrap_err().kind(), io::ErrorKind::NotFound);
    }
}
