//! `filesystem.Filesystem`: entry descriptions, the operations behind the
//! RPCs, directory watching and file metadata.

pub mod entry;
pub mod ops;
pub mod watch;
pub mod xattr;
