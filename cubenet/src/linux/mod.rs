//! The Linux backend: the nftables rules of a network ([`nft`], pure, so
//! compiled and golden-tested everywhere) and, on Linux only, the executor
//! that applies them and plumbs the bridge and one veth per sandbox
//! (`HostNetwork`), with its background detaches (`janitor`), its
//! rtnetlink requests (`netlink`), its nftables transactions in-process
//! (`libnft`) and the tools it spawns (`tools`).

pub mod nft;

#[cfg(target_os = "linux")]
mod host_network;
#[cfg(target_os = "linux")]
mod janitor;
#[cfg(target_os = "linux")]
mod libnft;
#[cfg(target_os = "linux")]
mod netlink;
#[cfg(target_os = "linux")]
mod tools;

#[cfg(target_os = "linux")]
pub use host_network::HostNetwork;
