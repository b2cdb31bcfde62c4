//! A build whose base is an OCI image: the image is pulled (through the
//! operator's mirrors, with the request's credentials ahead of the
//! operator's), made a substrate template once per manifest digest, and
//! its config becomes the build's starting environment, working directory
//! and user. Credentials live only in the running build's memory: never in
//! the store, never in the log.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use copse_images::{BlobCache, Credential, ImageConfig, ImageRef, Registries};
use tokio::sync::mpsc;

use super::run::{Agent, Console, Failed};
use super::{Base, Sandboxes, steps};
use crate::model::{OciBase, SandboxRecord};

/// Where images come from and where their blobs are kept; the gateway's
/// one per host.
pub struct ImageSource {
    registries: Registries,
    blob_dir: PathBuf,
    /// One pull-and-import at a time per reference, so concurrent builds of
    /// one image unpack it once (the later ones find it made).
    imports: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Held shared by every running build; collecting image templates
    /// holds it alone (`image_gc.rs`).
    pub(super) builds: tokio::sync::RwLock<()>,
    /// A collection left an unused image template that something still
    /// stacked on.
    pub(super) waiting: AtomicBool,
}

impl ImageSource {
    pub fn new(registries: Registries, blob_dir: PathBuf) -> Self {
        Self {
            registries,
            blob_dir,
            imports: Default::default(),
            builds: Default::default(),
            waiting: Default::default(),
        }
    }

    pub fn registries(&self) -> &Registries {
        &self.registries
    }

    /// An image template was made that nothing may name once what now
    /// stands on it goes (one remade from the object store for a snapshot
    /// or a paused sandbox): the next kill or snapshot deletion looks.
    pub(in crate::service) fn collect_later(&self) {
        self.waiting.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Held for the whole of a build: no image template is collected
    /// meanwhile.
    pub(in crate::service) async fn building(&self) -> tokio::sync::RwLockReadGuard<'_, ()> {
        self.builds.read().await
    }

    /// The blob cache, open (a collection removes nothing meanwhile).
    pub(in crate::service) fn blob_cache(&self) -> anyhow::Result<BlobCache> {
        BlobCache::open(&self.blob_dir)
    }

    /// Held while `reference` (an image, or the template one became) is
    /// pulled or fetched and made a template.
    pub(in crate::service) fn import_lock(&self, reference: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut imports = self.imports.lock().unwrap_or_else(|e| e.into_inner());
        imports.entry(reference.to_string()).or_default().clone()
    }
}

/// The substrate template an image of `digest` becomes: one per digest,
/// so a template's name says which image content it holds.
pub(in crate::service) fn template_name(digest: &str) -> String {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    format!("image-{}", &hex[..hex.len().min(16)])
}

/// Whether `name` is a template [`template_name`] gave an image.
pub fn is_image_template(name: &str) -> bool {
    name.strip_prefix("image-").is_some_and(|hex| !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// What a build starts from, once its base is ready to boot.
pub(super) struct Opened {
    /// The template its build sandbox boots.
    pub template: String,
    pub envs: Vec<(String, String)>,
    pub workdir: Option<String>,
    /// The build's user; an image's own is checked once its sandbox is up.
    pub user: Option<String>,
    pub image_user: Option<String>,
    /// The OCI image `template` holds, when it is an image's.
    pub oci: Option<OciBase>,
}

impl Sandboxes {
    /// Readies `base` to boot: for an image, pulls and imports it (once
    /// per digest) and reads its config.
    pub(super) async fn open_base(&self, base: &Base, console: &mut Console<'_>) -> Result<Opened, Failed> {
        match base {
            Base::Substrate(name) => Ok(Opened {
                template: name.clone(),
                envs: vec![],
                workdir: None,
                user: None,
                image_user: None,
                oci: None,
            }),
            Base::Built { name, image } => Ok(Opened {
                template: name.clone(),
                envs: image.envs.clone(),
                workdir: image.workdir.clone(),
                user: image.user.clone(),
                image_user: None,
                oci: image.oci.clone(),
            }),
            Base::Image { reference, credential } => {
                let (template, config, oci) =
                    self.import_image(reference, credential.clone(), console).await.map_err(|e| Failed {
                        message: format!("pulling {}: {e:#}", reference.whole),
                        step: Some("base".into()),
                    })?;
                if !config.entrypoint.is_empty() || !config.cmd.is_empty() {
                    console.line(
                        "info",
                        Some("base"),
                        format!(
                            "The image's Entrypoint {:?} and Cmd {:?} are not run: a template runs only the start command set_start_cmd gives",
                            config.entrypoint, config.cmd
                        ),
                    );
                }
                Ok(Opened {
                    template,
                    envs: image_envs(&config),
                    workdir: config.working_dir.clone(),
                    user: None,
                    image_user: config.user.clone(),
                    oci: Some(oci),
                })
            }
        }
    }

    /// Pulls `reference` and makes it a substrate template unless one of
    /// its digest exists; its name, the image's config and what it is.
    async fn import_image(
        &self,
        reference: &ImageRef,
        credential: Option<Credential>,
        console: &mut Console<'_>,
    ) -> anyhow::Result<(String, ImageConfig, OciBase)> {
        let source = &self.images;
        let lock = source.import_lock(&reference.whole);
        let _held = lock.lock().await;
        let mut registries = source.registries.clone();
        if let Some(credential) = credential {
            registries = registries.with_credential(&reference.registry, credential);
        }
        let cache = source.blob_cache()?;
        let (tx, mut rx) = mpsc::unbounded_channel::<String>();
        let progress = move |line: &str| {
            let _ = tx.send(line.to_string());
        };
        let pulled = {
            let pull = copse_images::pull(&reference.whole, &registries, &cache, &progress);
            logged(pull, &mut rx, console).await?
        };
        console.line(
            "info",
            Some("base"),
            format!(
                "image {} is {}: {} blob(s) downloaded, {} from the cache",
                pulled.reference, pulled.digest, pulled.fetched, pulled.cached
            ),
        );
        let name = template_name(&pulled.digest);
        // A node fetching this image's template from the object store
        // (`image_objects.rs`) makes it under this lock too.
        let template_lock = source.import_lock(&name);
        let _making = template_lock.lock().await;
        let made = self.substrate_templates().await?.into_iter().any(|t| t.name == name && t.recipe == pulled.digest);
        if made {
            console.line("info", Some("base"), format!("template {name} already holds this image: not unpacked again"));
        } else {
            console.line("info", Some("base"), format!("unpacking the image into template {name}"));
            let (name, pulled) = (name.clone(), pulled.clone());
            let import = self.blocking(move |s| {
                s.import_template(
                    &name,
                    &pulled.digest,
                    &mut |root| copse_images::unpack_image(&pulled, root, &progress).map(drop),
                    &progress,
                )
            });
            logged(import, &mut rx, console).await?;
        }
        drop(cache);
        let dir = source.blob_dir.clone();
        let _ = tokio::task::spawn_blocking(move || crate::images::collect_blobs(&dir)).await;
        let oci = OciBase { digest: pulled.digest.clone(), layers: pulled.layer_digests.clone() };
        Ok((name, pulled.config, oci))
    }

    /// The image's `User`, if its sandbox has that account; otherwise the
    /// default user (said in the log).
    pub(super) async fn settle_image_user(
        &self,
        sandbox: &SandboxRecord,
        wanted: &str,
        console: &mut Console<'_>,
    ) -> Option<String> {
        let name = wanted.split(':').next().unwrap_or(wanted);
        let name = if name == "0" { "root" } else { name };
        let agent = Agent { socket: &sandbox.agent_socket, token: &sandbox.access_token };
        let script = format!(
            "while IFS=: read -r name _; do [ \"$name\" = {} ] && exit 0; done < /etc/passwd; exit 1",
            steps::quote(name)
        );
        match agent.shell(&script, "root", None, None).await {
            Ok(()) => {
                console.line("info", Some("base"), format!("The image's user {name} is the template's default user"));
                Some(name.to_string())
            }
            Err(_) => {
                console.line(
                    "info",
                    Some("base"),
                    format!("The image's user {wanted:?} has no account in it: commands run as the default user"),
                );
                None
            }
        }
    }
}

/// `Env` entries (`KEY=value`) as the template's envs; one without `=` is
/// an empty value, as Docker takes it.
fn image_envs(config: &ImageConfig) -> Vec<(String, String)> {
    config
        .env
        .iter()
        .filter(|e| !e.is_empty())
        .map(|e| match e.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => (e.clone(), String::new()),
        })
        .collect()
}

/// Awaits `work`, copying the progress lines it sends into the build log
/// as they come.
async fn logged<T, E>(
    work: impl Future<Output = Result<T, E>>,
    rx: &mut mpsc::UnboundedReceiver<String>,
    console: &mut Console<'_>,
) -> anyhow::Result<T>
where
    anyhow::Error: From<E>,
{
    tokio::pin!(work);
    let result = loop {
        tokio::select! {
            Some(line) = rx.recv() => console.line("info", Some("base"), line),
            result = &mut work => break result,
        }
    };
    while let Ok(line) = rx.try_recv() {
        console.line("info", Some("base"), line);
    }
    Ok(result?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_templates_are_named_by_digest() {
        let digest = format!("sha256:{}", "ab".repeat(32));
        assert_eq!(template_name(&digest), "image-abababababababab");
        assert!(is_image_template(&template_name(&digest)));
        assert!(!is_image_template("image-") && !is_image_template("image-x1") && !is_image_template("base"));
        copse_substrate::template::validate_name(&template_name(&digest)).unwrap();
    }

    #[test]
    fn env_entries_split_at_the_first_equals() {
        let config =
            ImageConfig { env: vec!["PATH=/a:/b".into(), "A=x=y".into(), "EMPTY".into()], ..Default::default() };
        assert_eq!(
            image_envs(&config),
            [("PATH".into(), "/a:/b".into()), ("A".into(), "x=y".into()), ("EMPTY".to_string(), String::new())]
        );
    }
}
