//! The copse gateway: E2B's control plane over a host substrate, and the
//! data-plane switch to each sandbox's agent. See docs/ARCHITECTURE.md.

pub mod agent_link;
pub mod api;
pub mod config;
pub mod lifecycle;
pub mod pool;
pub mod progress;
pub mod sandboxes;
pub mod server;
pub mod services;
pub mod snapshot_file;
pub mod store;
pub mod templates;
