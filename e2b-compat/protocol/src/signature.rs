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
    let raw = match expiration {
        None => format!("{path}:{operation}:{username}:{token}"),
        Some(exp) => format!("{path}:{operation}:{username}:{token}:{exp}"),
    };
    let digest = Sha256::digest(raw.as_bytes());
    format!("v1_{}", base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest))
}

/// Constant-time comparison so a wrong signature leaks nothing through timing.
pub fn equal(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
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
    fn equal_compares_whole_strings() {
        assert!(equal("v1_abc", "v1_abc"));
        assert!(!equal("v1_abc", "v1_abd"));
        assert!(!equal("v1_abc", "v1_ab"));
    }
}
