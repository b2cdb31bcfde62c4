//! After a gateway restart: re-adopt the sandboxes that survived, destroy
//! what no record names, and bring snapshot rows and files back in step.

use std::collections::HashSet;

use copse_substrate::{Placement, SandboxNetwork};

use super::Sandboxes;
use crate::model::{BuildLayer, SnapshotRecord};

impl Sandboxes {
    /// Re-adopt what survived a gateway restart; destroy the rest.
    pub async fn recover(&self) -> anyhow::Result<copse_substrate::Recovery> {
        // First the changes a crash cut short, so the records below say
        // what the host holds (or should hold) again.
        self.replay_journal().await?;
        let records = self.own_records()?;
        // A sandbox paused without memory has no processes to find; its
        // files live in a snapshot, reconciled below.
        let known: Vec<(String, Placement)> =
            records.iter().filter(|r| !r.has_no_processes()).map(|r| (r.id.clone(), r.placement.clone())).collect();
        let recovery = self.blocking(move |s| s.recover(&known)).await?;
        for id in &recovery.removed {
            // A sandbox paused on its files was not asked about: what was
            // removed under its id is a boot a crash cut short, not it.
            if records.iter().any(|r| &r.id == id && r.has_no_processes()) {
                continue;
            }
            self.store.remove(id)?;
        }
        // Sandboxes paused without memory have no interface now but keep
        // their address for when they resume.
        for record in records.iter().filter(|r| recovery.adopted.contains(&r.id) || r.has_no_processes()) {
            if let Some(network) = &record.network {
                self.addresses.hold(&record.id, network.address);
            }
        }
        let attached: Vec<(String, SandboxNetwork)> = records
            .into_iter()
            .filter(|r| recovery.adopted.contains(&r.id))
            .filter_map(|r| Some((r.id, r.network?)))
            .collect();
        self.blocking(move |s| s.recover_network(&attached)).await?;
        self.reconcile_snapshots().await?;
        Ok(recovery)
    }

    /// This host's snapshot and build cache rows whose files are gone are
    /// dropped, and substrate snapshots no row of any node (no snapshot,
    /// paused sandbox, built template or cache entry) names are deleted.
    async fn reconcile_snapshots(&self) -> anyhow::Result<()> {
        let on_host = self.blocking(|s| s.snapshots()).await?;
        let rows = self.store.snapshots()?;
        for row in rows.iter().filter(|r| self.holds(r.node.as_deref())) {
            if !on_host.iter().any(|s| s.id == row.key) {
                tracing::warn!("snapshot {} lost its files; forgetting it", row.id);
                self.store.remove_snapshot(&row.team, &row.id)?;
            }
        }
        let layers = self.store.build_layers()?;
        for layer in layers.iter().filter(|l| self.holds(l.node.as_deref())) {
            if !on_host.iter().any(|s| s.id == layer.snapshot_key) {
                tracing::warn!("build cache layer {} lost its files; forgetting it", layer.key);
                self.store.remove_build_layer(&layer.key)?;
            }
        }
        let names = self.snapshot_names(rows, layers)?;
        let own: HashSet<&str> =
            names.iter().filter(|(_, node)| self.holds(node.as_deref())).map(|(key, _)| key.as_str()).collect();
        let named: HashSet<&str> = names.iter().map(|(key, _)| key.as_str()).collect();
        let (kept, orphans): (Vec<_>, Vec<_>) = on_host.into_iter().partition(|s| named.contains(s.id.as_str()));
        for orphan in orphans {
            tracing::info!("removing snapshot {} that no record names", orphan.id);
            self.blocking(move |s| s.delete_snapshot(&orphan.id)).await?;
        }
        // Copies an earlier run fetched (only other nodes' records name
        // them) are let go, as this run's are, once no record does.
        let fetched = kept.into_iter().map(|s| s.id).filter(|id| !own.contains(id.as_str()));
        self.fetched.lock().unwrap_or_else(|e| e.into_inner()).extend(fetched);
        Ok(())
    }

    /// The substrate snapshots some row of any node names: a snapshot, a
    /// paused sandbox's files, a built template's image (its own or one a
    /// tag keeps) or a build cache entry; `snapshots` and `layers` are the
    /// snapshot and build cache rows, as the caller read them.
    pub(super) fn named_snapshots(
        &self,
        snapshots: Vec<SnapshotRecord>,
        layers: Vec<BuildLayer>,
    ) -> anyhow::Result<HashSet<String>> {
        Ok(self.snapshot_names(snapshots, layers)?.into_iter().map(|(key, _)| key).collect())
    }

    /// [`Self::named_snapshots`], each with the node of the row naming it.
    fn snapshot_names(
        &self,
        snapshots: Vec<SnapshotRecord>,
        layers: Vec<BuildLayer>,
    ) -> anyhow::Result<Vec<(String, Option<String>)>> {
        let mut names: Vec<_> = snapshots.into_iter().map(|r| (r.key, r.node)).collect();
        for sandbox in self.store.all()? {
            names.extend(sandbox.paused.and_then(|p| p.files_only).map(|key| (key, sandbox.node.clone())));
        }
        for template in self.store.built_templates()? {
            if let Some(labels) = self.store.template_labels(&template.id)? {
                names.extend(labels.kept_images.into_iter().map(|k| (k.image.snapshot_key, template.node.clone())));
            }
            names.extend(template.image.map(|i| (i.snapshot_key, template.node.clone())));
        }
        names.extend(layers.into_iter().map(|l| (l.snapshot_key, l.node)));
        Ok(names)
    }
}
