//! nftables transactions run in this process through libnftables, the
//! library the `nft` program is a thin front of. Starting `nft` costs
//! ≈ 3.4 ms here before it does anything (loading it and its libraries);
//! the same transaction through the library takes tens of microseconds,
//! and every sandbox attach pays one (docs/lifecycle.md).
//!
//! The library is opened at run time (`libnftables.so.1`, installed with
//! the `nftables` package), so a host without it still works through the
//! program. A context's netlink socket stays in the network namespace of
//! the thread that made it; a caller in any other namespace (a thread that
//! entered a sandbox's) gets the program, started from its own thread, as
//! before, so no rule ever lands in a namespace it was not meant for.

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::os::unix::fs::MetadataExt;
use std::sync::{Mutex, OnceLock};

use anyhow::{Context, bail};
use libloading::Library;

type CtxNew = unsafe extern "C" fn(c_uint) -> *mut c_void;
type CtxBuffer = unsafe extern "C" fn(*mut c_void) -> c_int;
type RunFromBuffer = unsafe extern "C" fn(*mut c_void, *const c_char) -> c_int;
type GetBuffer = unsafe extern "C" fn(*mut c_void) -> *const c_char;

/// One context, for the whole process (contexts are not thread-safe).
pub struct LibNft {
    ctx: Mutex<Ctx>,
    run: RunFromBuffer,
    errors: GetBuffer,
    output: GetBuffer,
    /// The network namespace the context's socket lives in.
    netns: (u64, u64),
    /// Keeps the functions above loaded.
    _library: Library,
}

struct Ctx(*mut c_void);
// SAFETY: the context is only ever used under the mutex, by one thread at
// a time, which is all libnftables asks.
unsafe impl Send for Ctx {}

impl LibNft {
    /// The process's context, made on first use by the calling thread (so in
    /// its namespace); `None` when the library is missing or unusable.
    pub fn shared() -> Option<&'static LibNft> {
        static SHARED: OnceLock<Option<LibNft>> = OnceLock::new();
        SHARED
            .get_or_init(|| match Self::open() {
                Ok(lib) => Some(lib),
                Err(e) => {
                    tracing::info!("nftables rules go through the nft program: {e:#}");
                    None
                }
            })
            .as_ref()
    }

    fn open() -> anyhow::Result<Self> {
        let netns = thread_netns()?;
        // SAFETY: loading libnftables runs no code of ours; its initialisers
        // are the library's own.
        let library = unsafe { Library::new("libnftables.so.1") }.context("loading libnftables.so.1")?;
        // SAFETY: the types are libnftables' documented signatures
        // (nftables/libnftables.h), stable since its first release.
        let (new, buffer_output, buffer_error, run, errors, output) = unsafe {
            (
                *library.get::<CtxNew>(b"nft_ctx_new\0")?,
                *library.get::<CtxBuffer>(b"nft_ctx_buffer_output\0")?,
                *library.get::<CtxBuffer>(b"nft_ctx_buffer_error\0")?,
                *library.get::<RunFromBuffer>(b"nft_run_cmd_from_buffer\0")?,
                *library.get::<GetBuffer>(b"nft_ctx_get_error_buffer\0")?,
                *library.get::<GetBuffer>(b"nft_ctx_get_output_buffer\0")?,
            )
        };
        // SAFETY: NFT_CTX_DEFAULT (0); the context is never freed (it lives
        // as long as the process).
        let ctx = unsafe { new(0) };
        if ctx.is_null() {
            bail!("nft_ctx_new failed");
        }
        // SAFETY: a valid context; buffering keeps the library from writing
        // to this process's stdout and stderr.
        if unsafe { buffer_output(ctx) } != 0 || unsafe { buffer_error(ctx) } != 0 {
            bail!("libnftables could not buffer its output");
        }
        Ok(Self { ctx: Mutex::new(Ctx(ctx)), run, errors, output, netns, _library: library })
    }

    /// Whether the calling thread is in the namespace the context writes to.
    pub fn serves_this_thread(&self) -> bool {
        thread_netns().is_ok_and(|ns| ns == self.netns)
    }

    /// Runs `script` as one transaction, as `nft -f` does.
    pub fn apply(&self, script: &str) -> anyhow::Result<()> {
        let script = CString::new(script).context("an nft script with a NUL byte")?;
        let ctx = self.ctx.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: a valid context, held exclusively; a NUL-terminated script.
        let status = unsafe { (self.run)(ctx.0, script.as_ptr()) };
        // Reading a buffer empties it, so neither grows across calls.
        // SAFETY: as above; each buffer is valid until the next call on the
        // context, and is copied out before the lock is released.
        let errors = unsafe { text((self.errors)(ctx.0)) };
        // SAFETY: as above.
        let _ = unsafe { text((self.output)(ctx.0)) };
        if status != 0 {
            bail!("{}", errors.trim());
        }
        Ok(())
    }
}

/// # Safety
/// `p` is null or a NUL-terminated string that stays valid for the call.
unsafe fn text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the caller's promise.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The calling thread's network namespace, as (device, inode).
fn thread_netns() -> anyhow::Result<(u64, u64)> {
    let meta = std::fs::metadata("/proc/thread-self/ns/net").context("reading this thread's network namespace")?;
    Ok((meta.dev(), meta.ino()))
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;
    use crate::linux::tools::nft_apply;

    fn tables() -> String {
        let out = Command::new("nft").args(["list", "tables"]).output().expect("nft runs");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn root() -> bool {
        nix::unistd::geteuid().is_root()
    }

    #[test]
    fn a_transaction_applies_in_process_and_an_error_says_why() {
        if !root() {
            return;
        }
        let lib = LibNft::shared().expect("libnftables.so.1 comes with nftables");
        assert!(lib.serves_this_thread());
        let table = format!("copse_libnft_{}", std::process::id());
        lib.apply(&format!("add table inet {table}\nadd chain inet {table} probe\n")).unwrap();
        assert!(tables().contains(&table), "{}", tables());
        let err = lib.apply(&format!("add rule inet {table} probe nonsense here\n")).unwrap_err();
        assert!(format!("{err:#}").contains("Error"), "{err:#}");
        // A failed transaction leaves the context usable.
        lib.apply(&format!("delete table inet {table}\n")).unwrap();
        assert!(!tables().contains(&table));
    }

    #[test]
    fn a_thread_in_another_network_namespace_writes_only_there() {
        if !root() {
            return;
        }
        // The context exists first, made here, in the host's namespace.
        assert!(LibNft::shared().is_some_and(|lib| lib.serves_this_thread()));
        let table = format!("copse_libnft_elsewhere_{}", std::process::id());
        let inside = std::thread::spawn({
            let table = table.clone();
            move || {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("a new network namespace");
                assert!(!LibNft::shared().unwrap().serves_this_thread());
                nft_apply(&format!("add table inet {table}\n")).unwrap();
                // Run from this thread, so in its namespace.
                tables()
            }
        })
        .join()
        .unwrap();
        assert!(inside.contains(&table), "{inside}");
        assert!(!tables().contains(&table), "the host's namespace got a sandbox's table");
    }
}
