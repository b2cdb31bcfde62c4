//! Failures a substrate reports with a kind the gateway can act on (and
//! map to a status the client understands); every other failure stays a
//! plain `anyhow::Error` and is a fault of the host.

/// A substrate failure of a known kind, carried inside `anyhow::Error` so
/// trait methods keep returning `anyhow::Result` (find it with
/// [`SubstrateError::find`]). The message is the whole explanation; the
/// variant only says whose fault it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubstrateError {
    /// The sandbox, snapshot or template named does not exist here.
    #[error("{0}")]
    NotFound(String),
    /// This kind of sandbox does not offer the operation at all (a jail
    /// cannot keep memory; a host without bhyve has no bhyve templates).
    #[error("{0}")]
    Unsupported(String),
    /// The request itself is malformed: a name or id the substrate cannot
    /// use, a snapshot of another template, a stream that is not a snapshot.
    #[error("{0}")]
    Invalid(String),
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

    #[test]
    fn keeps_its_message_through_question_mark() {
        let refuse = || -> anyhow::Result<()> { Err(SubstrateError::NotFound("snapshot s not found".into()))? };
        let err = refuse().unwrap_err();
        assert_eq!(err.to_string(), "snapshot s not found");
        assert_eq!(SubstrateError::find(&err), Some(&SubstrateError::NotFound("snapshot s not found".into())));
    }
}
