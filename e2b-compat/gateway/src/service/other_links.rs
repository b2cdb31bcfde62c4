//! Signed `/files` links of sandboxes on other nodes. A link names no
//! sandbox, and the gateway's own index (`store::AccessTokens`) holds only
//! this node's sandboxes' tokens, so a link sent to the gateway of another
//! node than its sandbox's would find no signer. This node therefore also
//! keeps the other nodes' sandboxes' tokens, read from the shared database
//! when a link finds no signer in either index. Reads are at least
//! [`REREAD_AFTER`] apart: a link made a moment ago on a sandbox just
//! created elsewhere is found, and a flood of bogus links costs the
//! database a few reads a second at most.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::Sandboxes;
use crate::store::{AccessTokens, SignedLink};

const REREAD_AFTER: Duration = Duration::from_millis(250);

/// The other nodes' sandboxes' tokens, as last read.
#[derive(Default)]
pub struct OtherTokens {
    tokens: AccessTokens,
    read_at: Mutex<Option<Instant>>,
}

impl Sandboxes {
    /// The sandbox on another node whose token signed `link`, if any.
    pub fn signer_elsewhere(&self, link: &SignedLink) -> Option<String> {
        let others = &self.node.as_ref()?.other_tokens;
        if !copse_protocol::signature::well_formed(link.signature) {
            return None;
        }
        if let Some(id) = others.tokens.signer_of(link) {
            return Some(id);
        }
        match self.reread_other_tokens(others) {
            Ok(true) => others.tokens.signer_of(link),
            Ok(false) => None,
            Err(e) => {
                tracing::warn!("reading other nodes' sandbox tokens: {e:#}");
                None
            }
        }
    }

    /// Reads the other nodes' tokens again unless that was done less than
    /// [`REREAD_AFTER`] ago; whether it was. Concurrent misses wait for
    /// one read rather than each making their own.
    fn reread_other_tokens(&self, others: &OtherTokens) -> anyhow::Result<bool> {
        let mut read_at = others.read_at.lock().unwrap_or_else(|p| p.into_inner());
        if read_at.is_some_and(|at| at.elapsed() < REREAD_AFTER) {
            return Ok(false);
        }
        *read_at = Some(Instant::now());
        let tokens: HashMap<String, String> = self
            .store
            .all()?
            .into_iter()
            .filter(|r| !self.holds(r.node.as_deref()))
            .map(|r| (r.id, r.access_token))
            .collect();
        others.tokens.replace(tokens);
        Ok(true)
    }
}
