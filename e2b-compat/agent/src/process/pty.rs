//! The master side of a pseudo-terminal, driven by tokio's reactor.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

pub struct PtyMaster {
    fd: AsyncFd<OwnedFd>,
}

/// A new terminal pair sized `cols`×`rows`: (master, slave).
pub fn open(cols: u16, rows: u16) -> io::Result<(PtyMaster, OwnedFd)> {
    let size = nix::pty::Winsize { ws_row: rows, ws_col: cols, ws_xpixel: 0, ws_ypixel: 0 };
    let pair = nix::pty::openpty(Some(&size), None).map_err(io::Error::from)?;
    // openpty's descriptors are inheritable; the master must not leak into
    // the child (or it would never see EOF), the slave is dup'ed onto 0/1/2.
    set_flags(&pair.master, true)?;
    set_cloexec(&pair.slave)?;
    // SAFETY: the OwnedFd is moved in, so the descriptor stays open and
    // unchanged for the AsyncFd's whole life.
    let fd = unsafe { AsyncFd::register_with_interest(pair.master, Interest::READABLE | Interest::WRITABLE)? };
    Ok((PtyMaster { fd }, pair.slave))
}

fn set_cloexec(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own.
    let rc = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

fn set_flags(fd: &OwnedFd, nonblocking: bool) -> io::Result<()> {
    set_cloexec(fd)?;
    // SAFETY: fcntl on a descriptor we own.
    unsafe {
        let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        if flags < 0 {
            return Err(io::Error::last_os_error());
        }
        let flags = if nonblocking { flags | libc::O_NONBLOCK } else { flags & !libc::O_NONBLOCK };
        if libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

impl PtyMaster {
    /// Reads output; `Ok(0)` once every slave descriptor is closed (Linux
    /// reports that as EIO).
    pub async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let mut guard = self.fd.readable().await?;
            let res = guard.try_io(|inner| {
                // SAFETY: buf is valid for buf.len() bytes.
                let n = unsafe { libc::read(inner.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
                if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
            });
            match res {
                Ok(Ok(n)) => return Ok(n),
                Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => return Ok(0),
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }

    pub async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let mut guard = self.fd.writable().await?;
            let res = guard.try_io(|inner| {
                // SAFETY: data is valid for data.len() bytes.
                let n = unsafe { libc::write(inner.as_raw_fd(), data.as_ptr().cast(), data.len()) };
                if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
            });
            match res {
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => {}
            }
        }
        Ok(())
    }

    /// TIOCSWINSZ; the kernel sends SIGWINCH to the foreground group.
    pub fn resize(&self, cols: u16, rows: u16) -> io::Result<()> {
        let size = libc::winsize { ws_row: rows, ws_col: cols, ws_xpixel: 0, ws_ypixel: 0 };
        // SAFETY: TIOCSWINSZ reads a winsize from the pointer.
        let rc = unsafe { libc::ioctl(self.fd.as_raw_fd(), libc::TIOCSWINSZ as _, &size) };
        if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
    }
}
