//! The copse gateway: E2B's control plane over a host substrate, and the
//! data-plane switch to each sandbox's agent. See docs/ARCHITECTURE.md.
//!
//! Dependencies run one way: `api` → `service` → `model`; the service also
//! uses the substrate, `pool`, `network` and the agent helpers (`services`,
//! `agent_link`); `store` implements `model::Store`; `server` wires it all.

pub mod agent_link;
pub mod api;
pub mod cluster;
pub mod config;
pub mod fault;
pub mod images;
pub mod import_claims;
pub mod keys;
pub mod lazy_layers;
pub mod model;
pub mod network;
pub mod pool;
pub mod progress;
pub mod reaper;
pub mod sandbox_log;
pub mod serve;
pub mod server;
pub mod service;
pub mod services;
pub mod snapshot_file;
pub mod store;
pub mod telemetry;
pub mod templates;
pub mod tenancy;
pub mod tls;
pub mod vault;
pub mod volume_archive;
pub mod volume_files;
