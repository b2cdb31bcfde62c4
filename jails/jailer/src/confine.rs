//! Confinement of the processes users run inside a sandbox.
//!
//! The agent keeps its privileges (it must switch users and manage
//! processes); everything it starts for a user is confined here, between
//! `fork` and `exec`. [`Confinement::new`] does all allocation up front so
//! that [`Confinement::apply`] only issues system calls and is safe to call
//! from a `pre_exec` hook.

#[cfg(target_os = "linux")]
pub use crate::linux::confine::Confinement;

#[cfg(target_os = "freebsd")]
pub use crate::freebsd::confine::Confinement;
