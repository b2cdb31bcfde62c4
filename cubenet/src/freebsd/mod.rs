//! The FreeBSD backend: pf rules ([`pf`]) and epair/if_bridge plumbing
//! ([`vnet`]) as plans of [`cmd::Cmd`]s, and the executor logic that runs
//! them through a [`jailnet::Runner`]. All of it compiles and is tested on
//! Linux with a scripted runner; only the runner that spawns the real tools
//! (`System`, with `HostNetwork` and `open`) is FreeBSD only, and has
//! **never run on a FreeBSD host**.

pub mod cmd;
pub mod jailnet;
pub mod natlook;
pub mod pf;
pub mod vnet;

#[cfg(target_os = "freebsd")]
mod system;

#[cfg(target_os = "freebsd")]
pub use system::{HostNetwork, System, open};
