//! Implementations of the model's [`crate::model::Store`].

mod sqlite;
mod tokens;

pub use sqlite::SqliteStore;
pub use tokens::{AccessTokens, Indexed, SignedLink};
