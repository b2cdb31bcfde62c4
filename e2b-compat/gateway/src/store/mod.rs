//! Implementations of the model's [`crate::model::Store`].

mod sqlite;

pub use sqlite::SqliteStore;
