//! New identifiers and secrets: sandbox ids, access tokens, substrate
//! snapshot keys.

use rand::Rng;

/// Ids look like E2B's: 20 lowercase letters and digits.
pub fn new_id() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..20).map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char).collect()
}

/// A random (version 4) UUID: the SDK parses build ids and tag
/// assignment ids as UUIDs.
pub fn new_uuid() -> String {
    let mut bytes: [u8; 16] = rand::random();
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &hex[0..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..])
}

pub fn new_token() -> String {
    let bytes: [u8; 24] = rand::rng().random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Substrate snapshot keys: plain names every substrate accepts.
pub fn snapshot_key() -> String {
    format!("snap-{}", new_id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_e2b_shaped_and_distinct() {
        let a = new_id();
        assert_eq!(a.len(), 20);
        assert!(a.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit()));
        assert_ne!(a, new_id());
    }

    #[test]
    fn snapshot_keys_are_valid_substrate_names() {
        let key = snapshot_key();
        assert!(copse_substrate::template::validate_name(&key).is_ok(), "{key}");
    }
}
