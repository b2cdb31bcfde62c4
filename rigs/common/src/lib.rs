//! Shared parts of copse's benchmark rigs (`rigs/*`): summary statistics and
//! `Server-Timing` parsing (pure, in `stats`), host and checkout facts, the
//! private gateway each rig starts, the lean HTTP client it times with, and
//! the result file every rig writes (`benchmarks/schema.md`).

pub mod catalogue;
pub mod client;
pub mod facts;
pub mod gateway;
pub mod report;
pub mod stats;

pub use client::{Conn, Created, LEAN_CLIENT, ms};
pub use gateway::{Binaries, Gateway};
pub use report::{RigArgs, Run, Scenario, SdkRun};
pub use stats::{Summary, parse_server_timing, round3};
