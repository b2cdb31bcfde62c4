//! The jail system calls, wrapped. Nothing here decides anything: the
//! parameters come from `plan::jail`.
//!
//! `jail_set(2)`/`jail_get(2)` take name/value pairs as an iovec array
//! (even count). Strings include their NUL, integers are a C `int`, and a
//! boolean is a name with an empty value. An `errmsg` pair with a buffer
//! makes the kernel explain EINVAL-style failures in words.

use std::io;

use crate::plan::jail::{JailParams, WireValue};

const ERRMSG_LEN: usize = 256;
/// `MAXHOSTNAMELEN`: the size of a jail name buffer.
const NAME_LEN: usize = libc::MAXHOSTNAMELEN as usize;

/// Owned buffers plus the iovecs pointing into them.
struct Pairs {
    buffers: Vec<Vec<u8>>,
}

impl Pairs {
    fn new() -> Self {
        Self { buffers: Vec::new() }
    }

    fn push(&mut self, name: &str, value: Vec<u8>) -> usize {
        let mut n = name.as_bytes().to_vec();
        n.push(0);
        self.buffers.push(n);
        self.buffers.push(value);
        self.buffers.len() - 1
    }

    fn str(&mut self, name: &str, value: &str) -> usize {
        let mut v = value.as_bytes().to_vec();
        v.push(0);
        self.push(name, v)
    }

    fn int(&mut self, name: &str, value: i32) -> usize {
        self.push(name, value.to_ne_bytes().to_vec())
    }

    fn errmsg(&mut self) -> usize {
        self.push("errmsg", vec![0; ERRMSG_LEN])
    }

    /// The iovec array; valid while `self` is neither moved nor changed.
    fn iovecs(&mut self) -> Vec<libc::iovec> {
        self.buffers
            .iter_mut()
            .map(|b| {
                if b.is_empty() {
                    libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }
                } else {
                    libc::iovec { iov_base: b.as_mut_ptr().cast(), iov_len: b.len() }
                }
            })
            .collect()
    }

    fn text(&self, index: usize) -> String {
        let b = &self.buffers[index];
        let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
        String::from_utf8_lossy(&b[..end]).into_owned()
    }

    fn int_at(&self, index: usize) -> i32 {
        let b = &self.buffers[index];
        i32::from_ne_bytes([b[0], b[1], b[2], b[3]])
    }

    /// Turns a -1 return into an error carrying the kernel's message.
    fn result(&self, ret: libc::c_int, errmsg: usize, what: &str) -> io::Result<i32> {
        if ret >= 0 {
            return Ok(ret);
        }
        let err = io::Error::last_os_error();
        let msg = self.text(errmsg);
        if msg.is_empty() {
            Err(io::Error::new(err.kind(), format!("{what}: {err}")))
        } else {
            Err(io::Error::new(err.kind(), format!("{what}: {err}: {msg}")))
        }
    }
}

/// Creates the jail described by `params`; returns its jid.
pub fn create(params: &JailParams) -> io::Result<i32> {
    let mut pairs = Pairs::new();
    for (name, value) in params.wire() {
        match value {
            Some(WireValue::Str(s)) => pairs.str(&name, &s),
            Some(WireValue::Int(i)) => pairs.int(&name, i),
            None => pairs.push(&name, Vec::new()),
        };
    }
    let errmsg = pairs.errmsg();
    let mut iov = pairs.iovecs();
    // SAFETY: every iovec points into `pairs`, alive and unchanged for the
    // call; the kernel writes at most ERRMSG_LEN bytes into errmsg.
    let ret = unsafe { libc::jail_set(iov.as_mut_ptr(), iov.len() as libc::c_uint, libc::JAIL_CREATE) };
    pairs.result(ret, errmsg, "jail_set")
}

/// The jid of the live (not dying) jail called `name`.
pub fn find(name: &str) -> io::Result<Option<i32>> {
    let mut pairs = Pairs::new();
    pairs.str("name", name);
    pairs.int("jid", 0);
    let errmsg = pairs.errmsg();
    let mut iov = pairs.iovecs();
    // SAFETY: as in `create`; jail_get writes only into our buffers.
    let ret = unsafe { libc::jail_get(iov.as_mut_ptr(), iov.len() as libc::c_uint, 0) };
    match pairs.result(ret, errmsg, "jail_get") {
        Ok(jid) => Ok(Some(jid)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) || e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Every live jail visible to us, as (jid, name).
pub fn list() -> io::Result<Vec<(i32, String)>> {
    let mut out = Vec::new();
    let mut last = 0;
    loop {
        let mut pairs = Pairs::new();
        pairs.int("lastjid", last);
        let jid_at = pairs.int("jid", 0);
        let name_at = pairs.push("name", vec![0; NAME_LEN]);
        let errmsg = pairs.errmsg();
        let mut iov = pairs.iovecs();
        // SAFETY: as in `create`.
        let ret = unsafe { libc::jail_get(iov.as_mut_ptr(), iov.len() as libc::c_uint, 0) };
        match pairs.result(ret, errmsg, "jail_get") {
            Ok(jid) => {
                debug_assert_eq!(jid, pairs.int_at(jid_at));
                out.push((jid, pairs.text(name_at)));
                last = jid;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(e),
        }
    }
}

/// `jail_remove(2)`: the kernel sends SIGKILL to every process in the
/// jail and drops its persist reference; the jail then dies once its last
/// process is gone (it may linger as "dying", see `jls -d`).
pub fn remove(jid: i32) -> io::Result<()> {
    // SAFETY: integer argument only.
    copse_jailer::check(unsafe { libc::jail_remove(jid) })
}
