//! OCI images as template roots.
//!
//! [`pull`] fetches an image (through the operator's mirrors, with
//! registry credentials), checking every blob against its digest and
//! keeping it in a [`cache::BlobCache`]; [`unpack::apply_layer_file`]
//! applies its layers in order beneath a root directory, never following
//! what the image's paths and links say onto the host; [`prepare`] adds
//! what copse's sandboxes need (the `user` account, real mount points).
//! [`from_image`] is all three, for a template builder.
//!
//! It is a crate of its own, not a gateway module: the OCI client brings
//! an HTTP stack of its own (reqwest), and the unpacker is security code
//! with unit tests that should build and run without the gateway. It has
//! no platform code: the `*at` calls it uses exist on Linux and FreeBSD
//! (not run on FreeBSD).

pub mod cache;
pub mod prepare;
pub mod pull;
pub mod registries;
pub mod unpack;

use std::path::{Path, PathBuf};

pub use cache::BlobCache;
pub use prepare::prepare;
pub use pull::{ImageConfig, ImageRef, Pulled, parse_reference, pull};
pub use registries::{Credential, Registries};

/// A line of progress for a person watching.
pub type Progress<'a> = &'a (dyn Fn(&str) + Send + Sync);

/// Applies a pulled image's layers, bottom first, to the empty directory
/// `root`, then prepares it for sandboxes.
pub fn unpack_image(pulled: &Pulled, root: &Path, progress: Progress<'_>) -> anyhow::Result<unpack::Applied> {
    unpack_layers(&pulled.layers, root, progress)
}

/// Applies layer blobs, bottom first, to the empty directory `root`, then
/// prepares it for sandboxes: [`unpack_image`] for blobs that did not come
/// from a pull (a cluster node's object store, checked into the cache by
/// [`BlobCache::insert`]).
pub fn unpack_layers(layers: &[PathBuf], root: &Path, progress: Progress<'_>) -> anyhow::Result<unpack::Applied> {
    let mut total = unpack::Applied::default();
    let count = layers.len();
    for (i, layer) in layers.iter().enumerate() {
        let done = unpack::apply_layer_file(root, layer)
            .map_err(|e| e.context(format!("layer {} of {count} ({})", i + 1, layer.display())))?;
        progress(&format!("[{}/{count}] unpacked {} entries, {} whiteouts", i + 1, done.entries, done.whiteouts));
        total.entries += done.entries;
        total.whiteouts += done.whiteouts;
        total.devices_skipped += done.devices_skipped;
    }
    if total.devices_skipped > 0 {
        progress(&format!("skipped {} device node(s): a sandbox's /dev is its own", total.devices_skipped));
    }
    let prepared = prepare(root)?;
    if prepared.added_user {
        progress(&format!(
            "added the sandbox account {} (uid {}, shell {})",
            prepare::USER,
            prepare::UID,
            prepared.shell
        ));
    }
    Ok(total)
}

/// Pulls `reference` into `cache_dir` and unpacks it into `root`: what a
/// template build starting from an image calls.
pub async fn from_image(
    reference: &str,
    registries: &Registries,
    cache_dir: &Path,
    root: &Path,
    progress: Progress<'_>,
) -> anyhow::Result<Pulled> {
    let cache = BlobCache::open(cache_dir)?;
    let pulled = pull(reference, registries, &cache, progress).await?;
    std::fs::create_dir_all(root)?;
    unpack_image(&pulled, root, progress)?;
    Ok(pulled)
}
