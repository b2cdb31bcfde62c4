//! Opening files whose contents the agent streams (`/files`): only regular
//! files. A FIFO would block the agent in `open` or `read` for as long as
//! the sandbox likes, and a device node may do anything when opened, so
//! the type is checked before opening (stat) and again on what was opened
//! (fstat), with `O_NONBLOCK` in between so a FIFO swapped in by a race
//! cannot block either. Symlinks are followed: the caller runs this with
//! the requesting user's credentials (`as_user`), so a link reaches only
//! what that user may open.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// The error for a FIFO, socket or device: refused, never opened.
pub fn not_regular(path: &Path, meta: &std::fs::Metadata) -> io::Error {
    let ft = meta.file_type();
    let kind = if ft.is_fifo() {
        "a named pipe"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_block_device() || ft.is_char_device() {
        "a device"
    } else {
        "not a regular file"
    };
    io::Error::new(io::ErrorKind::InvalidInput, format!("path '{}' is {kind}, not a regular file", path.display()))
}

fn is_a_directory(path: &Path) -> io::Error {
    io::Error::new(io::ErrorKind::IsADirectory, format!("path '{}' is a directory", path.display()))
}

/// Refuses anything but an existing regular file (directories with
/// `IsADirectory`); `Ok(None)` when nothing is there.
fn check_type(path: &Path) -> io::Result<Option<std::fs::Metadata>> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(Some(m)),
        Ok(m) if m.is_dir() => Err(is_a_directory(path)),
        Ok(m) => Err(not_regular(path, &m)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// The second look, at what was actually opened, then back to blocking
/// I/O for the transfer.
fn confirm_regular(path: &Path, file: File) -> io::Result<File> {
    let meta = file.metadata()?;
    if meta.is_dir() {
        return Err(is_a_directory(path));
    }
    if !meta.is_file() {
        return Err(not_regular(path, &meta));
    }
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor this function owns, integer arguments.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}

/// Opens an existing regular file for reading.
pub fn regular_for_reading(path: &Path) -> io::Result<File> {
    if check_type(path)?.is_none() {
        return Err(io::Error::new(io::ErrorKind::NotFound, format!("path '{}' does not exist", path.display())));
    }
    let file = File::options().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY).open(path)?;
    confirm_regular(path, file)
}

/// Opens `path` for writing from the start: created (0666 less the umask)
/// if missing, truncated if it is a regular file, refused otherwise. The
/// truncation happens only after the type check, so a FIFO or device that
/// appears by a race is never truncated or written.
pub fn regular_for_writing(path: &Path) -> io::Result<File> {
    check_type(path)?;
    let file = File::options()
        .write(true)
        .create(true)
        .mode(0o666)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    let file = confirm_regular(path, file)?;
    file.set_len(0)?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fifo(path: &Path) {
        nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o666)).unwrap();
    }

    #[test]
    fn reads_regular_files_only() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("f");
        std::fs::write(&file, b"data").unwrap();
        assert_eq!(io::read_to_string(regular_for_reading(&file).unwrap()).unwrap(), "data");
        assert_eq!(regular_for_reading(tmp.path()).unwrap_err().kind(), io::ErrorKind::IsADirectory);
        assert_eq!(regular_for_reading(&tmp.path().join("none")).unwrap_err().kind(), io::ErrorKind::NotFound);
        // Returns at once, where a plain open would wait for a writer.
        fifo(&tmp.path().join("p"));
        assert_eq!(regular_for_reading(&tmp.path().join("p")).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        std::os::unix::fs::symlink(tmp.path().join("p"), tmp.path().join("l")).unwrap();
        assert_eq!(regular_for_reading(&tmp.path().join("l")).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(regular_for_reading(Path::new("/dev/null")).unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn writes_create_or_truncate_regular_files_only() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("f");
        io::Write::write_all(&mut regular_for_writing(&file).unwrap(), b"long content").unwrap();
        io::Write::write_all(&mut regular_for_writing(&file).unwrap(), b"short").unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"short");
        assert_eq!(regular_for_writing(tmp.path()).unwrap_err().kind(), io::ErrorKind::IsADirectory);
        fifo(&tmp.path().join("p"));
        assert_eq!(regular_for_writing(&tmp.path().join("p")).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(regular_for_writing(Path::new("/dev/null")).unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }
}
