//! FreeBSD confinement of the processes users run inside a sandbox jail.
//!
//! Most of the work is done by the jail itself, for every process in it
//! including its root (see `plan::jail::sandbox_jail`): a separate root
//! directory and VNET network stack, no mounts, no raw sockets, no SysV
//! IPC, no chflags, no mlock, no visibility of other jails' processes or of
//! the host's mounts (`enforce_statfs=2`), no nested jails, securelevel 3,
//! a `/dev` with only null/zero/random/fd/pts, and rctl limits on memory,
//! CPU, processes, open files and write bandwidth. FreeBSD has no per-
//! process capability sets to drop: what a process may do is decided by
//! its uid inside the jail, which the agent sets before calling
//! [`Confinement::apply`].
//!
//! What this adds per process is `no_new_privs`: executing a setuid or
//! setgid file no longer changes credentials, so a process the agent
//! started as the sandbox user cannot climb back to the jail's root via
//! some setuid binary in the template.

use std::io;

use crate::syscall::check;

/// A prepared confinement; see the module docs of `copse_jailer::confine`.
pub struct Confinement {
    /// `procctl(2)` takes a pointer to its argument; keeping the value here
    /// means `apply` allocates nothing.
    no_new_privs: libc::c_int,
}

impl Confinement {
    pub fn new() -> io::Result<Self> {
        Ok(Self { no_new_privs: libc::PROC_NO_NEW_PRIVS_ENABLE })
    }

    /// Only system calls: safe between `fork` and `exec`. Needs FreeBSD
    /// 14.0 or later (PROC_NO_NEW_PRIVS_CTL); older kernels fail with
    /// EINVAL and the process is not started, rather than started weaker.
    pub fn apply(&self) -> io::Result<()> {
        let mut arg = self.no_new_privs;
        // SAFETY: procctl reads one int through the pointer, which is
        // valid for the duration of the call.
        check(unsafe {
            libc::procctl(
                libc::P_PID,
                libc::getpid() as libc::id_t,
                libc::PROC_NO_NEW_PRIVS_CTL,
                (&raw mut arg).cast::<libc::c_void>(),
            )
        })
    }
}
