//! The build layer cache: after each step a build snapshots its sandbox's
//! files, and records the snapshot under a key chained from the base and
//! every step so far. A rebuild walks the chain and starts its sandbox on
//! the deepest layer it finds, running only the steps after it.
//!
//! Keys are per team: the team's name is hashed into every key and the
//! store answers a lookup only with the team's own entry, so a build never
//! stacks on files another team's build produced, whatever steps or files
//! hashes it sends. A copy step is keyed by the SDK's files hash, which the
//! gateway cannot check against the upload (the SDK hashes file stats and
//! contents, not the archive): a team that lies about it poisons only its
//! own cache.
//!
//! An entry lists the team's templates whose builds made or reused it;
//! deleting the last of them deletes its snapshot, whose layers the
//! substrate keeps while any sandbox still stacks on them.

use std::collections::HashSet;

use sha2::{Digest, Sha256};

use super::steps::Step;
use super::{Base, Sandboxes, is_image_template};
use crate::model::{BuildLayer, Image, now_ms};

/// Changes whenever what a key means changes, so old entries stop matching.
const KEY_VERSION: &str = "copse-build-layer-v1";

/// The key of what a build starts from, before any step; `identity` is
/// [`Sandboxes::base_identity`].
pub(super) fn base_key(team: &str, identity: &str) -> String {
    digest(&[KEY_VERSION, "base", team, identity])
}

/// The key of the files after `step`, run on the files of `parent`.
pub(super) fn step_key(team: &str, parent: &str, step: &Step) -> String {
    let mut fields = vec![KEY_VERSION, "step", team, parent];
    let pairs;
    match step {
        Step::Run { command, user } => fields.extend(["RUN", command, user.as_deref().unwrap_or("")]),
        Step::Env(list) => {
            pairs = list.iter().flat_map(|(k, v)| [k.as_str(), v.as_str()]).collect::<Vec<_>>();
            fields.push("ENV");
            fields.extend(pairs.iter().copied());
        }
        Step::Workdir(dir) => fields.extend(["WORKDIR", dir]),
        Step::User(user) => fields.extend(["USER", user]),
        Step::Copy { src, dest, owner, mode, hash } => {
            fields.extend(["COPY", src, dest, owner.as_deref().unwrap_or(""), mode.as_deref().unwrap_or(""), hash])
        }
    }
    digest(&fields)
}

/// Every field length-prefixed, so no two field lists hash alike.
fn digest(fields: &[&str]) -> String {
    let mut hasher = Sha256::new();
    for field in fields {
        hasher.update((field.len() as u64).to_le_bytes());
        hasher.update(field.as_bytes());
    }
    hasher.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// What a cached layer is to a new build sandbox: its files and settings.
pub(super) fn as_image(layer: &BuildLayer) -> Image {
    Image {
        substrate_template: layer.substrate_template.clone(),
        // The layer's files are on this host by now, and so is the
        // template under them (`Sandboxes::reachable`): no blobs to fetch.
        oci: None,
        snapshot_key: layer.snapshot_key.clone(),
        envs: layer.envs.clone(),
        user: Some(layer.user.clone()),
        workdir: layer.workdir.clone(),
        start_cmd: None,
        ready_cmd: None,
        memory: false,
        agent_token: None,
    }
}

impl Sandboxes {
    /// What the base's files are: a substrate template as built (a rebuilt
    /// `base` starts new chains), an OCI image's template by the image's
    /// digest alone (every node unpacks one digest to the same files, so
    /// entries stacked on it serve the whole cluster), or a built
    /// template's image, whose key is unique to its build. `booted`: the
    /// template the build sandbox boots.
    pub(super) async fn base_identity(&self, base: &Base, booted: &str) -> String {
        match base {
            Base::Substrate(_) | Base::Image { .. } => {
                let built =
                    self.substrate_templates().await.ok().and_then(|all| all.into_iter().find(|t| t.name == booted));
                match built {
                    Some(t) if is_image_template(booted) => format!("oci:{}", t.recipe),
                    Some(t) => format!("template:{booted}:{}:{}", t.recipe, t.built_at),
                    None => format!("template:{booted}"),
                }
            }
            Base::Built { image, .. } => format!("image:{}", image.snapshot_key),
        }
    }

    /// The cached layers a build may start on, back to back from its
    /// first step, each marked as used by `template`: on a shared
    /// database, those this node holds and those in the object store,
    /// the last of which is fetched (`layer_objects.rs`).
    pub(super) async fn cached_layers(&self, team: &str, keys: &[String], template: &str) -> Vec<BuildLayer> {
        let here: HashSet<String> =
            self.substrate_templates().await.map(|all| all.into_iter().map(|t| t.name).collect()).unwrap_or_default();
        let mut found = Vec::new();
        for key in keys {
            match self.store.build_layer(team, key) {
                Ok(Some(layer)) if self.reachable(&layer, &here) => found.push(layer),
                // Another node's, not in the object store (yet), or on an
                // image's template this node lacks: the steps from here
                // run again.
                Ok(Some(_)) | Ok(None) => break,
                Err(e) => {
                    tracing::warn!("reading the build cache: {e:#}");
                    break;
                }
            }
        }
        // Only the deepest is booted: each entry's files hold its
        // parents'.
        while let Some(deepest) = found.last() {
            match self.fetch_layer(deepest).await {
                Ok(()) => break,
                Err(e) => {
                    tracing::warn!(layer = %deepest.key, "fetching a build cache entry: {e}; its step runs again");
                    found.pop();
                }
            }
        }
        for layer in &found {
            if let Err(e) = self.reuse_layer(layer.clone(), template) {
                tracing::warn!("recording a build cache hit: {e:#}");
            }
        }
        found
    }

    /// Marks `layer` as used by `template`, so deleting another template
    /// does not collect it.
    pub(super) fn reuse_layer(&self, mut layer: BuildLayer, template: &str) -> anyhow::Result<()> {
        if !layer.templates.iter().any(|t| t == template) {
            layer.templates.push(template.to_string());
            self.store.put_build_layer(&layer)?;
        }
        Ok(())
    }

    /// Records a layer a build just snapshotted. Another build of the team
    /// may have recorded the same key meanwhile: then its entry stays and
    /// this snapshot is deleted.
    pub(super) async fn record_layer(&self, layer: BuildLayer) -> anyhow::Result<()> {
        let template = layer.templates.first().cloned().unwrap_or_default();
        if let Some(existing) = self.store.build_layer(&layer.team, &layer.key)? {
            let key = layer.snapshot_key;
            self.blocking(move |s| s.delete_snapshot(&key)).await?;
            return self.reuse_layer(existing, &template);
        }
        self.store.put_build_layer(&BuildLayer { created_at_ms: now_ms(), ..layer })
    }

    /// Forgets `template` in its team's cache entries and deletes the
    /// entries no other template of the team uses.
    pub(super) async fn collect_layers(&self, team: &str, template: &str) -> anyhow::Result<usize> {
        let mut removed = 0;
        for mut layer in self.store.build_layers()?.into_iter().filter(|l| l.team == team) {
            let before = layer.templates.len();
            layer.templates.retain(|t| t != template);
            if layer.templates.len() == before {
                continue;
            }
            if !layer.templates.is_empty() {
                self.store.put_build_layer(&layer)?;
                continue;
            }
            self.store.remove_build_layer(&layer.key)?;
            if layer.in_object_store {
                self.forget_stored_layer(&layer).await;
            }
            self.forget_copy(&layer.snapshot_key);
            let key = layer.snapshot_key;
            self.blocking(move |s| s.delete_snapshot(&key)).await?;
            removed += 1;
        }
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(command: &str) -> Step {
        Step::Run { command: command.into(), user: None }
    }

    #[test]
    fn keys_chain_through_every_step_and_name_the_team() {
        let base = base_key("a", "template:base");
        assert_ne!(base, base_key("b", "template:base"));
        assert_ne!(base, base_key("a", "template:code-interpreter-v1"));
        let one = step_key("a", &base, &run("echo 1"));
        assert_eq!(one, step_key("a", &base, &run("echo 1")));
        assert_ne!(one, step_key("b", &base, &run("echo 1")));
        assert_ne!(one, step_key("a", &base, &run("echo 2")));
        assert_ne!(one, step_key("a", &one, &run("echo 1")));
        assert_ne!(one, step_key("a", &base, &Step::Run { command: "echo 1".into(), user: Some("root".into()) }));
    }

    #[test]
    fn fields_cannot_be_shifted_into_each_other() {
        let base = base_key("a", "template:base");
        let ab = Step::Env(vec![("AB".into(), "C".into())]);
        let a_bc = Step::Env(vec![("A".into(), "BC".into())]);
        assert_ne!(step_key("a", &base, &ab), step_key("a", &base, &a_bc));
        let copy = |hash: &str| Step::Copy {
            src: "app".into(),
            dest: "/app".into(),
            owner: None,
            mode: None,
            hash: hash.into(),
        };
        assert_ne!(step_key("a", &base, &copy(&"a".repeat(64))), step_key("a", &base, &copy(&"b".repeat(64))));
    }
}
