//! bhyve microVMs restored from checkpoints, kept in warm pools.
//!
//! [`substrate::BhyveSubstrate`] serves bhyve templates behind
//! `copse_substrate::Substrate`, sequencing the pure parts over a [`host::Host`].
//!
//! Everything here except [`exec`] is plain data and pure functions: the
//! command lines a pool needs ([`command`]), the checkpoint metadata bhyve
//! writes ([`checkpoint`]), the pool state machine ([`pool`]) and the
//! identity reset a restored guest gets ([`identity`]), and the host
//! commands behind each pool action ([`plan`]). They are
//! golden-tested on Linux. Only [`exec`], which runs the plans, is
//! FreeBSD-only, and none of it has been run on FreeBSD.

pub mod archive;
pub mod checkpoint;
pub mod command;
pub mod host;
pub mod identity;
pub mod plan;
pub mod pool;
pub mod relay;
pub mod substrate;

#[cfg(target_os = "freebsd")]
pub mod exec;
