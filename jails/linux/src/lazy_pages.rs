//! Restoring a large memory lazily: the sandbox is handed over as soon as
//! its process tree has its shape back, and its pages arrive afterwards.
//!
//! `criu restore --lazy-pages` restores everything but the private
//! anonymous pages and registers those ranges with a userfaultfd per task;
//! a `criu lazy-pages` pager, started here beside it on the same work
//! directory (they meet on `lazy-pages.socket` there), copies each page in
//! on its first touch and the rest in the background, then exits. A
//! task in the sandbox's user namespace may not open a userfaultfd itself
//! here (`vm.unprivileged_userfaultfd` stays 0), so copse's CRIU patch
//! (`patches/criu/uffd-in-userns.patch`) has it come from `/dev/userfaultfd`
//! opened by CRIU as the host's root; `criu check --feature uffd-dev` says
//! whether that is there, and without it every restore is eager.
//!
//! Two rules keep a sandbox from ever running on memory it did not have:
//! a pager that fails gets the restored init (and with it the sandbox's
//! pid namespace) killed, and a dump waits for the copy to end first (CRIU
//! saves the pages the kernel shows present, so a page not copied yet
//! would be saved as zeros).
//!
//! Small checkpoints restore eagerly: below [`LAZY_FROM`], starting a
//! second CRIU costs about what it saves.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use std::{fs, thread};

use anyhow::{Context, bail};

use crate::checkpoint::log_tail;
use crate::process_start_time;

/// Checkpoints with at least this many bytes of pages restore lazily.
pub const LAZY_FROM: u64 = 128 << 20;

/// Where restore and pager meet, relative to their work directory (CRIU's
/// own name).
const SOCKET: &str = "lazy-pages.socket";
/// The pager's pid and start time, for [`wait_for_copy`].
const PID_FILE: &str = "lazy-pages.pid";
const LOG: &str = "lazy-pages.log";
/// How long a pager may take to listen.
const LISTEN_WAIT: Duration = Duration::from_secs(5);

/// Bytes of page images in checkpoint `images`.
pub fn pages_bytes(images: &Path) -> u64 {
    fs::read_dir(images)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.starts_with("pages-") && n.ends_with(".img")))
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

/// Whether restoring `images` lazily is worth a pager.
pub fn worth_it(images: &Path) -> bool {
    pages_bytes(images) >= LAZY_FROM
}

/// `criu lazy-pages` arguments serving `images` to a restore working in
/// `work_dir`.
pub fn pager_args(images: &Path, work_dir: &Path) -> Vec<String> {
    let (images, work_dir) = (images.display().to_string(), work_dir.display().to_string());
    ["lazy-pages", "--images-dir", &images, "--work-dir", &work_dir, "--log-file", LOG].map(String::from).to_vec()
}

/// A running `criu lazy-pages`.
pub struct Pager {
    child: Child,
    work_dir: PathBuf,
}

impl Pager {
    /// Starts a pager for `images` and waits until it listens in
    /// `work_dir`. It gets no part of the gateway's environment and a
    /// process group of its own (a signal to the gateway's group is not
    /// one to a sandbox's memory).
    pub fn start(criu: &Path, images: &Path, work_dir: &Path) -> anyhow::Result<Self> {
        let socket = work_dir.join(SOCKET);
        match fs::remove_file(&socket) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing {}", socket.display()));
            }
            _ => {}
        }
        let child = Command::new(criu)
            .args(pager_args(images, work_dir))
            .env_clear()
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .context("starting criu lazy-pages")?;
        let mut pager = Self { child, work_dir: work_dir.to_path_buf() };
        let listening = pager.note_pid().and_then(|()| pager.wait_listening(&socket));
        if let Err(e) = listening {
            pager.abandon();
            return Err(e);
        }
        Ok(pager)
    }

    fn note_pid(&self) -> anyhow::Result<()> {
        let pid = self.child.id() as i32;
        let start = process_start_time(pid).context("criu lazy-pages exited at once")?;
        let path = self.work_dir.join(PID_FILE);
        fs::write(&path, format!("{pid} {start}\n")).with_context(|| format!("writing {}", path.display()))
    }

    fn wait_listening(&mut self, socket: &Path) -> anyhow::Result<()> {
        let deadline = Instant::now() + LISTEN_WAIT;
        while !socket.exists() {
            if let Some(status) = self.child.try_wait()? {
                bail!("criu lazy-pages ended ({status}) before it listened: {}", log_tail(&self.work_dir.join(LOG)));
            }
            if Instant::now() > deadline {
                bail!("criu lazy-pages did not listen within {LISTEN_WAIT:?}");
            }
            thread::sleep(Duration::from_millis(2));
        }
        Ok(())
    }

    /// Stops a pager whose restore failed.
    pub fn abandon(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Hands the pager to a thread that reaps it; if it fails, the
    /// restored tree under `init` (started at `init_start`) is killed.
    pub fn watch(mut self, init: i32, init_start: u64) {
        let spawned = thread::Builder::new().name("lazy-pages".into()).spawn(move || {
            let status = self.child.wait();
            if status.as_ref().is_ok_and(|s| s.success()) {
                return;
            }
            if process_start_time(init) == Some(init_start) {
                // SAFETY: a plain kill(2) of the process checked just above.
                unsafe { libc::kill(init, libc::SIGKILL) };
            }
            tracing::error!(
                init,
                log = %log_tail(&self.work_dir.join(LOG)),
                "copying a restored sandbox's memory failed ({status:?}): its processes were killed"
            );
        });
        if let Err(e) = spawned {
            tracing::error!("watching a lazy restore's pager: {e}");
        }
    }
}

/// Where a sandbox's restore works (CRIU's logs, the pager's socket and
/// pid file), under its directory, and the pid file CRIU writes there once
/// the tree is back.
pub const WORK_DIR: &str = "restore";
pub const RESTORED_PID: &str = "init.pid";

/// Whether the restore of the sandbox in `sandbox_dir` may still read its
/// checkpoint: it has not put the tree back yet, or its pager still copies
/// (a garbled pid file counts as copying).
pub fn may_read_checkpoint(sandbox_dir: &Path) -> bool {
    let work_dir = sandbox_dir.join(WORK_DIR);
    !work_dir.join(RESTORED_PID).exists() || wait_for_copy(&work_dir, Duration::ZERO).is_err()
}

/// Waits until the pager of the restore that worked in `work_dir` (if
/// any) has copied everything, for at most `within`.
pub fn wait_for_copy(work_dir: &Path, within: Duration) -> anyhow::Result<()> {
    let Ok(text) = fs::read_to_string(work_dir.join(PID_FILE)) else { return Ok(()) };
    let mut fields = text.split_whitespace().map(str::parse::<u64>);
    let (Some(Ok(pid)), Some(Ok(start))) = (fields.next(), fields.next()) else {
        bail!("{} holds no pid and start time", work_dir.join(PID_FILE).display());
    };
    let pid = i32::try_from(pid).context("the pager's pid is out of range")?;
    let deadline = Instant::now() + within;
    while process_start_time(pid) == Some(start) {
        if Instant::now() > deadline {
            bail!("the sandbox's memory is still being copied in after {within:?}");
        }
        thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_page_images_count() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("pages-1.img"), vec![0u8; 4096]).unwrap();
        fs::write(dir.path().join("pages-2.img"), vec![0u8; 8192]).unwrap();
        fs::write(dir.path().join("pagemap-1.img"), vec![0u8; 100]).unwrap();
        fs::create_dir(dir.path().join("pages-3.img")).unwrap();
        assert_eq!(pages_bytes(dir.path()), 12288);
        assert!(!worth_it(dir.path()));
        assert_eq!(pages_bytes(&dir.path().join("missing")), 0);
    }

    #[test]
    fn the_pager_serves_the_images_in_the_restores_work_dir() {
        let args = pager_args(Path::new("/s/checkpoints/x"), Path::new("/s/sandboxes/a/restore"));
        assert_eq!(
            args.join(" "),
            "lazy-pages --images-dir /s/checkpoints/x --work-dir /s/sandboxes/a/restore --log-file lazy-pages.log"
        );
    }

    #[test]
    fn a_copy_is_waited_for_only_while_its_pager_runs() {
        let dir = tempfile::tempdir().unwrap();
        wait_for_copy(dir.path(), Duration::ZERO).expect("no pager: nothing to wait for");
        let me = std::process::id() as i32;
        let start = process_start_time(me).unwrap();
        fs::write(dir.path().join(PID_FILE), format!("{me} {}\n", start + 1)).unwrap();
        wait_for_copy(dir.path(), Duration::ZERO).expect("another process under the pager's pid");
        fs::write(dir.path().join(PID_FILE), format!("{me} {start}\n")).unwrap();
        let err = wait_for_copy(dir.path(), Duration::from_millis(30)).unwrap_err();
        assert!(err.to_string().contains("still being copied"), "{err}");
        fs::write(dir.path().join(PID_FILE), "garbage").unwrap();
        assert!(wait_for_copy(dir.path(), Duration::ZERO).is_err());
    }
}
