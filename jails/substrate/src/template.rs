//! Templates: what a sandbox's root filesystem is made of.
//!
//! A [`Recipe`] is platform-neutral data (a name and the packages on top of
//! a minimal base system); each substrate turns it into its own artefact (a
//! Debian root directory for overlayfs on Linux, a ZFS snapshot on FreeBSD).
//! The recipes of the templates copse ships come from their build
//! definitions (`e2b-compat/templates`).

use serde::{Deserialize, Serialize};

/// The unprivileged user every template has, as E2B sandboxes do.
pub const SANDBOX_USER: &str = "user";
pub const SANDBOX_UID: u32 = 1000;
pub const SANDBOX_HOME: &str = "/home/user";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recipe {
    pub name: String,
    /// Packages installed on top of the minimal base system, by the names of
    /// the host's package system (Debian on Linux, pkg on FreeBSD).
    pub packages: Vec<String>,
    /// Shell commands run inside the new root after the packages are in.
    pub post_install: Vec<String>,
    /// Which substrate builds and boots it; recipes saved before backends
    /// existed were all for the host's own.
    #[serde(default)]
    pub backend: Backend,
}

/// Built and ready to boot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateInfo {
    pub name: String,
    /// Unix seconds when the build finished.
    pub built_at: u64,
    pub size_bytes: u64,
    #[serde(default)]
    pub backend: Backend,
    /// The [`Recipe::fingerprint`] it was built from (for a template made
    /// from an image, the image manifest's digest); empty for templates
    /// built before fingerprints existed.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub recipe: String,
}

impl Recipe {
    /// Changes whenever what the recipe builds changes (packages, files,
    /// backend), so a substrate rebuilds a template whose recipe moved on
    /// instead of serving what an older copse built.
    pub fn fingerprint(&self) -> String {
        use sha2::{Digest, Sha256};
        let what = serde_json::json!([self.packages, self.post_install, self.backend]);
        let digest = Sha256::digest(what.to_string().as_bytes());
        digest[..16].iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// The kind of sandbox a template boots into. A host may offer several
/// (see [`crate::router::Router`]); each template belongs to exactly one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The host's own isolation: Linux namespaces, or FreeBSD jails.
    #[default]
    Jail,
    /// bhyve microVMs restored from checkpoints (FreeBSD only).
    Bhyve,
}

impl Backend {
    pub const ALL: [Backend; 2] = [Backend::Jail, Backend::Bhyve];

    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Jail => "jail",
            Backend::Bhyve => "bhyve",
        }
    }

    fn needs(self) -> &'static str {
        match self {
            Backend::Jail => "Linux namespaces or FreeBSD jails",
            Backend::Bhyve => "a FreeBSD host with vmm(4) and bhyve",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|b| b.as_str() == s)
            .ok_or_else(|| format!("unknown backend {s:?}: use jail or bhyve"))
    }
}

/// Refuses a recipe for a backend this substrate does not serve, before
/// anything is built: a template must never silently become another kind.
pub fn check_backend(recipe: &Recipe, served: &[Backend]) -> anyhow::Result<()> {
    if served.contains(&recipe.backend) {
        return Ok(());
    }
    let offered: Vec<&str> = served.iter().map(|b| b.as_str()).collect();
    Err(crate::error::SubstrateError::Unsupported(format!(
        "template {}: the {} backend needs {}; this host ({}) offers only: {}",
        recipe.name,
        recipe.backend,
        recipe.backend.needs(),
        std::env::consts::OS,
        offered.join(", ")
    ))
    .into())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackageSystem {
    Debian,
    FreeBsd,
}

impl PackageSystem {
    /// The package system templates are built from on this host.
    pub fn host() -> Self {
        if cfg!(target_os = "freebsd") { Self::FreeBsd } else { Self::Debian }
    }
}

/// A post-install script that writes `content` to `path` inside the new
/// root (POSIX sh, so it works in a Debian chroot and a FreeBSD jail root).
pub fn write_file_script(path: &str, content: &str, mode: &str) -> String {
    const END: &str = "COPSE_END_OF_FILE";
    assert!(!content.contains(END), "file content must not contain the heredoc delimiter");
    let dir = path.rsplit_once('/').map(|(d, _)| d).filter(|d| !d.is_empty()).unwrap_or("/");
    format!("mkdir -p '{dir}' && cat > '{path}' <<'{END}'\n{content}\n{END}\nchmod {mode} '{path}'")
}

/// Template names become directory and dataset names: keep them boring.
pub fn validate_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        && !name.starts_with('.');
    if ok { Ok(()) } else { Err(format!("invalid template name {name:?}: use letters, digits, '-', '_' or '.'")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recipe_fingerprint_follows_what_it_builds_and_nothing_else() {
        let recipe =
            Recipe { name: "t".into(), packages: vec!["curl".into()], post_install: vec![], backend: Backend::Jail };
        let renamed = Recipe { name: "other".into(), ..recipe.clone() };
        assert_eq!(recipe.fingerprint(), renamed.fingerprint());
        assert_eq!(recipe.fingerprint().len(), 32);
        let scripted = Recipe { post_install: vec!["true".into()], ..recipe.clone() };
        let more = Recipe { packages: vec!["curl".into(), "git".into()], ..recipe.clone() };
        let vm = Recipe { backend: Backend::Bhyve, ..recipe.clone() };
        for changed in [scripted, more, vm] {
            assert_ne!(recipe.fingerprint(), changed.fingerprint());
        }
    }

    #[test]
    fn names_that_could_escape_a_directory_are_refused() {
        assert!(validate_name("base").is_ok());
        assert!(validate_name("code-interpreter-v1").is_ok());
        assert!(validate_name("../etc").is_err());
        assert!(validate_name(".hidden").is_err());
        assert!(validate_name("").is_err());
        assert!(validate_name("a/b").is_err());
    }

    #[test]
    fn file_scripts_quote_their_content() {
        let script = write_file_script("/opt/x/run.py", "print('$HOME')", "0644");
        assert_eq!(
            script,
            "mkdir -p '/opt/x' && cat > '/opt/x/run.py' <<'COPSE_END_OF_FILE'\nprint('$HOME')\nCOPSE_END_OF_FILE\nchmod 0644 '/opt/x/run.py'"
        );
    }

    #[test]
    fn a_recipe_for_another_backend_is_refused_by_name() {
        let mut recipe =
            Recipe { name: "base".into(), packages: vec!["curl".into()], post_install: vec![], backend: Backend::Jail };
        assert!(check_backend(&recipe, &[Backend::Jail]).is_ok());
        recipe.backend = Backend::Bhyve;
        let err = check_backend(&recipe, &[Backend::Jail]).unwrap_err().to_string();
        assert!(err.contains("bhyve") && err.contains("FreeBSD") && err.contains("offers only: jail"), "{err}");
        assert_eq!("bhyve".parse::<Backend>(), Ok(Backend::Bhyve));
        assert!("kvm".parse::<Backend>().is_err());
    }

    #[test]
    fn old_records_load_as_the_host_backend() {
        let info: TemplateInfo = serde_json::from_str(r#"{"name":"base","built_at":1,"size_bytes":2}"#).unwrap();
        assert_eq!(info.backend, Backend::Jail);
        let recipe: Recipe = serde_json::from_str(r#"{"name":"b","packages":[],"post_install":[]}"#).unwrap();
        assert_eq!(recipe.backend, Backend::Jail);
        assert_eq!(serde_json::to_string(&Backend::Bhyve).unwrap(), r#""bhyve""#);
    }
}
