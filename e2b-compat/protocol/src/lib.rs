//! `copse-protocol`: the envd wire protocol, shared by the agent (which
//! serves it) and everything that talks to an agent (the gateway, the
//! substrate conformance suite, the benchmark rigs), so none of those needs
//! to link the agent itself.
//!
//! Code map:
//! - [`envelope`]: the 5-byte Connect envelopes of streaming calls.
//! - [`json`]: tolerant decoding of protobuf-JSON fields (the JSON codec).
//! - [`signature`]: E2B's `v1_` signatures of pre-signed `/files` URLs.
//! - [`error`]: what can go wrong talking to an agent.
//! - [`headers`]: header names and the agent's port.
//! - [`kernels`]: where the code interpreter asks the agent for kernels.
//! - [`upgrade`]: splicing `Upgrade:` connections across one proxy hop.
//! - [`process`]: the client side of `process.Process/Start`: the request,
//!   the typed event stream, the collected output.
//! - [`client`]: a small client for one agent's unix socket (commands and
//!   file transfer).
//!
//! What is *not* here: the server side of the protocol (error responses,
//! stream writers, request message types) stays in the agent, which alone
//! serves it.

pub mod client;
pub mod envelope;
pub mod error;
pub mod headers;
pub mod json;
pub mod kernels;
pub mod process;
pub mod signature;
pub mod upgrade;

pub use client::AgentClient;
pub use error::Error;
pub use process::{Output, ProcessEvent, ProcessStream, StartProcess};
