//! The three files of a bhyve checkpoint and the metadata bhyve writes next
//! to guest memory (`FILE.meta`, JSON).

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// `VM_MEM_F_WIRED` in libvmmapi: guest memory was wired (`bhyve -S`).
const MEMFLAG_WIRED: u32 = 0x02;

/// Largest guest a vnode restore accepts: bhyve's lowmem limit. Above it
/// guest memory is split at 4 GiB while the checkpoint stores it densely,
/// so file offsets and segment offsets would disagree.
pub const VNODE_RESTORE_MAX_BYTES: u64 = 3 << 30;

/// Paths of one checkpoint as `bhyvectl --suspend=FILE` leaves them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointFiles {
    /// Raw guest memory.
    pub memory: PathBuf,
    /// Kernel and device state blobs.
    pub kern: PathBuf,
    /// JSON metadata.
    pub meta: PathBuf,
}

impl CheckpointFiles {
    pub fn at(memory: impl Into<PathBuf>) -> Self {
        let memory = memory.into();
        let with = |suffix: &str| {
            let mut name = memory.clone().into_os_string();
            name.push(suffix);
            PathBuf::from(name)
        };
        Self { kern: with(".kern"), meta: with(".meta"), memory }
    }
}

/// The part of `FILE.meta` a restore depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointMeta {
    pub vm_name: String,
    pub cpus: u32,
    pub memory_bytes: u64,
    pub memflags: u32,
    /// Device names in the order bhyve saved them; the restoring bhyve must
    /// be given the same devices.
    pub devices: Vec<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CheckpointError {
    #[error("checkpoint metadata is not valid JSON of the expected shape: {0}")]
    Malformed(String),
    #[error("checkpoint records {recorded} bytes of memory but the memory file has {actual}")]
    SizeMismatch { recorded: u64, actual: u64 },
    #[error("guest memory was wired; a vnode restore cannot share wired memory")]
    Wired,
    #[error("guest has {0} bytes of memory; vnode restore supports at most {VNODE_RESTORE_MAX_BYTES}")]
    TooLarge(u64),
    #[error("guest memory size {0} is not a multiple of the page size")]
    Unaligned(u64),
}

#[derive(Deserialize)]
struct RawMeta {
    #[serde(rename = "basic metadata")]
    basic: RawBasic,
    #[serde(default)]
    devices: Vec<RawEntry>,
}

#[derive(Deserialize)]
struct RawBasic {
    ncpus: u32,
    vmname: String,
    memsize: u64,
    #[serde(default)]
    memflags: u32,
}

#[derive(Deserialize)]
struct RawEntry {
    device: String,
}

impl CheckpointMeta {
    pub fn parse(json: &str) -> Result<Self, CheckpointError> {
        let raw: RawMeta = serde_json::from_str(json).map_err(|e| CheckpointError::Malformed(e.to_string()))?;
        Ok(Self {
            vm_name: raw.basic.vmname,
            cpus: raw.basic.ncpus,
            memory_bytes: raw.basic.memsize,
            memflags: raw.basic.memflags,
            devices: raw.devices.into_iter().map(|d| d.device).collect(),
        })
    }

    pub fn read(files: &CheckpointFiles) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(&files.meta)?;
        Ok(Self::parse(&text)?)
    }

    /// Whether this checkpoint can back guests with its memory file, given
    /// that file's size on disk. Mirrors the checks the patched bhyve makes,
    /// so a pool refuses before it spawns anything.
    pub fn check_vnode_restore(&self, memory_file_bytes: u64) -> Result<(), CheckpointError> {
        if memory_file_bytes != self.memory_bytes {
            return Err(CheckpointError::SizeMismatch { recorded: self.memory_bytes, actual: memory_file_bytes });
        }
        if self.memflags & MEMFLAG_WIRED != 0 {
            return Err(CheckpointError::Wired);
        }
        if self.memory_bytes > VNODE_RESTORE_MAX_BYTES {
            return Err(CheckpointError::TooLarge(self.memory_bytes));
        }
        if self.memory_bytes % 4096 != 0 {
            return Err(CheckpointError::Unaligned(self.memory_bytes));
        }
        Ok(())
    }
}

/// Size of the memory file on disk.
pub fn memory_file_bytes(path: &Path) -> std::io::Result<u64> {
    Ok(std::fs::metadata(path)?.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    const META: &str = r#"{
      "basic metadata": {"ncpus": 2, "vmname": "tpl-python", "memsize": 268435456, "memflags": 0},
      "kern_structs": [{"device": "vhpet", "size": 1234, "file_offset": 0}],
      "devices": [
        {"device": "virtio-net", "size": 100, "file_offset": 1234},
        {"device": "virtio-blk", "size": 200, "file_offset": 1334},
        {"device": "lpc", "size": 8, "file_offset": 1534}
      ]
    }"#;

    #[test]
    fn parses_what_bhyve_writes() {
        let meta = CheckpointMeta::parse(META).unwrap();
        assert_eq!(
            meta,
            CheckpointMeta {
                vm_name: "tpl-python".into(),
                cpus: 2,
                memory_bytes: 256 << 20,
                memflags: 0,
                devices: vec!["virtio-net".into(), "virtio-blk".into(), "lpc".into()],
            }
        );
    }

    #[test]
    fn rejects_metadata_without_basic_section() {
        let err = CheckpointMeta::parse(r#"{"devices": []}"#).unwrap_err();
        assert!(matches!(err, CheckpointError::Malformed(_)), "{err:?}");
    }

    #[test]
    fn vnode_restore_checks() {
        let meta = CheckpointMeta::parse(META).unwrap();
        assert_eq!(meta.check_vnode_restore(256 << 20), Ok(()));
        assert_eq!(
            meta.check_vnode_restore(255 << 20),
            Err(CheckpointError::SizeMismatch { recorded: 256 << 20, actual: 255 << 20 })
        );
        let wired = CheckpointMeta { memflags: 0x02 | 0x01, ..meta.clone() };
        assert_eq!(wired.check_vnode_restore(256 << 20), Err(CheckpointError::Wired));
        let big = CheckpointMeta { memory_bytes: 4 << 30, ..meta.clone() };
        assert_eq!(big.check_vnode_restore(4 << 30), Err(CheckpointError::TooLarge(4 << 30)));
        let odd = CheckpointMeta { memory_bytes: (256 << 20) + 512, ..meta };
        assert_eq!(odd.check_vnode_restore((256 << 20) + 512), Err(CheckpointError::Unaligned((256 << 20) + 512)));
    }

    #[test]
    fn file_names_follow_bhyvectl() {
        let files = CheckpointFiles::at("/pool/ckp/tpl.ckp");
        assert_eq!(files.kern, PathBuf::from("/pool/ckp/tpl.ckp.kern"));
        assert_eq!(files.meta, PathBuf::from("/pool/ckp/tpl.ckp.meta"));
    }

    #[test]
    fn reads_from_disk() {
        let dir = tempfile::tempdir().unwrap();
        let files = CheckpointFiles::at(dir.path().join("g.ckp"));
        std::fs::write(&files.meta, META).unwrap();
        std::fs::write(&files.memory, vec![0u8; 8192]).unwrap();
        let meta = CheckpointMeta::read(&files).unwrap();
        assert_eq!(meta.cpus, 2);
        assert_eq!(memory_file_bytes(&files.memory).unwrap(), 8192);
    }
}
