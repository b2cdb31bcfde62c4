//! Collecting the substrate templates images became (`image-<digest>`):
//! one goes once no built template stands on it (its current image or one
//! a tag keeps) and the substrate finds no sandbox or snapshot stacking on
//! it. The substrate makes that last check under the lock its boots pin
//! under; the gateway's part is to never collect while a build runs (a
//! build may have chosen the image and not booted on it yet), so a pass
//! runs only when no build holds `ImageSource::building`.
//!
//! Passes run after a built template is deleted, after every build, at
//! start, and after a kill or a snapshot deletion while an earlier pass
//! left one waiting for its last sandbox or snapshot.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;

use super::Sandboxes;
use super::image::is_image_template;
use crate::model::TemplateRecord;

impl Sandboxes {
    /// One pass; what it could not remove yet is looked at again later.
    pub async fn collect_image_templates(&self) {
        let source = &self.images;
        let Ok(_no_build) = source.builds.try_write() else {
            source.waiting.store(true, Ordering::Relaxed);
            return;
        };
        let candidates = match self.unreferenced_image_templates().await {
            Ok(candidates) => candidates,
            Err(e) => {
                tracing::warn!("looking for unused image templates: {e:#}");
                return;
            }
        };
        let mut waiting = false;
        for name in candidates {
            let owned = name.clone();
            match self.blocking(move |s| s.delete_template(&owned)).await {
                Ok(true) => tracing::info!(template = %name, "collected an image template no built template uses"),
                Ok(false) => {
                    tracing::debug!(template = %name, "an unused image template waits for its last sandbox or snapshot");
                    waiting = true;
                }
                Err(e) => tracing::warn!(template = %name, "collecting an unused image template: {e}"),
            }
        }
        source.waiting.store(waiting, Ordering::Relaxed);
    }

    /// A pass, if an earlier one left a template waiting.
    pub async fn collect_waiting_image_templates(&self) {
        if self.images.waiting.load(Ordering::Relaxed) {
            self.collect_image_templates().await;
        }
    }

    async fn unreferenced_image_templates(&self) -> anyhow::Result<Vec<String>> {
        let present: Vec<String> =
            self.substrate_templates().await?.into_iter().map(|t| t.name).filter(|n| is_image_template(n)).collect();
        if present.is_empty() {
            return Ok(present);
        }
        let mut records = Vec::new();
        for record in self.store.built_templates()? {
            let kept = self.template_labels(&record)?.kept_images.into_iter().map(|k| k.image.substrate_template);
            records.push((record, kept.collect::<Vec<_>>()));
        }
        Ok(unreferenced(present, &records))
    }
}

/// The names in `present` that neither a record's image nor one its tags
/// keep stands on.
fn unreferenced(present: Vec<String>, records: &[(TemplateRecord, Vec<String>)]) -> Vec<String> {
    let used: BTreeSet<&str> = records
        .iter()
        .flat_map(|(record, kept)| {
            record.image.iter().map(|i| i.substrate_template.as_str()).chain(kept.iter().map(String::as_str))
        })
        .collect();
    present.into_iter().filter(|name| !used.contains(name.as_str())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Build, BuildStatus, Image};

    fn record(id: &str, on: Option<&str>) -> TemplateRecord {
        TemplateRecord {
            id: id.into(),
            team: "t".into(),
            name: id.into(),
            created_at_ms: 0,
            build: Build::example(BuildStatus::Ready),
            image: on.map(|template| Image { substrate_template: template.into(), ..Default::default() }),
            build_count: 1,
            upload_token: String::new(),
            node: None,
        }
    }

    #[test]
    fn an_image_template_is_used_by_a_current_or_kept_image() {
        let present = ["image-a", "image-b", "image-c", "image-d"].map(String::from).to_vec();
        let records = [
            (record("one", Some("image-a")), vec![]),
            (record("two", None), vec!["image-b".to_string()]),
            (record("three", Some("base")), vec![]),
        ];
        assert_eq!(unreferenced(present, &records), ["image-c", "image-d"]);
    }
}
