//! Raw system call results as `io::Result`s, for code that calls libc
//! directly (often between `fork` and `exec`, where nothing may allocate).

/// Maps a raw libc return value to an `io::Result`.
pub fn check(ret: libc::c_int) -> std::io::Result<()> {
    if ret < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
}
