//! E2B's `v1_` signatures for pre-signed `/files` URLs
//! (`e2b/sandbox/signature.py`, envd `api/auth.go`):
//! `"v1_" + base64_nopad(sha256("path:operation:username:token[:expiration]"))`.
//! The username is empty when the URL targets the default user.

use base64::Engine;
use sha2::{Digest, Sha256};

/// The signature the SDK computes for `path` and `operation` ("read" or
/// "write") as `username` ("" for the default user), with `token` the
/// sandbox's envd access token.
pub fn sign(path: &str, operation: &str, username: &str, token: &str, expiration: Option<u64>) -> String {
    Signer::new(path, operation, username).sign(token, expiration)
}

/// One link's signature under many tokens (whoever holds a link with no
/// sandbox in it tries each sandbox's): what precedes the token, of any
/// length the caller chose, is hashed once.
#[derive(Clone)]
pub struct Signer(Sha256);

impl Signer {
    pub fn new(path: &str, operation: &str, username: &str) -> Self {
        let mut hasher = Sha256::new();
        for part in [path, ":", operation, ":", username, ":"] {
            hasher.update(part.as_bytes());
        }
        Self(hasher)
    }

    pub fn sign(&self, token: &str, expiration: Option<u64>) -> String {
        let mut hasher = self.0.clone();
        hasher.update(token.as_bytes());
        if let Some(exp) = expiration {
            hasher.update(format!(":{exp}").as_bytes());
        }
        format!("v1_{}", base64::engine::general_purpose::STANDARD_NO_PAD.encode(hasher.finalize()))
    }
}

/// Whether `signature` has the shape of one [`sign`] makes, so a malformed
/// one is refused before any hashing.
pub fn well_formed(signature: &str) -> bool {
    signature
        .strip_prefix("v1_")
        .is_some_and(|b64| b64.len() == 43 && b64.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/'))
}

/// Constant-time comparison so a wrong signature leaks nothing through timing.
pub fn equal(a: &str, b: &str) -> bool {
    equal_bytes(a.as_bytes(), b.as_bytes())
}

/// [`equal`] for bytes: every byte is looked at whatever the first difference.
pub fn equal_bytes(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    // Vectors from e2b 2.63.0's own function:
    // get_signature("/home/user/a.txt", "read", None, "tok123")
    // get_signature("/home/user/a.txt", "write", "user", "tok123", 1000)
    //   with time.time() pinned to 1699999000.
    #[test]
    fn matches_the_python_sdk() {
        assert_eq!(
            sign("/home/user/a.txt", "read", "", "tok123", None),
            "v1_byj2OB/vujgbES/1KAKCaR27E+9eOrB6PzeTnIL8L6M"
        );
        assert_eq!(
            sign("/home/user/a.txt", "write", "user", "tok123", Some(1_700_000_000)),
            "v1_kCwu4usVZBCSzXHSFPk291ud3zHmpwR9v0nRPaSmYqM"
        );
    }

    #[test]
    fn one_signer_signs_for_many_tokens_as_sign_does() {
        let signer = Signer::new("/home/user/a.txt", "write", "user");
        for (token, exp) in [("tok123", Some(1_700_000_000)), ("other", None), ("", Some(0))] {
            assert_eq!(signer.sign(token, exp), sign("/home/user/a.txt", "write", "user", token, exp));
        }
    }

    #[test]
    fn signatures_are_well_formed_and_garbage_is_not() {
        assert!(well_formed(&sign("/a", "read", "", "t", None)));
        assert!(!well_formed("v1_short"));
        assert!(!well_formed(&format!("v2_{}", &sign("/a", "read", "", "t", None)[3..])));
        assert!(!well_formed(&format!("v1_{}a", "é".repeat(21))));
    }

    #[test]
    fn equal_compares_whole_strings() {
        assert!(equal("v1_abc", "v1_abc"));
        assert!(!equal("v1_abc", "v1_abd"));
        assert!(!equal("v1_abc", "v1_ab"));
    }
}
