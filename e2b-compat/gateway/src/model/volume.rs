//! A persistent volume as the API knows it: a name unique in its team, the
//! token its content API demands, and where sandboxes mount it. The bytes
//! live in the substrate (`Substrate::create_volume`), keyed by the id.

use serde::{Deserialize, Serialize};

const MAX_NAME_BYTES: usize = 63;
/// Mounts one sandbox may ask for.
pub const MAX_MOUNTS: usize = 16;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VolumeRecord {
    pub id: String,
    pub team: String,
    pub name: String,
    /// What the content API demands (`Authorization: Bearer`).
    pub token: String,
    pub created_at_ms: i64,
    /// The node whose host holds its bytes, on a shared database (`None`
    /// on a single host): its sandboxes run there and its content API is
    /// served there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Set while the volume moves between nodes through the object store
    /// (`service/volume_moves.rs`); `node` still names the node it left.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved_out: Option<VolumeMove>,
}

impl VolumeRecord {
    /// Whether it waits in the object store for the next node that needs
    /// it: no node holds it for calls and creates any more.
    pub fn waits_in_object_store(&self) -> bool {
        matches!(self.moved_out, Some(VolumeMove::Stored { .. }))
    }
}

/// Where a volume leaving its node is. Its bytes on that node are frozen
/// from the moment it is `Uploading`: no content call and no sandbox
/// writes them any more.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum VolumeMove {
    /// Its node is writing it to the object store.
    Uploading,
    /// Whole in the object store, as the stream whose manifest hashes to
    /// `manifest_sha256`; the next node that needs it fetches it and
    /// claims it.
    Stored { manifest_sha256: String },
}

impl VolumeMove {
    /// The two fields a swap of the record compares (`VolumeStore::swap_volume`).
    pub fn state(this: Option<&Self>) -> (Option<&'static str>, Option<&str>) {
        match this {
            None => (None, None),
            Some(Self::Uploading) => (Some("uploading"), None),
            Some(Self::Stored { manifest_sha256 }) => (Some("stored"), Some(manifest_sha256)),
        }
    }
}

/// One volume at one path of a sandbox, as its record keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeMount {
    pub volume_id: String,
    pub name: String,
    pub path: String,
}

#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("volume {0} not found")]
    NotFound(String),
    #[error("a volume named {0:?} already exists")]
    NameTaken(String),
    #[error("{0}")]
    Invalid(String),
    /// Deleting a volume a sandbox still mounts.
    #[error("{0}")]
    InUse(String),
    /// The volume is between nodes (`service/volume_moves.rs`).
    #[error("{0}")]
    Moving(String),
    /// The substrate refused (no volumes there, a host lacking its quota
    /// file system); the API maps its kind as for sandboxes.
    #[error(transparent)]
    Substrate(copse_substrate::SubstrateError),
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

/// Names go into mounts (`volume_mounts={"/mnt": "name"}`), CLI tables and
/// log lines: short and plain.
pub fn validate_volume_name(name: &str) -> Result<(), VolumeError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.');
    if ok {
        Ok(())
    } else {
        Err(VolumeError::Invalid(format!(
            "invalid volume name {name:?}: 1 to {MAX_NAME_BYTES} letters, digits, '-', '_' or '.', \
             starting with a letter or digit"
        )))
    }
}

/// Paths a volume may neither cover nor sit under: the sandbox's own
/// mounts (the agent, its socket, the kernel's file systems).
const RESERVED_TREES: &[&str] = &["/.copse", "/proc", "/sys", "/dev"];
/// System directories a volume may neither replace nor sit under, so it
/// never shadows what the template's programs load.
const SYSTEM_TREES: &[&str] =
    &["/bin", "/boot", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/run", "/sbin", "/usr"];

/// A mount path as the substrate will get it: absolute, normal (no `.`,
/// `..`, empty or trailing components), clear of the sandbox's own mounts
/// and system directories. Returned without a trailing slash.
pub fn validate_mount_path(path: &str) -> Result<String, VolumeError> {
    let invalid = |why: &str| VolumeError::Invalid(format!("invalid volume mount path {path:?}: {why}"));
    if !path.starts_with('/') || path.len() > 1024 || path.contains('\0') {
        return Err(invalid("it must be an absolute path of at most 1024 bytes"));
    }
    let parts: Vec<&str> = path[1..].trim_end_matches('/').split('/').collect();
    if parts.iter().any(|p| p.is_empty() || *p == "." || *p == "..") {
        return Err(invalid("no empty, '.' or '..' components"));
    }
    let normal = format!("/{}", parts.join("/"));
    if normal == "/" || parts == [""] {
        return Err(invalid("a volume cannot replace the root"));
    }
    let under = |tree: &str| normal == tree || normal.starts_with(&format!("{tree}/"));
    if let Some(tree) = RESERVED_TREES.iter().find(|t| under(t) || t.starts_with(&format!("{normal}/"))) {
        return Err(invalid(&format!("it overlaps {tree}, which the sandbox itself needs")));
    }
    if let Some(tree) = SYSTEM_TREES.iter().find(|t| under(t) || t.starts_with(&format!("{normal}/"))) {
        return Err(invalid(&format!("it overlaps the system directory {tree}")));
    }
    Ok(normal)
}

/// No two mounts of one sandbox at the same path or one inside another.
pub fn validate_mounts(mounts: &[VolumeMount]) -> Result<(), VolumeError> {
    if mounts.len() > MAX_MOUNTS {
        return Err(VolumeError::Invalid(format!("at most {MAX_MOUNTS} volume mounts per sandbox")));
    }
    for (i, a) in mounts.iter().enumerate() {
        for b in &mounts[i + 1..] {
            let nested = |x: &str, y: &str| x == y || y.starts_with(&format!("{x}/"));
            if nested(&a.path, &b.path) || nested(&b.path, &a.path) {
                return Err(VolumeError::Invalid(format!("volume mounts {} and {} overlap", a.path, b.path)));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_short_and_plain() {
        for good in ["data", "my-vol_1", "v.2", "A"] {
            assert!(validate_volume_name(good).is_ok(), "{good}");
        }
        for bad in ["", "-x", ".hidden", "a/b", "a b", "ü", &"x".repeat(64)] {
            assert!(validate_volume_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn mount_paths_are_normal_and_clear_of_the_sandboxes_own() {
        assert_eq!(validate_mount_path("/mnt/data").unwrap(), "/mnt/data");
        assert_eq!(validate_mount_path("/mnt/data/").unwrap(), "/mnt/data");
        assert_eq!(validate_mount_path("/home/user/work").unwrap(), "/home/user/work");
        for bad in [
            "mnt/data",
            "/",
            "//",
            "/mnt/../etc",
            "/mnt/./x",
            "/mnt//x",
            "/..",
            "/.copse",
            "/.copse/run",
            "/proc/self",
            "/dev",
            "/sys/fs",
            "/etc",
            "/usr/lib/x",
            "/lib",
            "/run",
            "/a\0b",
        ] {
            assert!(validate_mount_path(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn mounts_of_one_sandbox_do_not_nest() {
        let mount = |path: &str| VolumeMount { volume_id: "v".into(), name: "n".into(), path: path.into() };
        assert!(validate_mounts(&[mount("/mnt/a"), mount("/mnt/ab")]).is_ok());
        assert!(validate_mounts(&[mount("/mnt/a"), mount("/mnt/a")]).is_err());
        assert!(validate_mounts(&[mount("/mnt/a"), mount("/mnt/a/b")]).is_err());
        assert!(validate_mounts(&[mount("/mnt/a/b"), mount("/mnt/a")]).is_err());
    }
}
