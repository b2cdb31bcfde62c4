//! copse's benchmark rigs: one binary per rig (`src/bin/`, listed in
//! `rigs/README.md`), and this library with what they share and the pure
//! pieces of each rig, kept here so they are unit-tested.
//!
//! Shared by every rig:
//! - `stats`: summary statistics and `Server-Timing` parsing (pure).
//! - `facts`: host, checkout and binary facts for the result file.
//! - `gateway`: the private gateway each rig starts and stops.
//! - `client`: the lean HTTP/1.1 client the rigs time the gateway with.
//! - `api`: the E2B calls the lifecycle and cluster rigs make.
//! - `exec`: the first command of a new sandbox (`/bin/true` through the agent).
//! - `holder`: a process holding random bytes in its memory, and the digest
//!   that touches them all (the lifecycle and cluster rigs' memory scenarios).
//! - `report`: scenarios, targets and the result file (`benchmarks/schema.md`).
//! - `catalogue`: every rig with its task and clock definitions.
//!
//! One rig each:
//! - `anchors`: fork+exec, unshare, runc and podman, measured beside copse
//!   by `copse-rig-create`.
//! - `run_code`: requests, `/execute` decoding and the create → first result
//!   scenario (`copse-rig-run-code`; `copse-rig-template` reuses the scenario).
//! - `template`: the template the template rig builds, its context and
//!   the sandbox port host name (`copse-rig-template`).
//! - `density`: memory figures and batch sizing (`copse-rig-density`).
//! - `load`: hey's CSV (`copse-rig-load`).
//! - `net`: the whole Linux network rig (`copse-rig-net`), and the netns
//!   peer the egress rig shares.
//! - `egress_probe`: the egress rig's in-sandbox programs, routes, output
//!   parsing and targets; `egress`: the rest of it (`copse-rig-egress`,
//!   Linux only).
//! - `bhyve`: the bhyve rigs' clocks and refusal (`copse-rig-bhyve`).

pub mod api;
pub mod catalogue;
pub mod client;
pub mod exec;
pub mod facts;
pub mod gateway;
pub mod holder;
pub mod report;
pub mod stats;

pub mod anchors;
pub mod bhyve;
pub mod density;
#[cfg(target_os = "linux")]
pub mod egress;
pub mod egress_probe;
pub mod load;
#[cfg(target_os = "linux")]
pub mod net;
pub mod postgres;
pub mod run_code;
pub mod seaweedfs;
pub mod template;

pub use client::{Conn, Created, LEAN_CLIENT, ms};
pub use gateway::{Binaries, Gateway};
pub use report::{RigArgs, Run, Scenario, SdkRun};
pub use stats::{Summary, parse_server_timing, round3};
