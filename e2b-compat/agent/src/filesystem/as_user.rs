//! Filesystem work for a request runs with the requesting user's file
//! credentials (`copse_jailer::credentials`), off the reactor threads: a
//! symlink or rename planted by one sandbox user reaches only what the
//! requester could reach itself, and what the agent creates belongs to the
//! requester. Root requests keep root's power.

use std::io;

use copse_jailer::credentials::{FileCredentials, run_as};

use crate::users::User;

pub fn credentials(user: &User) -> FileCredentials {
    FileCredentials { uid: user.uid, gid: user.gid, groups: user.groups.clone() }
}

/// Runs `f` as `user` on a blocking thread; fails without running `f` if
/// the user's credentials could not be taken.
pub async fn run<T, F>(user: &User, f: F) -> io::Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let creds = credentials(user);
    tokio::task::spawn_blocking(move || run_as(&creds, f))
        .await
        .map_err(|e| io::Error::other(format!("file access worker failed: {e}")))?
}
