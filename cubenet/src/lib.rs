//! cubenet: the network side of a sandbox.
//!
//! One egress [`Policy`] model, built from E2B's inputs, and two pure
//! renderers of it: [`nft`] (Linux, one nftables table owned by copse) and
//! [`pf`] + [`vnet`] (FreeBSD, one anchor per sandbox under a copse parent
//! anchor, and the epair/if_bridge plumbing). Renderers return text and
//! command lines only. The Linux executor in `linux` applies `nft`; on
//! FreeBSD, [`jailnet`] decides what to run and `freebsd` runs it. Nothing
//! here knows the E2B wire format or the gateway.

pub mod dns;
pub mod jailnet;
pub mod net;
pub mod nft;
pub mod pf;
pub mod policy;
pub mod vnet;

#[cfg(any(target_os = "linux", target_os = "freebsd"))]
mod process;

#[cfg(target_os = "linux")]
mod janitor;
#[cfg(target_os = "linux")]
pub mod linux;
#[cfg(target_os = "linux")]
mod netlink;

#[cfg(target_os = "freebsd")]
pub mod freebsd;

pub use net::{AddressPool, Attachment, NetConfig, SandboxNetwork};
pub use policy::{Policy, PolicyError, ResolvedPolicy, Target};
