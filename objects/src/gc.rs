//! Removing the chunks no manifest names any more (a deleted snapshot's, a
//! resumed sandbox's), without a lock between the collector and the nodes
//! that push meanwhile.
//!
//! The danger is a push that finds a chunk already stored, skips it, and
//! writes a manifest naming it after the collector decided nobody did. Two
//! rules close that window, as long as no push takes longer than
//! [`DEFAULT_MIN_AGE`] − [`REWRITE_AFTER`] (12 hours):
//! - a push skips only chunks written less than [`REWRITE_AFTER`] ago, and
//!   writes an older one again, which makes it young;
//! - the collector lists the bucket once, *then* reads the manifests, and
//!   removes only chunks last written more than the minimum age before
//!   that listing.
//!
//! A chunk a running push skipped was young at the push's start, so it is
//! removed only by a collection listed at least `min age − REWRITE_AFTER`
//! later, by when the push has written its manifest, which that collection
//! lists and reads.

use std::collections::HashSet;
use std::time::Duration;

use crate::bucket::{Bucket, Stored, now_ms};
use crate::manifest::Manifest;

/// How old a stored chunk may be before a push writes it again instead of
/// trusting it is there.
pub const REWRITE_AFTER: Duration = Duration::from_secs(12 * 3600);
/// How old an unnamed chunk must be before a collection removes it.
pub const DEFAULT_MIN_AGE: Duration = Duration::from_secs(24 * 3600);

const CHUNKS: &str = "chunks/";
// The window a push has to write its manifest (module doc).
const _: () = assert!(DEFAULT_MIN_AGE.as_secs() >= 2 * REWRITE_AFTER.as_secs());

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct GcReport {
    /// Manifests read, and the chunks they name.
    pub manifests: usize,
    pub named_chunks: usize,
    /// Objects outside `chunks/` that are not manifests (they name nothing).
    pub not_manifests: Vec<String>,
    /// Chunks stored, and those no manifest names but too young to go.
    pub chunks: usize,
    pub young_unnamed: usize,
    /// Chunks removed (or, in a dry run, that would be).
    pub removed: usize,
    pub removed_bytes: u64,
}

/// Removes from `bucket` the chunks no manifest names that were last
/// written more than `min_age` before the collection started; `dry_run`
/// only counts them.
pub async fn collect_garbage(bucket: &Bucket, min_age: Duration, dry_run: bool) -> anyhow::Result<GcReport> {
    let started_ms = now_ms();
    // The listing before any manifest is read: see the module's doc.
    let (chunks, others): (Vec<Stored>, Vec<Stored>) =
        bucket.list().await?.into_iter().partition(|o| o.key.starts_with(CHUNKS));
    let mut report = GcReport { chunks: chunks.len(), ..GcReport::default() };
    let mut named = HashSet::new();
    for object in others {
        // One removed since the listing names nothing.
        let Some(bytes) = bucket.get(&object.key).await? else { continue };
        match Manifest::parse(&bytes) {
            Ok(manifest) => {
                report.manifests += 1;
                named.extend(manifest.chunks.iter().map(|c| c.key()));
            }
            Err(_) => report.not_manifests.push(object.key),
        }
    }
    report.named_chunks = named.len();
    let (doomed, young) = doomed(&chunks, &named, started_ms - min_age.as_millis() as i64);
    report.young_unnamed = young;
    for chunk in doomed {
        if !dry_run {
            bucket.delete(&chunk.key).await?;
        }
        report.removed += 1;
        report.removed_bytes += chunk.size;
    }
    Ok(report)
}

/// The chunks no manifest names that were last written before
/// `before_ms`, and how many unnamed ones are younger.
fn doomed<'a>(chunks: &'a [Stored], named: &HashSet<String>, before_ms: i64) -> (Vec<&'a Stored>, usize) {
    let unnamed = chunks.iter().filter(|c| is_chunk_key(&c.key) && !named.contains(&c.key));
    let (old, young): (Vec<&Stored>, Vec<&Stored>) = unnamed.partition(|c| c.modified_ms < before_ms);
    (old, young.len())
}

/// Only what a push names `chunks/<sha256 hex>` (`.lz4` when compressed)
/// is a chunk to collect; anything else someone put there is left alone.
fn is_chunk_key(key: &str) -> bool {
    key.strip_prefix(CHUNKS)
        .map(|name| name.strip_suffix(".lz4").unwrap_or(name))
        .is_some_and(|hash| hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::{Stored, doomed, is_chunk_key};

    fn chunk(c: char, modified_ms: i64) -> Stored {
        Stored { key: format!("chunks/{}", c.to_string().repeat(64)), size: 10, modified_ms }
    }

    #[test]
    fn only_old_chunks_no_manifest_names_are_taken() {
        let (named_old, unnamed_old, unnamed_young) = (chunk('a', 10), chunk('b', 10), chunk('c', 500));
        let junk = Stored { key: "chunks/not-a-hash".into(), size: 1, modified_ms: 0 };
        let chunks = [named_old.clone(), unnamed_old.clone(), unnamed_young, junk];
        let named: HashSet<String> = [named_old.key].into();
        let (taken, young) = doomed(&chunks, &named, 100);
        assert_eq!(taken, [&unnamed_old]);
        assert_eq!(young, 1);
    }

    #[test]
    fn only_a_pushs_own_chunk_names_are_collected() {
        assert!(is_chunk_key(&format!("chunks/{}", "ab".repeat(32))));
        assert!(is_chunk_key(&format!("chunks/{}.lz4", "ab".repeat(32))));
        for key in [
            format!("chunks/{}", "AB".repeat(32)),
            format!("chunks/{}", "ab".repeat(31)),
            format!("chunks/{}/x", "ab".repeat(32)),
            format!("chunks/{}.lz4.lz4", "ab".repeat(32)),
            format!("chunks/{}.gz", "ab".repeat(32)),
            format!("snapshots/{}", "ab".repeat(32)),
            "chunks/../snapshots/default/x".to_string(),
        ] {
            assert!(!is_chunk_key(&key), "{key}");
        }
    }
}
