//! The FreeBSD substrate: each sandbox is a VNET jail rooted at a ZFS clone
//! of a template snapshot, limited by rctl, with the agent nullfs-mounted
//! read-only and started inside via `jail_attach`.
//!
//! Shape: [`plan`] computes every privileged action as data (pure, so it
//! compiles everywhere and its golden tests run on Linux, where no FreeBSD
//! host is available); `exec` applies it; `sys` wraps the jail system
//! calls; `substrate` (FreeBSD only, like `exec` and `sys`) observes the
//! host and sequences the two. What runs inside the jail is
//! `copse_jailer`'s.

/// Only the FreeBSD executor uses all of it; elsewhere it is here for its
/// golden tests.
#[cfg_attr(not(target_os = "freebsd"), allow(dead_code))]
pub mod plan;
/// `zfs send | zfs recv`, export and import: plain processes, tested for
/// real on any Unix. Public so the bhyve backend pipes them the same way.
pub mod streams;

#[cfg(target_os = "freebsd")]
mod exec;
#[cfg(target_os = "freebsd")]
mod substrate;
#[cfg(target_os = "freebsd")]
mod sys;

#[cfg(target_os = "freebsd")]
pub use substrate::JailSubstrate;
