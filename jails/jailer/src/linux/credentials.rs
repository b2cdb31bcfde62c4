//! Linux: a fresh thread takes the user's filesystem uid/gid and groups.
//!
//! `setfsuid`, `setfsgid` and the raw `setgroups` system call change only
//! the calling thread (libc's `setgroups` would broadcast to every thread
//! of the agent, so it is not used), and moving the fsuid away from 0
//! clears the thread's file capabilities (DAC override, DAC read-search,
//! fowner, chown, fsetid, mknod): permission checks become exactly the
//! user's. The thread ends with the call, so the credentials never leak
//! into a pooled thread. Threads the closure starts inherit them (the
//! inotify thread of a directory watch does, so its recursive walks are the
//! user's too).

use std::io;

use crate::credentials::FileCredentials;

/// Runs `f` with `creds` for every path operation it makes; root runs `f`
/// on the calling thread. Fails closed: if the kernel did not take the
/// credentials (no CAP_SETUID/CAP_SETGID), `f` does not run.
pub fn run_as<T: Send>(creds: &FileCredentials, f: impl FnOnce() -> T + Send) -> io::Result<T> {
    if creds.is_root() {
        return Ok(f());
    }
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .name("copse-fs-as-user".into())
            .spawn_scoped(s, || {
                assume(creds)?;
                Ok(f())
            })?
            .join()
            .map_err(|_| panicked())?
    })
}

/// A closure that panicked on the credentials thread.
fn panicked() -> io::Error {
    io::Error::other("file access thread panicked")
}

/// Gives the calling thread `creds` for file access. Groups first: after
/// the fsuid leaves 0, CAP_SETGID is still there but nothing else is needed.
fn assume(creds: &FileCredentials) -> io::Result<()> {
    let groups: Vec<libc::gid_t> = creds.groups.clone();
    // SAFETY: raw setgroups reads groups.len() gids from a valid buffer.
    let rc = unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // setfsuid/setfsgid report the previous id and never fail: read the id
    // back with an invalid value (-1 changes nothing) to know it was taken.
    // SAFETY: integer arguments only.
    unsafe {
        libc::syscall(libc::SYS_setfsgid, creds.gid);
        libc::syscall(libc::SYS_setfsuid, creds.uid);
    }
    // SAFETY: integer arguments only.
    let (gid, uid) = unsafe { (libc::syscall(libc::SYS_setfsgid, -1), libc::syscall(libc::SYS_setfsuid, -1)) };
    if gid as u32 != creds.gid || uid as u32 != creds.uid {
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, "could not take the user's file credentials"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fs_ids() -> (u32, u32) {
        // SAFETY: integer arguments only; -1 reads without changing.
        unsafe { (libc::syscall(libc::SYS_setfsuid, -1) as u32, libc::syscall(libc::SYS_setfsgid, -1) as u32) }
    }

    #[test]
    fn root_runs_on_the_calling_thread() {
        let me = std::thread::current().id();
        let creds = FileCredentials { uid: 0, gid: 0, groups: vec![0] };
        assert_eq!(run_as(&creds, || std::thread::current().id()).unwrap(), me);
    }

    #[test]
    fn a_user_gets_its_ids_on_another_thread_only() {
        let before = fs_ids();
        let creds = FileCredentials { uid: 4242, gid: 4343, groups: vec![4343] };
        let inside = run_as(&creds, fs_ids);
        if before.0 == 0 && nix::unistd::geteuid().is_root() {
            assert_eq!(inside.unwrap(), (4242, 4343));
        } else {
            // Without CAP_SETUID the closure must not run at all.
            assert_eq!(inside.unwrap_err().kind(), io::ErrorKind::PermissionDenied);
        }
        assert_eq!(fs_ids(), before);
    }

    #[test]
    fn a_user_cannot_read_what_only_root_may() {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        std::fs::set_permissions(tmp.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let secret = tmp.path().join("secret");
        std::fs::write(&secret, b"s").unwrap();
        std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        let creds = FileCredentials { uid: 4242, gid: 4242, groups: vec![] };
        let read = run_as(&creds, || std::fs::read(&secret)).unwrap();
        assert_eq!(read.unwrap_err().kind(), io::ErrorKind::PermissionDenied);
        assert_eq!(std::fs::read(&secret).unwrap(), b"s");
    }
}
