//! Many tenants on one gateway: which team a request's key acts for
//! (`directory.rs`), and how fast each key may send requests (`rate.rs`).
//! What a team may hold is checked by the service (`service/quota.rs`)
//! against the limits the directory keeps.

pub mod accounts;
mod directory;
mod rate;

pub use directory::{Directory, Principal};
pub use rate::RateLimiter;
