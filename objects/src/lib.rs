//! Object storage for copse: where a node puts what another node may need
//! (snapshots and paused sandboxes' files; templates' layers would be the
//! same kind of stream), through the S3 API of a real object store.
//!
//! A stream is stored as content-defined chunks named by their SHA-256
//! (`chunks/<hex>`), so every stream that shares bytes with one already
//! uploaded (two snapshots of one sandbox, two sandboxes of one template)
//! sends only the chunks the bucket lacks; and a manifest, written last,
//! lists them in order. A chunk is stored LZ4-compressed
//! (`chunks/<hex>.lz4`) when that makes it smaller. A reader trusts
//! neither: every chunk is decompressed no further than its listed length
//! and hashed again before a byte of it is passed on, and a stream that
//! ends early, or has a chunk that does not match its name, is an error to
//! the reader, never a short stream. A stream can also be read in place,
//! each range fetched on its first read ([`LazyFile`]): a filesystem image
//! mounted before all of it has arrived.

mod bucket;
mod chunks;
mod gc;
mod lazy;
mod manifest;
mod stream;

pub use bucket::{Bucket, BucketConfig, Stored};
pub use chunks::{PullReport, PushReport, ReaderStopped, manifest, pull, push, verified_manifest};
pub use gc::{DEFAULT_MIN_AGE, GcReport, REWRITE_AFTER, collect_garbage};
pub use lazy::LazyFile;
pub use manifest::{ChunkRef, Codec, Manifest};
pub use stream::{StreamReader, StreamSender, stream};
