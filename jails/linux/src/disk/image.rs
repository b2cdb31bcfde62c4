//! The btrfs file system that holds every sandbox's writable layer, when the
//! state directory is not on btrfs already: a sparse image file beside it,
//! formatted once and mounted through a loop device.
//!
//! The mount is made once and left in place (a crashed or stopped gateway
//! leaves it; the next start finds it and reuses it). The loop device is
//! set to clear itself when the mount goes, and to do direct I/O so the
//! image's blocks are not cached twice (once by btrfs, once for the file).
//! `discard=async` hands freed blocks back to the host file system as holes.

use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

/// Mount options: freed blocks become holes in the image again.
pub const MOUNT_OPTIONS: &str = "discard=async";

const GIB: u64 = 1 << 30;

/// How big a new image may grow: three quarters of what the host file
/// system has free, in whole GiB, at least 1 GiB. The image is sparse, so
/// this is a ceiling on all sandboxes' writable layers together, not space
/// taken now.
pub fn default_size(available_bytes: u64) -> u64 {
    (available_bytes / 4 * 3 / GIB).max(1) * GIB
}

/// Makes `image` (sparse, `size` bytes) and formats it, unless it exists.
/// The file gets its final name only once formatted, so a crash midway
/// leaves no half-made image to mount.
pub fn ensure_image(image: &Path, size: u64) -> anyhow::Result<bool> {
    if image.exists() {
        return Ok(false);
    }
    let partial = image.with_extension("partial");
    let _ = fs::remove_file(&partial);
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&partial)
        .with_context(|| format!("creating {}", partial.display()))?;
    file.set_len(size).with_context(|| format!("sizing {}", partial.display()))?;
    drop(file);
    let output = Command::new("mkfs.btrfs")
        .args(["-q", "-L", "copse-sandboxes"])
        .arg(&partial)
        .stdin(Stdio::null())
        .output()
        .context("running mkfs.btrfs (Debian package btrfs-progs)")?;
    if !output.status.success() {
        let _ = fs::remove_file(&partial);
        bail!("mkfs.btrfs failed: {}", String::from_utf8_lossy(&output.stderr).trim());
    }
    fs::rename(&partial, image).with_context(|| format!("naming {}", image.display()))?;
    Ok(true)
}

/// Attaches `image` to a free loop device and mounts it on `dir`.
pub fn mount(image: &Path, dir: &Path) -> anyhow::Result<()> {
    let backing = OpenOptions::new()
        .read(true)
        .write(true)
        .open(image)
        .with_context(|| format!("opening {}", image.display()))?;
    let (device, loop_file) = loop_attach(&backing, image)?;
    let mounted =
        nix::mount::mount(Some(&device), dir, Some("btrfs"), nix::mount::MsFlags::empty(), Some(MOUNT_OPTIONS))
            .with_context(|| format!("mounting {} ({}) on {}", device.display(), image.display(), dir.display()));
    // Autoclear detaches the device when its last user goes: this file now,
    // or the mount later.
    drop(loop_file);
    mounted
}

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_DIRECT_IO: u32 = 16;
const LO_NAME_SIZE: usize = 64;

#[repr(C)]
struct LoopInfo64 {
    device: u64,
    inode: u64,
    rdevice: u64,
    offset: u64,
    sizelimit: u64,
    number: u32,
    encrypt_type: u32,
    encrypt_key_size: u32,
    flags: u32,
    file_name: [u8; LO_NAME_SIZE],
    crypt_name: [u8; LO_NAME_SIZE],
    encrypt_key: [u8; 32],
    init: [u64; 2],
}

#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// A free loop device configured on `backing` in one step (LOOP_CONFIGURE,
/// Linux 5.8), retried when another process takes the same free device.
fn loop_attach(backing: &File, image: &Path) -> anyhow::Result<(PathBuf, File)> {
    let control =
        OpenOptions::new().read(true).write(true).open("/dev/loop-control").context("opening /dev/loop-control")?;
    for _ in 0..16 {
        // SAFETY: an ioctl without an argument on the control device.
        let number = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE) };
        if number < 0 {
            return Err(std::io::Error::last_os_error()).context("finding a free loop device");
        }
        let device = PathBuf::from(format!("/dev/loop{number}"));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&device)
            .with_context(|| format!("opening {}", device.display()))?;
        let mut config = LoopConfig {
            fd: backing.as_raw_fd() as u32,
            block_size: 4096,
            // SAFETY: plain data; all zeroes is the kernel's "unset".
            info: unsafe { std::mem::zeroed() },
            reserved: [0; 8],
        };
        config.info.flags = LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO;
        let name = image.as_os_str().as_encoded_bytes();
        let len = name.len().min(LO_NAME_SIZE - 1);
        config.info.file_name[..len].copy_from_slice(&name[..len]);
        // SAFETY: a loop device fd and a config of the kernel's layout.
        if unsafe { libc::ioctl(file.as_raw_fd(), LOOP_CONFIGURE, &config) } == 0 {
            return Ok((device, file));
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EBUSY) {
            return Err(err).with_context(|| format!("configuring {}", device.display()));
        }
    }
    bail!("no free loop device after 16 tries")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loop_config_has_the_kernels_layout() {
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
    }

    #[test]
    fn images_take_three_quarters_of_free_space_in_whole_gib() {
        assert_eq!(default_size(100 * GIB), 75 * GIB);
        assert_eq!(default_size(10 * GIB + 5), 7 * GIB);
        assert_eq!(default_size(0), GIB);
    }
}
