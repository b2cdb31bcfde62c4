//! What the host side of a boot and the sandbox side must agree on:
//! descriptor numbers and where things are mounted inside a sandbox.
//!
//! The backends (which start sandboxes) and this crate's boot code (which
//! runs in them) both import these; keeping them here, below both, is what
//! lets the agent link the boot code without linking a backend. Not behind
//! a platform `cfg`: the FreeBSD backend's plans are golden-tested on Linux.

/// Linux: where the host's agent directory is mounted (read-only) in a
/// sandbox.
pub const AGENT_MOUNT: &str = ".copse/bin";
/// Linux: where the sandbox's own socket directory is mounted in a sandbox.
pub const SOCKET_MOUNT: &str = ".copse/run";
/// Linux: the agent binary's and socket's names inside those directories.
pub const AGENT_NAME: &str = "copse-agent";
pub const SOCKET_NAME: &str = "agent.sock";

/// FreeBSD: the descriptor on which the agent finds its listening socket
/// when the backend starts it inside the jail.
pub const AGENT_SOCKET_FD: i32 = 3;
