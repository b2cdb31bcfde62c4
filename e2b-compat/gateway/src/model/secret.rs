//! A secret as the API knows it: a name, metadata, and its versions'
//! values, each sealed by the vault (`crate::vault`). Nothing here ever
//! holds a value in the clear.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::team::default_team;

/// Older versions' sealed values kept beside the current one, so a record
/// updated in a loop does not grow without bound. Version numbers keep
/// counting past it.
pub const KEPT_VERSIONS: usize = 10;
/// A value larger than this is refused (API keys, certificates and tokens
/// fit many times over).
pub const MAX_VALUE_BYTES: usize = 64 * 1024;
const MAX_NAME_BYTES: usize = 256;
const MAX_METADATA_ENTRIES: usize = 64;
const MAX_METADATA_BYTES: usize = 1024;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SecretRecord {
    pub id: String,
    /// Names are unique within a team; other teams never see the record.
    #[serde(default = "default_team")]
    pub team: String,
    pub name: String,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// The newest first; `versions[0].version` is the current version.
    pub versions: Vec<SealedVersion>,
}

impl SecretRecord {
    pub fn current_version(&self) -> u32 {
        self.versions.first().map_or(0, |v| v.version)
    }

    /// Makes `value` the current version, dropping the oldest kept one
    /// past [`KEPT_VERSIONS`].
    pub fn push_version(&mut self, value: SealedValue, now_ms: i64) {
        let version = self.current_version() + 1;
        self.versions.insert(0, SealedVersion { version, value });
        self.versions.truncate(KEPT_VERSIONS);
        self.updated_at_ms = now_ms;
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SealedVersion {
    pub version: u32,
    pub value: SealedValue,
}

/// A value as the vault sealed it: which key, the nonce, and ciphertext
/// with its tag (both base64).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SealedValue {
    pub key_id: String,
    pub nonce: String,
    pub ciphertext: String,
}

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("secret {0} not found")]
    NotFound(String),
    #[error("a secret named {0:?} already exists")]
    NameTaken(String),
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

/// The SDK refuses the same characters before sending: a name is spliced
/// into `${e2b.secrets.<name>}` placeholders, so braces and control
/// characters would make one ambiguous.
pub fn validate_secret_name(name: &str) -> Result<(), SecretError> {
    let usable = !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && !name.chars().any(|c| c == '{' || c == '}' || c.is_control());
    if usable {
        Ok(())
    } else {
        Err(SecretError::Invalid(format!(
            "invalid secret name {name:?}: 1 to {MAX_NAME_BYTES} bytes, no braces or control characters"
        )))
    }
}

pub fn validate_secret_value(value: &str) -> Result<(), SecretError> {
    if value.is_empty() || value.len() > MAX_VALUE_BYTES {
        return Err(SecretError::Invalid(format!("a secret value must be 1 to {MAX_VALUE_BYTES} bytes")));
    }
    Ok(())
}

pub fn validate_secret_metadata(metadata: &BTreeMap<String, String>) -> Result<(), SecretError> {
    let too_big = metadata.len() > MAX_METADATA_ENTRIES
        || metadata.iter().any(|(k, v)| k.is_empty() || k.len() > MAX_NAME_BYTES || v.len() > MAX_METADATA_BYTES);
    if too_big {
        return Err(SecretError::Invalid(format!(
            "secret metadata: at most {MAX_METADATA_ENTRIES} entries, keys 1 to {MAX_NAME_BYTES} bytes, \
             values at most {MAX_METADATA_BYTES}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sealed(n: u8) -> SealedValue {
        SealedValue { key_id: "k".into(), nonce: n.to_string(), ciphertext: String::new() }
    }

    #[test]
    fn versions_count_on_while_only_the_newest_are_kept() {
        let mut record = SecretRecord {
            id: "s".into(),
            team: "t".into(),
            name: "n".into(),
            metadata: BTreeMap::new(),
            created_at_ms: 0,
            updated_at_ms: 0,
            versions: Vec::new(),
        };
        for n in 0..25 {
            record.push_version(sealed(n), i64::from(n));
        }
        assert_eq!(record.current_version(), 25);
        assert_eq!(record.versions.len(), KEPT_VERSIONS);
        assert_eq!(record.versions[0].value, sealed(24));
        assert_eq!(record.versions.last().unwrap().version, 16);
        assert_eq!(record.updated_at_ms, 24);
    }

    #[test]
    fn names_that_would_break_a_placeholder_are_refused() {
        assert!(validate_secret_name("openai-api-key").is_ok());
        assert!(validate_secret_name("team/prod.key").is_ok());
        for bad in ["", "a{b", "a}b", "line\nbreak", "tab\t", &"x".repeat(257)] {
            assert!(validate_secret_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn values_and_metadata_are_bounded() {
        assert!(validate_secret_value("v").is_ok());
        assert!(validate_secret_value("").is_err());
        assert!(validate_secret_value(&"v".repeat(MAX_VALUE_BYTES + 1)).is_err());
        let many: BTreeMap<_, _> = (0..65).map(|i| (i.to_string(), String::new())).collect();
        assert!(validate_secret_metadata(&many).is_err());
        assert!(validate_secret_metadata(&BTreeMap::from([("env".into(), "prod".into())])).is_ok());
    }
}
