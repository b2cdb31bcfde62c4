//! Failures a substrate reports with a kind the gateway can act on; every
//! other failure stays an `anyhow::Error` and is a fault of the host.

/// A substrate failure of a known kind, carried inside `anyhow::Error`
/// (find it with [`SubstrateError::find`]).
#[derive(Debug, thiserror::Error)]
pub enum SubstrateError {
    /// This host lacks a program or kernel feature the operation needs; the
    /// message says which and how to install it. Nothing was changed.
    #[error("{0}")]
    Unavailable(String),
}

impl SubstrateError {
    /// The first `SubstrateError` in `err`'s chain of causes.
    pub fn find(err: &anyhow::Error) -> Option<&SubstrateError> {
        err.chain().find_map(|cause| cause.downcast_ref::<SubstrateError>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn found_under_added_context() {
        let err =
            Err::<(), _>(SubstrateError::Unavailable("no CRIU".into())).context("restoring sandbox a").unwrap_err();
        assert!(matches!(SubstrateError::find(&err), Some(SubstrateError::Unavailable(m)) if m == "no CRIU"));
        assert!(SubstrateError::find(&anyhow::anyhow!("plain")).is_none());
    }
}
