//! `filesystem.Filesystem`: entry descriptions, the operations behind the
//! RPCs, directory watching and file metadata, all done as the requesting
//! user (`as_user`), and the regular-files-only opening `/files` streams.

pub mod as_user;
pub mod entry;
pub mod open;
pub mod ops;
pub mod watch;
pub mod xattr;
