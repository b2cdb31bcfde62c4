//! A running sandbox's egress policy: replaced on request (E2B's
//! `update_network`), and re-applied when the host names it allows may
//! have moved. A sandbox with `network.rules` trusts the copse egress CA
//! (the proxy terminates its HTTPS to rule hosts): its agent installs the
//! certificate when the sandbox is handed over and when rules are set.

use copse_substrate::Policy;

use super::Sandboxes;
use crate::agent_link;
use crate::model::{Caller, Result, SandboxError, SandboxRecord};
use crate::network::NetworkRequest;

impl Sandboxes {
    /// Replaces the sandbox's egress policy (E2B's `update_network`). A
    /// sandbox paused without memory gets it when it resumes.
    pub async fn update_network(&self, caller: &Caller, id: &str, request: NetworkRequest) -> Result<SandboxRecord> {
        let mut record = self.get(caller, id)?;
        // The sandbox's team, not the caller's (an admin's): its secrets
        // are the ones its requests may carry.
        let policy = self.checked_policy(&record.team, &request)?;
        let attached = !record.has_no_processes();
        // Without a network the sandbox has no egress at all, which every
        // policy admits; the policy is kept for when it is asked about.
        if let Some(network) = record.network.as_mut() {
            if attached {
                // Trusted before the proxy intercepts anything for it.
                if let Some(ca) = self.egress_ca_for(&policy) {
                    let init = serde_json::json!({ "egressCa": ca });
                    agent_link::post_json(&record.agent_socket, "/init", &init, Some(&record.access_token)).await?;
                }
                self.apply_policy(id, &policy).await?;
            }
            network.policy = policy.clone();
        }
        record.allow_internet_access = policy.internet_access();
        self.store.put(&record)?;
        Ok(record)
    }

    /// The CA certificate (PEM) a sandbox with `policy` must trust, if any.
    pub(super) fn egress_ca_for(&self, policy: &Policy) -> Option<&str> {
        self.egress_ca.as_deref().filter(|_| policy.rules.is_some())
    }

    /// The policy `request` asks for on behalf of `team`: a SOCKS5 upstream
    /// the host may dial, and rules naming only secrets the team has.
    pub(super) fn checked_policy(&self, team: &str, request: &NetworkRequest) -> Result<Policy> {
        let policy = request.policy(team)?;
        self.addresses.check_upstream(&policy)?;
        for name in policy.rules.iter().flat_map(|r| r.secret_names()) {
            let exists = match &self.secrets {
                Some(secrets) => secrets.exists(team, name)?,
                None => false,
            };
            if !exists {
                return Err(SandboxError::Invalid(format!(
                    "network.rules: no secret named '{name}' (placeholders name a secret of the sandbox's team)"
                )));
            }
        }
        Ok(policy)
    }

    pub(super) async fn apply_policy(&self, id: &str, policy: &Policy) -> Result<()> {
        let (owned, policy) = (id.to_string(), policy.clone());
        self.blocking(move |s| s.update_network(&owned, &policy)).await
    }

    /// Re-applies policies that name hosts, so their addresses follow DNS.
    pub async fn refresh_host_names(&self) -> anyhow::Result<()> {
        for record in self.own_records()?.into_iter().filter(|r| !r.has_no_processes()) {
            if let Some(network) = record.network.as_ref().filter(|n| n.policy.has_hosts())
                && let Err(e) = self.apply_policy(&record.id, &network.policy).await
            {
                tracing::warn!("refreshing the host names of {}: {e:#}", record.id);
            }
        }
        Ok(())
    }
}
