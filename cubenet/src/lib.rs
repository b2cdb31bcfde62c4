//! cubenet: the network side of a sandbox.
//!
//! One egress [`Policy`] model, built from E2B's inputs, and two pure
//! renderers of it: [`nft`] (Linux, one nftables table owned by copse) and
//! [`pf`] (FreeBSD, one anchor per sandbox under a copse root anchor, with
//! its epair/if_bridge plumbing plan). Renderers return text and command
//! plans only; the Linux executor in [`linux`] applies them. Nothing here
//! knows the E2B wire format or the gateway.

pub mod net;
pub mod nft;
pub mod pf;
pub mod policy;

#[cfg(target_os = "linux")]
pub mod linux;

pub use net::{AddressPool, Attachment, NetConfig, SandboxNetwork};
pub use policy::{Policy, PolicyError, ResolvedPolicy, Target};
