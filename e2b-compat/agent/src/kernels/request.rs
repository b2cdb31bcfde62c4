//! One kernel request as it arrives: a JSON line whose first bytes carry
//! the child's standard streams as `SCM_RIGHTS` descriptors.

use std::collections::HashMap;
use std::io::{self, IoSliceMut};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;

use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
use serde::Deserialize;
use tokio::io::Interest;
use tokio::net::UnixStream;

/// The largest request line: argv, cwd and the interpreter's few variables.
pub const MAX_REQUEST: usize = 256 * 1024;
/// stdin, stdout and stderr, in that order.
pub const STDIO_FDS: usize = 3;

/// What the interpreter asks for; the user, the base environment and the
/// confinement are the agent's to choose.
#[derive(Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct KernelRequest {
    pub argv: Vec<String>,
    pub cwd: PathBuf,
    #[serde(default)]
    pub env: HashMap<String, String>,
}

impl KernelRequest {
    pub fn parse(line: &[u8]) -> Result<Self, String> {
        let request: Self = serde_json::from_slice(line).map_err(|e| format!("invalid kernel request: {e}"))?;
        if request.argv.first().is_none_or(|a| a.is_empty()) {
            return Err("argv must name a program".into());
        }
        if !request.cwd.is_absolute() {
            return Err("cwd must be an absolute path".into());
        }
        let nul = |s: &String| s.contains('\0');
        if request.argv.iter().any(nul) || request.cwd.to_string_lossy().contains('\0') {
            return Err("argv and cwd must not contain NUL".into());
        }
        if let Some(k) =
            request.env.iter().find(|(k, v)| k.is_empty() || k.contains('=') || nul(k) || nul(v)).map(|e| e.0)
        {
            return Err(format!("invalid environment variable name {k:?}"));
        }
        Ok(request)
    }
}

/// Reads up to the first newline, collecting every descriptor that came
/// with it. Returns the line (without its newline) and the descriptors;
/// bytes after the newline are left unread by construction: the interpreter
/// sends nothing more until the agent has answered.
pub async fn receive(stream: &UnixStream) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut line = Vec::new();
    let mut fds = Vec::new();
    loop {
        let mut chunk = [0u8; 16 * 1024];
        let (n, received) = stream.async_io(Interest::READABLE, || receive_once(stream, &mut chunk)).await?;
        fds.extend(received);
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the request ended before its newline"));
        }
        let chunk = &chunk[..n];
        if let Some(end) = chunk.iter().position(|&b| b == b'\n') {
            line.extend_from_slice(&chunk[..end]);
            if end + 1 != n {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "bytes after the request line"));
            }
            return Ok((line, fds));
        }
        line.extend_from_slice(chunk);
        if line.len() > MAX_REQUEST {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "kernel request too large"));
        }
    }
}

fn receive_once(stream: &UnixStream, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    use std::os::fd::AsRawFd;
    let mut space = nix::cmsg_space!([RawFd; STDIO_FDS + 1]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
        .map_err(io::Error::from)?;
    let mut fds = Vec::new();
    for cmsg in msg.cmsgs().map_err(io::Error::from)? {
        if let ControlMessageOwned::ScmRights(received) = cmsg {
            // SAFETY: the kernel just installed these descriptors in our
            // table for us; nothing else owns them.
            fds.extend(received.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
        }
    }
    // More descriptors than the buffer holds are closed by the kernel and
    // flagged; such a request is refused by its count below anyway.
    if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "too many descriptors"));
    }
    Ok((msg.bytes, fds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_request() {
        let r = KernelRequest::parse(br#"{"argv":["/bin/bash","-i"],"cwd":"/home/user","env":{"A":"1"}}"#).unwrap();
        assert_eq!(r.argv, ["/bin/bash", "-i"]);
        assert_eq!(r.cwd, PathBuf::from("/home/user"));
        assert_eq!(r.env["A"], "1");
    }

    #[test]
    fn refuses_what_it_cannot_start() {
        for bad in [
            r#"{"argv":[],"cwd":"/"}"#,
            r#"{"argv":[""],"cwd":"/"}"#,
            r#"{"argv":["x"],"cwd":"relative"}"#,
            r#"{"argv":["x"],"cwd":"/","env":{"A=B":"1"}}"#,
            r#"{"argv":["x"],"cwd":"/","env":{"":"1"}}"#,
            r#"{"argv":["x\u0000y"],"cwd":"/"}"#,
            r#"{"argv":["x"],"cwd":"/","user":"root"}"#,
            "not json",
        ] {
            assert!(KernelRequest::parse(bad.as_bytes()).is_err(), "{bad}");
        }
    }
}
