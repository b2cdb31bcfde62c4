//! A running sandbox's egress policy: replaced on request (E2B's
//! `update_network`), and re-applied when the host names it allows may
//! have moved.

use copse_substrate::Policy;

use super::Sandboxes;
use crate::model::{Caller, Result, SandboxRecord};
use crate::network::NetworkRequest;

impl Sandboxes {
    /// Replaces the sandbox's egress policy (E2B's `update_network`). A
    /// sandbox paused without memory gets it when it resumes.
    pub async fn update_network(&self, caller: &Caller, id: &str, request: NetworkRequest) -> Result<SandboxRecord> {
        let policy = request.policy()?;
        self.addresses.check_upstream(&policy)?;
        let mut record = self.get(caller, id)?;
        let attached = !record.has_no_processes();
        // Without a network the sandbox has no egress at all, which every
        // policy admits; the policy is kept for when it is asked about.
        if let Some(network) = record.network.as_mut() {
            if attached {
                self.apply_policy(id, &policy).await?;
            }
            network.policy = policy.clone();
        }
        record.allow_internet_access = policy.internet_access();
        self.store.put(&record)?;
        Ok(record)
    }

    pub(super) async fn apply_policy(&self, id: &str, policy: &Policy) -> Result<()> {
        let (owned, policy) = (id.to_string(), policy.clone());
        self.blocking(move |s| s.update_network(&owned, &policy)).await
    }

    /// Re-applies policies that name hosts, so their addresses follow DNS.
    pub async fn refresh_host_names(&self) -> anyhow::Result<()> {
        for record in self.store.all()?.into_iter().filter(|r| !r.has_no_processes()) {
            if let Some(network) = record.network.as_ref().filter(|n| n.policy.has_hosts())
                && let Err(e) = self.apply_policy(&record.id, &network.policy).await
            {
                tracing::warn!("refreshing the host names of {}: {e:#}", record.id);
            }
        }
        Ok(())
    }
}
