//! What a team pins on one of its built templates besides its builds: its
//! tags (E2B's `name:tag`, each a history of the builds it pointed at) and
//! whether other teams may create sandboxes from it. Kept apart from the
//! template's record because a running build rewrites that record
//! wholesale as its log grows; a tag assigned meanwhile must survive it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::error::{Result, SandboxError};
use super::snapshot::LazyFiles;
use super::template::Image;

/// The tag a name without one means (E2B's).
pub const DEFAULT_TAG: &str = "default";
/// How many tags one request may name, and one template may carry.
pub const MAX_TAGS_PER_REQUEST: usize = 32;
pub const MAX_TAGS_PER_TEMPLATE: usize = 256;
/// How many past assignments one tag keeps (the oldest go first).
pub const MAX_ASSIGNMENTS_PER_TAG: usize = 50;
const MAX_TAG_LEN: usize = 64;

/// One time a tag was pointed at a build.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TagAssignment {
    pub id: String,
    pub build_id: String,
    pub assigned_at_ms: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tag {
    pub name: String,
    /// Newest first; the first is where the tag points now.
    pub assignments: Vec<TagAssignment>,
}

impl Tag {
    pub fn build_id(&self) -> &str {
        &self.assignments[0].build_id
    }

    pub fn assigned_at_ms(&self) -> i64 {
        self.assignments[0].assigned_at_ms
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateLabels {
    /// The built template's id.
    pub id: String,
    pub team: String,
    /// Other teams may create sandboxes from it (by id); only its team may
    /// change or delete it.
    #[serde(default)]
    pub public: bool,
    #[serde(default)]
    pub tags: Vec<Tag>,
    /// The build the template's image came from while a later build is
    /// running or has failed (the image is the last successful build's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_build: Option<String>,
    /// Images of older builds a tag still points at: a rebuild moves the
    /// replaced image here instead of deleting it, so `name:oldtag` keeps
    /// booting the old build's files until no tag names that build.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kept_images: Vec<KeptImage>,
    /// The images (by snapshot key) the template's node has put in the
    /// cluster's object store, from where another node fetches one when
    /// that node takes no new sandboxes (`service/image_objects.rs`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stored_images: Vec<String>,
    /// Of those, the ones stored with their layers as images too, for a
    /// node to mount as they arrive: by snapshot key.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub lazy_images: BTreeMap<String, LazyFiles>,
    /// Bumped by every write, which names the revision it read: of two
    /// edits that read the same labels (two tag requests, a build ending),
    /// the second to write finds the row moved on and starts again from it
    /// instead of undoing the first. Rows from before revisions read as 0.
    #[serde(default)]
    pub revision: u64,
}

/// The image of a build that is no longer the template's latest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptImage {
    pub build_id: String,
    pub image: Image,
}

impl TemplateLabels {
    pub fn new(id: &str, team: &str) -> Self {
        Self { id: id.into(), team: team.into(), ..Default::default() }
    }

    pub fn tag(&self, name: &str) -> Option<&Tag> {
        self.tags.iter().find(|t| t.name == name)
    }

    /// Points `tag` (already normalized) at `build_id`.
    pub fn assign(&mut self, tag: &str, build_id: &str, assignment_id: String, at_ms: i64) -> Result<()> {
        let assignment = TagAssignment { id: assignment_id, build_id: build_id.into(), assigned_at_ms: at_ms };
        if let Some(existing) = self.tags.iter_mut().find(|t| t.name == tag) {
            existing.assignments.insert(0, assignment);
            existing.assignments.truncate(MAX_ASSIGNMENTS_PER_TAG);
            return Ok(());
        }
        if self.tags.len() >= MAX_TAGS_PER_TEMPLATE {
            return Err(SandboxError::Invalid(format!(
                "a template carries at most {MAX_TAGS_PER_TEMPLATE} tags; remove some first"
            )));
        }
        self.tags.push(Tag { name: tag.into(), assignments: vec![assignment] });
        Ok(())
    }

    /// Whether some tag points at `build_id` now.
    pub fn names_build(&self, build_id: &str) -> bool {
        self.tags.iter().any(|t| t.build_id() == build_id)
    }

    /// The kept image of `build_id`, if one is kept.
    pub fn kept_image(&self, build_id: &str) -> Option<&Image> {
        self.kept_images.iter().find(|k| k.build_id == build_id).map(|k| &k.image)
    }

    /// Keeps `image` of `build_id` if a tag points at that build; else
    /// hands it back for deletion.
    pub fn keep_if_tagged(&mut self, build_id: &str, image: Image) -> Option<Image> {
        if !self.names_build(build_id) {
            return Some(image);
        }
        self.kept_images.retain(|k| k.build_id != build_id);
        self.kept_images.push(KeptImage { build_id: build_id.into(), image });
        None
    }

    /// Takes out the kept images no tag points at any more: theirs are
    /// the snapshots to delete.
    pub fn take_untagged(&mut self) -> Vec<Image> {
        let (keep, drop): (Vec<KeptImage>, Vec<KeptImage>) =
            std::mem::take(&mut self.kept_images).into_iter().partition(|k| self.names_build(&k.build_id));
        self.kept_images = keep;
        drop.into_iter().map(|k| k.image).collect()
    }

    /// Whether the tag was there.
    pub fn remove(&mut self, tag: &str) -> bool {
        let before = self.tags.len();
        self.tags.retain(|t| t.name != tag);
        self.tags.len() != before
    }
}

/// A template name as `Sandbox.create` and `Template.build` take it:
/// `name` or `name:tag`. The tag is normalized; `None` when absent.
pub fn split_tag(name: &str) -> Result<(&str, Option<String>)> {
    match name.rsplit_once(':') {
        Some((bare, tag)) => Ok((bare, Some(normalize_tag(tag)?))),
        None => Ok((name, None)),
    }
}

/// Tags are case-insensitive words: they appear in `name:tag`, in URLs and
/// in the CLI's output, so nothing that could read as a path or a second
/// separator is accepted.
pub fn normalize_tag(tag: &str) -> Result<String> {
    let tag = tag.trim().to_ascii_lowercase();
    let ok = !tag.is_empty()
        && tag.len() <= MAX_TAG_LEN
        && tag.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && !tag.starts_with('.')
        && !tag.contains("..");
    if ok {
        Ok(tag)
    } else {
        // Never echo a huge refused value back whole.
        let shown: String = tag.chars().take(MAX_TAG_LEN).collect();
        Err(SandboxError::Invalid(format!(
            "invalid tag {shown:?}: use letters, digits and - _ . (at most {MAX_TAG_LEN}, not starting with .)"
        )))
    }
}

/// A request's list of tags, normalized, without repeats, bounded.
pub fn normalize_tags(tags: &[String]) -> Result<Vec<String>> {
    if tags.len() > MAX_TAGS_PER_REQUEST {
        return Err(SandboxError::Invalid(format!("at most {MAX_TAGS_PER_REQUEST} tags per request")));
    }
    let mut out: Vec<String> = Vec::with_capacity(tags.len());
    for tag in tags {
        let tag = normalize_tag(tag)?;
        if !out.contains(&tag) {
            out.push(tag);
        }
    }
    if out.is_empty() {
        return Err(SandboxError::Invalid("name at least one tag".into()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_plain_words() {
        assert_eq!(normalize_tag(" V1.0 ").unwrap(), "v1.0");
        for bad in ["", "a/b", "..", ".hidden", "a..b", "x y", "a:b", &"x".repeat(65)] {
            assert!(normalize_tag(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn names_split_at_their_last_colon() {
        assert_eq!(split_tag("app").unwrap(), ("app", None));
        assert_eq!(split_tag("app:Prod").unwrap(), ("app", Some("prod".into())));
        assert!(split_tag("app:../x").is_err());
        assert!(split_tag("app:").is_err());
    }

    #[test]
    fn request_lists_are_bounded_and_deduplicated() {
        let tags = vec!["a".to_string(), "A".into(), "b".into()];
        assert_eq!(normalize_tags(&tags).unwrap(), vec!["a", "b"]);
        assert!(normalize_tags(&[]).is_err());
        let many: Vec<String> = (0..=MAX_TAGS_PER_REQUEST).map(|i| format!("t{i}")).collect();
        assert!(normalize_tags(&many).is_err());
    }

    #[test]
    fn reassigning_keeps_history_newest_first() {
        let mut labels = TemplateLabels::new("t", "team");
        labels.assign("prod", "b1", "a1".into(), 1).unwrap();
        labels.assign("prod", "b2", "a2".into(), 2).unwrap();
        let tag = labels.tag("prod").unwrap();
        assert_eq!(tag.build_id(), "b2");
        assert_eq!(tag.assignments.len(), 2);
        assert!(labels.remove("prod"));
        assert!(!labels.remove("prod"));
    }

    fn image(key: &str) -> Image {
        Image { snapshot_key: key.into(), ..Default::default() }
    }

    #[test]
    fn an_old_build_is_kept_while_a_tag_names_it() {
        let mut labels = TemplateLabels::new("t", "team");
        labels.assign("v1", "b1", "a1".into(), 1).unwrap();
        labels.assign("default", "b2", "a2".into(), 2).unwrap();
        assert_eq!(labels.keep_if_tagged("b1", image("s1")), None);
        assert_eq!(labels.kept_image("b1").unwrap().snapshot_key, "s1");
        // No tag names b0: its image goes.
        assert_eq!(labels.keep_if_tagged("b0", image("s0")).unwrap().snapshot_key, "s0");
        assert!(labels.take_untagged().is_empty());
        labels.assign("v1", "b2", "a3".into(), 3).unwrap();
        let dropped = labels.take_untagged();
        assert_eq!(dropped.len(), 1);
        assert_eq!(dropped[0].snapshot_key, "s1");
        assert!(labels.kept_image("b1").is_none());
    }

    #[test]
    fn labels_stored_before_kept_images_read_without_them() {
        let old = r#"{"id":"t","team":"x","public":false,"tags":[]}"#;
        let labels: TemplateLabels = serde_json::from_str(old).unwrap();
        assert!(labels.kept_images.is_empty());
    }

    #[test]
    fn a_template_carries_a_bounded_number_of_tags() {
        let mut labels = TemplateLabels::new("t", "team");
        for i in 0..MAX_TAGS_PER_TEMPLATE {
            labels.assign(&format!("t{i}"), "b", format!("a{i}"), 0).unwrap();
        }
        assert!(labels.assign("one-more", "b", "x".into(), 0).is_err());
        assert!(labels.assign("t0", "b2", "y".into(), 0).is_ok());
    }
}
