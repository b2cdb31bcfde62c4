//! File metadata (envd ≥ 0.6.2): uploads carry `X-Metadata-<key>` headers,
//! stored as `user.e2b.<key>` extended attributes and reported back in
//! `EntryInfo.metadata`. Only Linux is wired up; elsewhere metadata is
//! accepted and not stored.

use std::collections::HashMap;
use std::path::Path;

pub const PREFIX: &str = "user.e2b.";

#[cfg(target_os = "linux")]
mod sys {
    use std::ffi::CString;
    use std::io;
    use std::os::unix::ffi::OsStrExt;
    use std::path::Path;

    fn cpath(p: &Path) -> io::Result<CString> {
        CString::new(p.as_os_str().as_bytes()).map_err(io::Error::other)
    }

    pub fn set(path: &Path, name: &str, value: &[u8]) -> io::Result<()> {
        let (p, n) = (cpath(path)?, CString::new(name).map_err(io::Error::other)?);
        // SAFETY: valid C strings and a buffer of value.len() bytes.
        let rc = unsafe { libc::setxattr(p.as_ptr(), n.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
        if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
    }

    pub fn list(path: &Path) -> io::Result<Vec<String>> {
        let p = cpath(path)?;
        let mut buf = vec![0u8; 4096];
        // SAFETY: buf is valid for buf.len() bytes.
        let n = unsafe { libc::listxattr(p.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        buf.truncate(n as usize);
        Ok(buf.split(|b| *b == 0).filter(|s| !s.is_empty()).map(|s| String::from_utf8_lossy(s).into_owned()).collect())
    }

    pub fn get(path: &Path, name: &str) -> io::Result<Vec<u8>> {
        let (p, n) = (cpath(path)?, CString::new(name).map_err(io::Error::other)?);
        let mut buf = vec![0u8; 4096];
        // SAFETY: buf is valid for buf.len() bytes.
        let len = unsafe { libc::getxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if len < 0 {
            return Err(io::Error::last_os_error());
        }
        buf.truncate(len as usize);
        Ok(buf)
    }
}

#[cfg(not(target_os = "linux"))]
mod sys {
    use std::io;
    use std::path::Path;

    pub fn set(_: &Path, _: &str, _: &[u8]) -> io::Result<()> {
        Err(io::Error::from(io::ErrorKind::Unsupported))
    }
    pub fn list(_: &Path) -> io::Result<Vec<String>> {
        Ok(Vec::new())
    }
    pub fn get(_: &Path, _: &str) -> io::Result<Vec<u8>> {
        Err(io::Error::from(io::ErrorKind::Unsupported))
    }
}

/// Stores `metadata` on `path`; keys are lowercased like envd does.
pub fn write_metadata(path: &Path, metadata: &HashMap<String, String>) -> std::io::Result<()> {
    for (k, v) in metadata {
        sys::set(path, &format!("{PREFIX}{}", k.to_ascii_lowercase()), v.as_bytes())?;
    }
    Ok(())
}

/// The `user.e2b.*` attributes of `path`; empty when there are none or the
/// filesystem has no xattr support.
pub fn read_metadata(path: &Path) -> HashMap<String, String> {
    let Ok(names) = sys::list(path) else { return HashMap::new() };
    names
        .into_iter()
        .filter_map(|n| {
            let key = n.strip_prefix(PREFIX)?.to_string();
            let value = sys::get(path, &n).ok()?;
            Some((key, String::from_utf8_lossy(&value).into_owned()))
        })
        .collect()
}
