//! Confinement of the processes users run inside a sandbox.
//!
//! The agent keeps its privileges (it must switch users and manage
//! processes); everything it starts for a user is confined here, between
//! `fork` and `exec`. [`Confinement::new`] does all allocation up front so
//! that [`Confinement::apply`] only issues system calls and is safe to call
//! from a `pre_exec` hook.

use std::io;

#[cfg(target_os = "linux")]
pub use crate::linux::confine::Confinement;

#[cfg(target_os = "freebsd")]
pub use crate::freebsd::confine::Confinement;

/// Maps a raw libc return value to an `io::Result`.
pub(crate) fn check(ret: libc::c_int) -> io::Result<()> {
    if ret < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}
