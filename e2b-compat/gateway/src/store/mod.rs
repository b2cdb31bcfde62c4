//! Implementations of the model's [`crate::model::Store`].

mod sqlite;
mod tokens;
mod usage;

pub use sqlite::SqliteStore;
pub use tokens::{AccessTokens, Indexed, SignedLink};
pub use usage::{TeamUsage, Usage};
