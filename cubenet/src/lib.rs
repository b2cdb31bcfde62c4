//! cubenet: the network side of a sandbox.
//!
//! Platform-neutral, at the top: the egress [`Policy`] model, built from
//! E2B's inputs ([`policy`], its host names resolved by [`dns`]); the
//! network of one gateway ([`net`]: bridge, subnet, host interface names),
//! with what its sandboxes may reach of the host's own networks
//! ([`neighbourhood`]); and which address each sandbox gets
//! ([`addresses`]).
//!
//! One folder per backend, each a pure renderer of the policy (text and
//! command lines only, golden-tested on Linux) and an executor that
//! applies it on its own OS:
//! - [`linux`]: [`linux::nft`] renders one nftables table owned by copse;
//!   `linux::HostNetwork` applies it and plumbs the bridge and veths.
//! - [`freebsd`]: [`freebsd::pf`] renders one anchor per sandbox under a
//!   copse parent anchor and [`freebsd::vnet`] the epair/if_bridge
//!   plumbing; [`freebsd::jailnet`] decides what to run (tested here with a
//!   scripted runner) and, on FreeBSD, `freebsd::System` runs it.
//!
//! Nothing here knows the E2B wire format or the gateway.

pub mod addresses;
pub mod claim;
pub mod dns;
#[cfg(any(target_os = "linux", target_os = "freebsd"))]
pub mod dns_proxy;
pub mod dnsfilter;
pub mod egress;
pub mod freebsd;
pub mod linux;
pub mod neighbourhood;
pub mod net;
pub mod policy;
pub mod upstream;

#[cfg(any(target_os = "linux", target_os = "freebsd"))]
mod process;

#[cfg(test)]
mod golden;

pub use addresses::{AddressPool, SubnetFull};
pub use egress::ca::EgressCa;
pub use egress::intercept::Interceptor;
pub use egress::rules::{HeaderRules, HostRules, Rule, RuleError, SecretResolver};
pub use neighbourhood::Neighbourhood;
pub use net::{Attachment, NetConfig, SandboxNetwork};
pub use policy::{Policy, PolicyError, ResolvedPolicy, Target};
pub use upstream::{Upstream, UpstreamError, UpstreamTls};
