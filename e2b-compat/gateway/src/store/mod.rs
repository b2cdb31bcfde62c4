//! Implementations of the model's [`crate::model::Store`].

#[cfg(test)]
mod behaviour;
mod claims;
mod postgres;
pub mod sealing;
mod sqlite;
mod table;
#[cfg(test)]
mod test_postgres;
mod tokens;
mod usage;

pub use postgres::PostgresStore;
pub use sqlite::SqliteStore;
pub use tokens::{AccessTokens, Indexed, SignedLink};
pub use usage::Usage;

use crate::model::{NodeStore, SecretStore, Store, VolumeStore};

/// Every kind of record in one database, whichever holds them: what
/// `server::open_store` hands out, each part then given to the service
/// that needs it.
pub trait Database: Store + SecretStore + VolumeStore + NodeStore {}

impl<T: Store + SecretStore + VolumeStore + NodeStore> Database for T {}
