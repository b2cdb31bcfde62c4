//! Tags and visibility of built templates: `name:tag` at build and at
//! create, assigning and removing tags, listing them, and `PATCH`'s
//! public flag. A template's image is its latest successful build's;
//! the images of older builds a tag still points at are kept beside it
//! (`TemplateLabels::kept_images`) and collected once no tag names their
//! build (a sandbox still running on one keeps its files: the substrate
//! removes a layer only once nothing stacks on it).

use super::Sandboxes;

/// How many times a label edit starts again after losing a race.
const LABEL_WRITE_ATTEMPTS: usize = 16;
use crate::model::{
    BuildStatus, Caller, DEFAULT_TAG, Result, SandboxError, Tag, TemplateLabels, TemplateRecord, new_uuid,
    normalize_tags, now_ms, split_tag, split_template_name,
};

/// The build a template's image came from, if it has one.
pub fn image_build<'a>(record: &'a TemplateRecord, labels: &'a TemplateLabels) -> Option<&'a str> {
    record.image.as_ref()?;
    match record.build.status {
        BuildStatus::Ready => Some(record.build.id.as_str()),
        _ => labels.image_build.as_deref(),
    }
}

/// The build `tag` points at; a template from before tags existed has its
/// image's build under the default tag.
pub fn tag_build<'a>(record: &'a TemplateRecord, labels: &'a TemplateLabels, tag: &str) -> Option<&'a str> {
    match labels.tag(tag) {
        Some(found) => Some(found.build_id()),
        None if tag == DEFAULT_TAG && labels.tags.is_empty() => image_build(record, labels),
        None => None,
    }
}

impl Sandboxes {
    pub fn template_labels(&self, record: &TemplateRecord) -> Result<TemplateLabels> {
        Ok(self.store.template_labels(&record.id)?.unwrap_or_else(|| TemplateLabels::new(&record.id, &record.team)))
    }

    /// Applies `change` to the template's labels and writes them; when
    /// another write got in between (another gateway's too), `change` runs
    /// again on what that write left. Returns what the written labels and
    /// the last run of `change` gave.
    pub(in crate::service) fn change_labels<T>(
        &self,
        record: &TemplateRecord,
        mut change: impl FnMut(&mut TemplateLabels) -> Result<T>,
    ) -> Result<(TemplateLabels, T)> {
        for _ in 0..LABEL_WRITE_ATTEMPTS {
            let mut labels = self.template_labels(record)?;
            let outcome = change(&mut labels)?;
            labels.revision += 1;
            if self.store.swap_template_labels(&labels)? {
                return Ok((labels, outcome));
            }
        }
        Err(SandboxError::Conflict(format!("the tags of template {} kept changing meanwhile; try again", record.name)))
    }

    /// The tags a new build of `name` (maybe `name:tag`) gets: its own, the
    /// request's extra ones, else the default tag.
    pub(super) fn build_tags(name: &str, extra: &[String]) -> Result<Vec<String>> {
        let (_, tag) = split_tag(name)?;
        let mut tags: Vec<String> = tag.into_iter().chain(extra.iter().cloned()).collect();
        if tags.is_empty() {
            tags.push(DEFAULT_TAG.into());
        }
        normalize_tags(&tags)
    }

    /// Points the new build's tags at it, remembering which build the
    /// image keeps coming from until the new one succeeds.
    pub(super) fn label_new_build(
        &self,
        previous: Option<&TemplateRecord>,
        record: &TemplateRecord,
        tags: &[String],
    ) -> Result<TemplateLabels> {
        let (labels, ()) = self.change_labels(record, |labels| {
            if let Some(previous) = previous {
                labels.image_build = image_build(previous, labels).map(str::to_string);
            }
            let now = now_ms();
            for tag in tags {
                labels.assign(tag, &record.build.id, new_uuid(), now)?;
            }
            Ok(())
        })?;
        Ok(labels)
    }

    /// `POST /templates/tags`: points `tags` at the build `target`
    /// (`name:tag`, or `name` for its default tag) points at.
    pub async fn assign_tags(&self, caller: &Caller, target: &str, tags: &[String]) -> Result<(String, Vec<String>)> {
        let tags = normalize_tags(tags)?;
        let (bare, source) = split_tag(target)?;
        let source = source.unwrap_or_else(|| DEFAULT_TAG.into());
        let record = self.built_template(caller, bare)?;
        let (_, (build, untagged)) = self.change_labels(&record, |labels| {
            let build = tag_build(&record, labels, &source)
                .ok_or_else(|| SandboxError::TemplateNotFound(format!("{bare}:{source}")))?
                .to_string();
            let now = now_ms();
            for tag in &tags {
                labels.assign(tag, &build, new_uuid(), now)?;
            }
            Ok((build, labels.take_untagged()))
        })?;
        self.drop_images(untagged).await;
        Ok((build, tags))
    }

    /// `DELETE /templates/tags`: all of them, or none when one is missing.
    pub async fn remove_tags(&self, caller: &Caller, name: &str, tags: &[String]) -> Result<()> {
        let tags = normalize_tags(tags)?;
        let record = self.built_template(caller, name)?;
        let (_, untagged) = self.change_labels(&record, |labels| {
            for tag in &tags {
                if !labels.remove(tag) {
                    return Err(SandboxError::TemplateNotFound(format!("{}:{tag}", record.name)));
                }
            }
            Ok(labels.take_untagged())
        })?;
        self.drop_images(untagged).await;
        Ok(())
    }

    /// The caller's built template with its tags, by id or name.
    pub fn tagged_template(&self, caller: &Caller, id_or_name: &str) -> Result<(TemplateRecord, TemplateLabels)> {
        let record = self.built_template(caller, id_or_name)?;
        let labels = self.template_labels(&record)?;
        Ok((record, labels))
    }

    /// `PATCH /templates/{id}`: only its own team may.
    pub fn set_public(&self, caller: &Caller, id_or_name: &str, public: bool) -> Result<TemplateRecord> {
        let record = self.built_template(caller, id_or_name)?;
        self.change_labels(&record, |labels| {
            labels.public = public;
            Ok(())
        })?;
        Ok(record)
    }

    /// What `Sandbox.create(name)` boots when `name` is a built template:
    /// the team's own by name (maybe `name:tag`), else another team's
    /// public one by id. Ids are random, so a public template never
    /// stands in for a name copse ships or the caller's own.
    pub(super) fn creatable_template(&self, team: &str, name: &str) -> Result<Option<TemplateRecord>> {
        let Ok((bare, tag)) = split_tag(name) else { return Ok(None) };
        let Ok(bare) = split_template_name(bare) else { return Ok(None) };
        let record = match self.store.template_named(team, &bare)? {
            Some(own) => Some(own),
            None => match self.store.template(&bare)? {
                Some(other) if other.team == team || self.template_labels(&other)?.public => Some(other),
                _ => None,
            },
        };
        let Some(mut record) = record.filter(|t| t.image.is_some()) else { return Ok(None) };
        let labels = self.template_labels(&record)?;
        // A bare name means the default tag, where the template has one.
        let (tag, explicit) = match tag {
            Some(tag) => (tag, true),
            None if labels.tag(DEFAULT_TAG).is_some() => (DEFAULT_TAG.to_string(), false),
            None => return Ok(Some(record)),
        };
        let wanted = tag_build(&record, &labels, &tag).ok_or_else(|| SandboxError::TemplateNotFound(name.into()))?;
        if image_build(&record, &labels) == Some(wanted) {
            return Ok(Some(record));
        }
        if let Some(kept) = labels.kept_image(wanted) {
            record.image = Some(kept.clone());
            return Ok(Some(record));
        }
        if !explicit {
            // The default tag points at a build still running (or failed):
            // the latest image serves meanwhile, as before tags existed.
            return Ok(Some(record));
        }
        Err(SandboxError::Invalid(format!(
            "tag {tag:?} of {bare} points at build {wanted}, which has no image (still building, or it failed)"
        )))
    }

    /// Deletes the snapshots of images no tag names any more. A failure
    /// leaves an orphan `recover`'s reconcile removes, so it is logged.
    pub(super) async fn drop_images(&self, images: Vec<crate::model::Image>) {
        self.forget_stored_images(&images).await;
        for image in images {
            let key = image.snapshot_key;
            if let Err(e) = self.blocking(move |s| s.delete_snapshot(&key)).await {
                tracing::warn!("deleting an image no tag names: {e}");
            }
        }
    }
}

/// One page of a list: `cursor` is the offset the previous page ended at.
pub fn page<T>(items: Vec<T>, cursor: Option<&str>, limit: usize) -> Result<(Vec<T>, Option<String>)> {
    let start = match cursor {
        None | Some("") => 0,
        Some(c) => c.parse::<usize>().map_err(|_| SandboxError::Invalid(format!("invalid cursor {c:?}")))?,
    };
    let total = items.len();
    let items: Vec<T> = items.into_iter().skip(start).take(limit).collect();
    let end = start.saturating_add(items.len());
    Ok((items, (end < total).then(|| end.to_string())))
}

/// The order of `GET /templates/{id}/tags/groups`.
pub fn sort_tags(tags: &mut [Tag], sort: Option<&str>) -> Result<()> {
    match sort.unwrap_or("latest_desc") {
        "latest_desc" => tags.sort_by(|a, b| b.assigned_at_ms().cmp(&a.assigned_at_ms()).then(a.name.cmp(&b.name))),
        "latest_asc" => tags.sort_by(|a, b| a.assigned_at_ms().cmp(&b.assigned_at_ms()).then(a.name.cmp(&b.name))),
        "name_asc" => tags.sort_by(|a, b| a.name.cmp(&b.name)),
        "name_desc" => tags.sort_by(|a, b| b.name.cmp(&a.name)),
        other => {
            return Err(SandboxError::Invalid(format!(
                "invalid sort {other:?}: latest_desc, latest_asc, name_asc or name_desc"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_carry_the_next_offset_until_the_end() {
        let (first, next) = page((0..5).collect(), None, 2).unwrap();
        assert_eq!((first, next.as_deref()), (vec![0, 1], Some("2")));
        let (last, next) = page((0..5).collect(), Some("4"), 2).unwrap();
        assert_eq!((last, next), (vec![4], None));
        assert!(page::<u8>(vec![], Some("x"), 2).is_err());
    }

    #[test]
    fn build_tags_default_and_merge() {
        assert_eq!(Sandboxes::build_tags("app", &[]).unwrap(), vec!["default"]);
        assert_eq!(Sandboxes::build_tags("app:v1", &["Stable".into()]).unwrap(), vec!["v1", "stable"]);
        assert!(Sandboxes::build_tags("app", &["a/b".into()]).is_err());
    }
}
