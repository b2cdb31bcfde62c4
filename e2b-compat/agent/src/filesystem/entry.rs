//! `EntryInfo`: what envd reports about one path (`services/filesystem/
//! utils.go`). A symlink is described by its target's type and mode, with
//! `isSymlink` and `symlinkTarget` set; `permissions` is Go's
//! `FileMode.String()` of the link itself.

use std::collections::HashMap;
use std::fs::Metadata;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use serde::Serialize;

use super::xattr;
use crate::connect::RpcError;
use crate::users::OwnerNames;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum FileType {
    #[serde(rename = "FILE_TYPE_UNSPECIFIED")]
    Unspecified,
    #[serde(rename = "FILE_TYPE_FILE")]
    File,
    #[serde(rename = "FILE_TYPE_DIRECTORY")]
    Directory,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EntryInfo {
    pub name: String,
    #[serde(rename = "type")]
    pub file_type: FileType,
    pub path: String,
    /// int64: a string in proto3 JSON.
    #[serde(serialize_with = "int64_as_string")]
    pub size: i64,
    pub mode: u32,
    pub permissions: String,
    pub owner: String,
    pub group: String,
    pub modified_time: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    #[serde(skip_serializing_if = "HashMap::is_empty")]
    pub metadata: HashMap<String, String>,
    pub is_symlink: bool,
}

fn int64_as_string<S: serde::Serializer>(v: &i64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&v.to_string())
}

fn file_type(meta: &Metadata) -> FileType {
    if meta.is_file() {
        FileType::File
    } else if meta.is_dir() {
        FileType::Directory
    } else {
        FileType::Unspecified
    }
}

/// Describes `path` (not following a final symlink for the entry itself).
pub fn entry_info(path: &Path, names: &OwnerNames) -> Result<EntryInfo, RpcError> {
    let meta = std::fs::symlink_metadata(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            RpcError::not_found(format!("file not found: {}", path.display()))
        } else {
            RpcError::internal(format!("error getting file info: {e}"))
        }
    })?;
    let is_symlink = meta.file_type().is_symlink();
    let (file_type, mode, symlink_target) = if is_symlink {
        // The target as the kernel resolves it; dangling links keep no type.
        let target = std::fs::canonicalize(path).ok();
        let target_meta = std::fs::metadata(path).ok();
        (
            target_meta.as_ref().map(file_type).unwrap_or(FileType::Unspecified),
            target_meta.map(|m| m.mode() & 0o777).unwrap_or(0),
            target.map(|t| t.display().to_string()),
        )
    } else {
        (file_type(&meta), meta.mode() & 0o777, None)
    };
    Ok(EntryInfo {
        name: path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "/".into()),
        file_type,
        path: path.display().to_string(),
        size: meta.size() as i64,
        mode,
        permissions: go_mode_string(&meta),
        owner: names.user(meta.uid()),
        group: names.group(meta.gid()),
        modified_time: rfc3339(meta.mtime(), meta.mtime_nsec()),
        symlink_target,
        metadata: if is_symlink { HashMap::new() } else { xattr::read_metadata(path) },
        is_symlink,
    })
}

/// Protobuf Timestamp JSON: RFC 3339 in UTC.
fn rfc3339(secs: i64, nanos: i64) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp(secs)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
        .replace_nanosecond(nanos.clamp(0, 999_999_999) as u32)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    t.format(&time::format_description::well_known::Rfc3339).unwrap_or_default()
}

/// Go's `os.FileMode.String()`: type letters (`d`, `L`, `D`, `p`, `S`,
/// `u`, `g`, `c`, `t`) or `-`, then `rwxrwxrwx`.
pub fn go_mode_string(meta: &Metadata) -> String {
    let ft = meta.file_type();
    let mode = meta.mode();
    let mut s = String::with_capacity(12);
    if ft.is_dir() {
        s.push('d');
    }
    if ft.is_symlink() {
        s.push('L');
    }
    if ft.is_block_device() || ft.is_char_device() {
        s.push('D');
    }
    if ft.is_fifo() {
        s.push('p');
    }
    if ft.is_socket() {
        s.push('S');
    }
    if mode & 0o4000 != 0 {
        s.push('u');
    }
    if mode & 0o2000 != 0 {
        s.push('g');
    }
    if ft.is_char_device() {
        s.push('c');
    }
    if mode & 0o1000 != 0 {
        s.push('t');
    }
    if s.is_empty() {
        s.push('-');
    }
    const RWX: &[u8; 9] = b"rwxrwxrwx";
    for (i, c) in RWX.iter().enumerate() {
        s.push(if mode & (1 << (8 - i)) != 0 { *c as char } else { '-' });
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn mode_strings_match_go() {
        let tmp = tempfile::tempdir().unwrap();
        let f = tmp.path().join("f");
        std::fs::write(&f, b"abc").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(go_mode_string(&std::fs::metadata(&f).unwrap()), "-rw-r--r--");
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(go_mode_string(&std::fs::metadata(tmp.path()).unwrap()), "drwxr-xr-x");
        let l = tmp.path().join("l");
        std::os::unix::fs::symlink(&f, &l).unwrap();
        assert_eq!(go_mode_string(&std::fs::symlink_metadata(&l).unwrap()), "Lrwxrwxrwx");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o4755)).unwrap();
        assert_eq!(go_mode_string(&std::fs::metadata(&f).unwrap()), "urwxr-xr-x");
    }

    #[test]
    fn symlinks_report_their_target() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("d");
        std::fs::create_dir(&dir).unwrap();
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        let e = entry_info(&link, &OwnerNames::default()).unwrap();
        assert!(e.is_symlink);
        assert_eq!(e.file_type, FileType::Directory);
        assert_eq!(e.symlink_target.as_deref(), Some(dir.canonicalize().unwrap().to_str().unwrap()));
        assert_eq!(e.name, "link");
    }

    #[test]
    fn entry_json_shape() {
        let tmp = tempfile::tempdir().unwrap();
        let f = tmp.path().join("a.txt");
        std::fs::write(&f, b"hello").unwrap();
        let v = serde_json::to_value(entry_info(&f, &OwnerNames::default()).unwrap()).unwrap();
        assert_eq!(v["type"], "FILE_TYPE_FILE");
        assert_eq!(v["size"], "5");
        assert_eq!(v["name"], "a.txt");
        assert!(v["modifiedTime"].as_str().unwrap().ends_with('Z'));
        assert_eq!(v["isSymlink"], false);
        assert!(v.get("symlinkTarget").is_none());
    }

    #[test]
    fn missing_paths_are_not_found() {
        let e = entry_info(Path::new("/nonexistent/x"), &OwnerNames::default()).unwrap_err();
        assert_eq!(e.code, crate::connect::Code::NotFound);
    }
}
