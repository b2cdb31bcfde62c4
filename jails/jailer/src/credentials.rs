//! File access on a user's behalf: the agent serves the files API for any
//! sandbox user, and what it opens, creates or lists for user X must be
//! decided by the kernel with X's credentials, not the agent's. A path a
//! sandbox user wrote (a symlink to `/root/secret`, a directory swapped
//! for a link between two calls) then reaches only what X could reach
//! itself, and whatever X creates belongs to X.
//!
//! [`run_as`] runs a closure with those credentials on a thread of its
//! own, so nothing else the agent does (its reactor, its other requests)
//! ever runs with them.

/// The identity file access is checked against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileCredentials {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (the primary group may be listed again).
    pub groups: Vec<u32>,
}

impl FileCredentials {
    /// Root keeps the agent's full power: its requests run unchanged.
    pub fn is_root(&self) -> bool {
        self.uid == 0
    }
}

#[cfg(target_os = "linux")]
pub use crate::linux::credentials::run_as;

#[cfg(target_os = "freebsd")]
pub use crate::freebsd::credentials::run_as;
