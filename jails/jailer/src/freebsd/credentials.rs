//! FreeBSD: credentials belong to the whole process (there is no fsuid and
//! no per-thread `setuid`), so a thread of the agent cannot take a user's
//! identity without giving it to every request being served. Until the
//! files API moves into a short-lived helper process per request (or
//! `O_RESOLVE_BENEATH` plus an ownership check), requests run with the
//! agent's credentials, as they did before: this does not yet mirror the
//! Linux guarantee. Not run on FreeBSD.

use std::io;

use crate::credentials::FileCredentials;

pub fn run_as<T: Send>(_creds: &FileCredentials, f: impl FnOnce() -> T + Send) -> io::Result<T> {
    Ok(f())
}
