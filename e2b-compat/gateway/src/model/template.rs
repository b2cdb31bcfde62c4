//! A template a team built through the SDK's `Template.build`: its names,
//! its latest build (status and log), and what every sandbox of it gets
//! (the snapshot its files come from, environment, user, working
//! directory, start and ready commands).

use serde::{Deserialize, Serialize};

use super::error::{Result, SandboxError};

/// How many log lines one build keeps; later lines replace the last one.
pub const MAX_BUILD_LOG_LINES: usize = 5000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BuildStatus {
    /// Requested; its steps have not arrived yet.
    Waiting,
    Building,
    Ready,
    Error,
}

impl BuildStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            BuildStatus::Waiting => "waiting",
            BuildStatus::Building => "building",
            BuildStatus::Ready => "ready",
            BuildStatus::Error => "error",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildLine {
    pub at_ms: i64,
    /// `info`, `warn`, `error` or `debug`, as E2B's log levels.
    pub level: String,
    pub message: String,
    /// The step it belongs to: `base`, a 1-based step number, `finalize`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
}

/// Why a build failed: the message the SDK raises and the step it names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildFailure {
    pub message: String,
    pub step: Option<String>,
}

/// The latest build of a template.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Build {
    pub id: String,
    pub status: BuildStatus,
    pub log: Vec<BuildLine>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<BuildFailure>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    pub cpu_count: u32,
    pub memory_mb: u32,
}

impl Build {
    /// A build with an empty log, for tests.
    #[cfg(test)]
    pub fn example(status: BuildStatus) -> Self {
        Self {
            id: "b".into(),
            status,
            log: vec![],
            failure: None,
            created_at_ms: 0,
            updated_at_ms: 0,
            cpu_count: 1,
            memory_mb: 512,
        }
    }

    pub fn push(&mut self, line: BuildLine) {
        if self.log.len() >= MAX_BUILD_LOG_LINES {
            self.log.pop();
        }
        self.updated_at_ms = line.at_ms;
        self.log.push(line);
    }
}

/// What a sandbox of the template starts from: the built snapshot of a
/// substrate template, and the settings the build's steps left.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Image {
    /// The substrate template the snapshot's layers sit on (`base`).
    pub substrate_template: String,
    /// When that template is an OCI image's (`image-<digest>`): the image,
    /// by which another node remakes the template from the object store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oci: Option<OciBase>,
    /// The substrate's snapshot key holding the built files.
    pub snapshot_key: String,
    /// In the order the build set them; later ones win.
    pub envs: Vec<(String, String)>,
    pub user: Option<String>,
    pub workdir: Option<String>,
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
    /// The snapshot holds memory: the start command already runs in it
    /// (started and found ready at the end of the build), so a create
    /// restores it instead of starting it.
    #[serde(default)]
    pub memory: bool,
    /// The token the restored agent still demands (the build sandbox's),
    /// as a memory snapshot's record keeps it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_token: Option<String>,
}

/// The OCI image under a built template's files, as its building node
/// pulled it. These digests, kept in the database, are what another node
/// checks the layer blobs it fetches from the object store against.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OciBase {
    /// The image manifest's digest: its substrate template's fingerprint.
    pub digest: String,
    /// The layer blobs' digests, bottom first.
    pub layers: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TemplateRecord {
    /// Unique across teams (ids are random); names are per team.
    pub id: String,
    pub team: String,
    /// The name it was built under (E2B's alias), without a tag.
    pub name: String,
    pub created_at_ms: i64,
    /// The latest build; the image below is the last one that succeeded.
    pub build: Build,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<Image>,
    /// Every build requested so far.
    pub build_count: u32,
    /// Upload links name the template and carry this token: the SDK
    /// sends the upload without its API key.
    pub upload_token: String,
    /// The node whose host runs its latest build and keeps its image, on a
    /// shared database (`model::node`); `None` on a single host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

/// A template name, optionally with E2B's `:tag`, which is accepted and
/// dropped (tags are not kept yet). Names are what `Sandbox.create` takes,
/// so they take the shapes snapshot names take.
pub fn split_template_name(name: &str) -> Result<String> {
    let bare = match name.rsplit_once(':') {
        Some((bare, tag)) if !tag.is_empty() && !tag.contains('/') => bare,
        _ => name,
    };
    let ok = !bare.is_empty()
        && bare.len() <= 128
        && bare.chars().all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
        && !bare.contains("..")
        && !bare.starts_with('/');
    if ok {
        Ok(bare.to_string())
    } else {
        Err(SandboxError::Invalid(format!(
            "invalid template name {name:?}: use letters, digits and - _ . / (at most 128), optionally :tag"
        )))
    }
}

/// The SDK's files hash (hex SHA-256): it names a file on the host, so
/// nothing else is accepted.
pub fn validate_files_hash(hash: &str) -> Result<()> {
    if hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(())
    } else {
        Err(SandboxError::Invalid(format!("invalid files hash {hash:?}: expected 64 hex digits")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_drop_their_tag_and_refuse_paths() {
        assert_eq!(split_template_name("my-app").unwrap(), "my-app");
        assert_eq!(split_template_name("my-app:v1").unwrap(), "my-app");
        assert_eq!(split_template_name("team/my-app:default").unwrap(), "team/my-app");
        assert!(split_template_name("../etc").is_err());
        assert!(split_template_name("/abs").is_err());
        assert!(split_template_name("").is_err());
        assert!(split_template_name("a b").is_err());
    }

    #[test]
    fn files_hashes_are_hex_only() {
        assert!(validate_files_hash(&"ab".repeat(32)).is_ok());
        assert!(validate_files_hash("../../etc/passwd").is_err());
        assert!(validate_files_hash(&"zz".repeat(32)).is_err());
    }

    #[test]
    fn an_image_stored_before_memory_images_reads_as_files_only() {
        let old = r#"{"substrate_template":"base","snapshot_key":"snap-x","envs":[],"user":"user","workdir":null,"start_cmd":"serve","ready_cmd":null}"#;
        let image: Image = serde_json::from_str(old).unwrap();
        assert!(!image.memory && image.agent_token.is_none());
        assert_eq!(image.start_cmd.as_deref(), Some("serve"));
    }

    #[test]
    fn a_build_log_is_bounded() {
        let mut build = Build::example(BuildStatus::Building);
        for i in 0..MAX_BUILD_LOG_LINES + 10 {
            build.push(BuildLine { at_ms: i as i64, level: "info".into(), message: i.to_string(), step: None });
        }
        assert_eq!(build.log.len(), MAX_BUILD_LOG_LINES);
        assert_eq!(build.log.last().unwrap().message, (MAX_BUILD_LOG_LINES + 9).to_string());
    }
}
