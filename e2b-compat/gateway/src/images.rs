//! Templates from OCI images (`copse image pull`), and the registry
//! settings a template builder pulls with: the operator's mirror map
//! (`--registry-mirror docker.io=http://127.0.0.1:5000`) and credentials
//! (`DATA_DIR/registry-auth.json`, Docker's `auths` format, or
//! `--registry-auth-file`). Pulling, caching and unpacking are
//! `copse_images`'; the template itself is the substrate's.

use std::path::{Path, PathBuf};

use anyhow::Context;
use copse_images::{BlobCache, Pulled, Registries};
use copse_substrate::{Progress, Substrate, TemplateInfo};

/// Read when present and no other file is named.
pub const AUTH_FILE: &str = "registry-auth.json";

/// The operator's registry settings.
pub fn registries(data_dir: &Path, mirrors: &[String], auth_file: Option<&Path>) -> anyhow::Result<Registries> {
    let registries = Registries::with_mirrors(mirrors)?;
    let default_auth = data_dir.join(AUTH_FILE);
    match auth_file {
        Some(file) => registries.with_auth_file(file),
        None if default_auth.is_file() => registries.with_auth_file(&default_auth),
        None => Ok(registries),
    }
}

/// Blobs pulled for any template, by digest.
pub fn blob_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("images").join("blobs")
}

/// Blobs no pull has used for this long leave the cache: a pull collects
/// the cache once it is done.
pub const BLOBS_UNUSED_FOR: std::time::Duration = std::time::Duration::from_secs(7 * 86_400);

/// Removes the blobs of the cache in `dir` no pull has used lately (see
/// [`BLOBS_UNUSED_FOR`]); a failure is only logged, as it loses nothing.
pub fn collect_blobs(dir: &Path) {
    match copse_images::cache::collect(dir, BLOBS_UNUSED_FOR) {
        Ok(Some(c)) if c.blobs + c.partials > 0 => {
            tracing::info!(blobs = c.blobs, bytes = c.bytes, partials = c.partials, "removed unused image blobs");
        }
        Ok(_) => {}
        Err(e) => tracing::warn!("collecting image blobs: {e:#}"),
    }
}

/// `docker.io/library/debian:bookworm` → `debian-bookworm`.
pub fn default_name(reference: &str) -> String {
    let without_digest = reference.split('@').next().unwrap_or(reference);
    let last = without_digest.rsplit('/').next().unwrap_or(without_digest);
    let name = last.replace(':', "-");
    name.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') { c } else { '-' }).collect()
}

/// Pulls `reference` and makes it the template `name`, replacing an
/// earlier pull of that name; the built-in templates cannot be replaced.
pub fn pull_template(
    substrate: &dyn Substrate,
    data_dir: &Path,
    registries: &Registries,
    reference: &str,
    name: &str,
    progress: Progress<'_>,
) -> anyhow::Result<(TemplateInfo, Pulled)> {
    copse_substrate::template::validate_name(name).map_err(anyhow::Error::msg)?;
    anyhow::ensure!(!crate::templates::is_shipped(name), "{name} is a built-in template; pick another --name");
    anyhow::ensure!(
        !crate::service::is_image_template(name),
        "{name} is a name copse gives the templates its builds unpack images into (collected once unused); pick another --name"
    );
    let cache = BlobCache::open(&blob_dir(data_dir))?;
    let pulled = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(copse_images::pull(reference, registries, &cache, progress))?;
    let info = substrate
        .import_template(
            name,
            &pulled.digest,
            &mut |root| copse_images::unpack_image(&pulled, root, progress).map(drop),
            progress,
        )
        .with_context(|| format!("making template {name} from {}", pulled.reference))?;
    drop(cache);
    collect_blobs(&blob_dir(data_dir));
    Ok((info, pulled))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_names_come_from_the_repository_and_tag() {
        assert_eq!(default_name("docker.io/library/debian:bookworm"), "debian-bookworm");
        assert_eq!(default_name("127.0.0.1:5000/team/app"), "app");
        assert_eq!(default_name(&format!("ghcr.io/a/b@sha256:{}", "0".repeat(64))), "b");
    }

    #[test]
    fn the_auth_file_in_the_data_dir_is_read_unless_another_is_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(AUTH_FILE), r#"{"auths":{"r.test":{"username":"u","password":"p"}}}"#).unwrap();
        let r = registries(dir.path(), &["r.test=http://127.0.0.1:1".into()], None).unwrap();
        assert_eq!(r.credential("r.test", "127.0.0.1:1").unwrap().username, "u");
        let other = dir.path().join("other.json");
        std::fs::write(&other, r#"{"auths":{}}"#).unwrap();
        assert!(registries(dir.path(), &[], Some(&other)).unwrap().credential("r.test", "x").is_none());
    }
}
