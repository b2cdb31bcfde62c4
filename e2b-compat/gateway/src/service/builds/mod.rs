//! Templates built through the SDK's `Template.build`: requesting a build,
//! the upload of a copy step's files, starting the build, its status and
//! log, finding and deleting built templates. The build itself (a real
//! sandbox running the steps, then a snapshot) is `run.rs`; the steps as
//! data and the shell they run, `steps.rs`; the per-step layer cache,
//! `cache.rs`; the start command and its ready wait (at the end of a
//! build, or at each create), `start.rs`; a base pulled from a registry,
//! `image.rs`; tags and public/private, `labels.rs`; the build log route,
//! `logs.rs`.

mod cache;
mod image;
mod image_gc;
pub mod labels;
pub mod logs;
mod run;
mod start;
pub mod steps;
mod uploads;

use std::sync::Arc;

use super::Sandboxes;
use crate::model::{
    Build, BuildStatus, Caller, Image, Result, SandboxError, TemplateRecord, new_id, new_token, new_uuid, now_ms,
    split_template_name, validate_files_hash,
};
pub(super) use image::template_name;
pub use image::{ImageSource, is_image_template};
pub use steps::RawStep;
pub use uploads::MAX_UPLOAD_BYTES;

/// The build's sizes when the SDK names none (E2B's defaults).
const DEFAULT_CPU_COUNT: u32 = 2;
const DEFAULT_MEMORY_MB: u32 = 1024;

/// What `POST /v2/templates/{id}/builds/{buildID}` asks for.
#[derive(Debug, Default)]
pub struct BuildSpec {
    pub from_template: Option<String>,
    pub from_image: Option<String>,
    pub steps: Vec<RawStep>,
    /// `skip_cache` on the whole build: no step comes from the cache.
    pub force: bool,
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
    /// `from_image(image, username=, password=)`: for this build's pull only.
    pub registry_login: Option<copse_images::Credential>,
}

/// What a build starts from.
#[derive(Debug, Clone)]
pub(super) enum Base {
    /// A template the substrate built (`base`, `code-interpreter-v1`).
    Substrate(String),
    /// One of the team's own built templates, by name.
    Built { name: String, image: Image },
    /// An image pulled from a registry (or the operator's mirror of it).
    Image { reference: copse_images::ImageRef, credential: Option<copse_images::Credential> },
}

impl Sandboxes {
    /// `POST /v3/templates`: a new build of the caller's template `name`
    /// (a new template, or the next build of one it has), waiting for its
    /// steps.
    pub async fn request_build(
        &self,
        caller: &Caller,
        name: &str,
        tags: &[String],
        cpu_count: Option<u32>,
        memory_mb: Option<u32>,
    ) -> Result<(TemplateRecord, crate::model::TemplateLabels, Vec<String>)> {
        self.refuse_on_a_front(&format!("a build of template {name:?}"))?;
        let tags = Self::build_tags(name, tags)?;
        let name = split_template_name(name)?;
        if crate::templates::is_shipped(&name) || self.templates().await?.iter().any(|t| t.name == name) {
            return Err(SandboxError::Invalid(format!("{name:?} is a template copse ships; choose another name")));
        }
        if self.store.snapshot(&caller.team, &name)?.is_some() {
            return Err(SandboxError::Invalid(format!("{name:?} names one of your snapshots; choose another name")));
        }
        let now = now_ms();
        let build = Build {
            id: new_uuid(),
            status: BuildStatus::Waiting,
            log: vec![],
            failure: None,
            created_at_ms: now,
            updated_at_ms: now,
            cpu_count: cpu_count.unwrap_or(DEFAULT_CPU_COUNT),
            memory_mb: memory_mb.unwrap_or(DEFAULT_MEMORY_MB),
        };
        let previous = self.store.template_named(&caller.team, &name)?;
        let record = match previous.clone() {
            Some(existing) if matches!(existing.build.status, BuildStatus::Building) => {
                return Err(SandboxError::Conflict(format!("template {name:?} is being built; wait for that build")));
            }
            Some(existing) => TemplateRecord {
                build,
                build_count: existing.build_count + 1,
                node: self.node().map(str::to_string),
                ..existing
            },
            None => TemplateRecord {
                id: new_id(),
                team: caller.team.clone(),
                name,
                created_at_ms: now,
                build,
                image: None,
                build_count: 1,
                upload_token: new_token(),
                node: self.node().map(str::to_string),
            },
        };
        self.store.put_template(&record)?;
        let labels = self.label_new_build(previous.as_ref(), &record, &tags)?;
        Ok((record, labels, tags))
    }

    /// `POST /v2/templates/{id}/builds/{buildID}`: checks the steps and the
    /// base, then runs the build in the background (the SDK polls its
    /// status).
    pub async fn start_build(
        self: &Arc<Self>,
        caller: &Caller,
        id: &str,
        build_id: &str,
        spec: BuildSpec,
    ) -> Result<()> {
        let mut record = self.built_template(caller, id)?;
        if record.build.id != build_id {
            return Err(SandboxError::TemplateNotFound(format!("{id} build {build_id}")));
        }
        if record.build.status != BuildStatus::Waiting {
            return Err(SandboxError::Conflict(format!("build {build_id} has already started")));
        }
        let steps = steps::parse(&spec.steps)?;
        // The SDK marks the step `skip_cache` was called before and every
        // one after it; the first such step decides.
        let forced_from = match spec.force {
            true => 0,
            false => spec.steps.iter().position(|s| s.force).unwrap_or(steps.len()),
        };
        let (base, note) = self.resolve_base(caller, &record, &spec)?;
        self.check_template_or_built(&base).await?;
        for step in &steps {
            if let steps::Step::Copy { hash, .. } = step
                && !self.upload_present(&record.id, hash)
            {
                return Err(SandboxError::Invalid(format!(
                    "the files of copy {hash} were never uploaded; upload them through the link first"
                )));
            }
        }
        record.build.status = BuildStatus::Building;
        record.build.updated_at_ms = now_ms();
        self.store.put_template(&record)?;
        let job = run::Job {
            caller: caller.clone(),
            record,
            base,
            base_note: note,
            steps,
            forced_from,
            start_cmd: spec.start_cmd.filter(|c| !c.trim().is_empty()),
            ready_cmd: spec.ready_cmd.filter(|c| !c.trim().is_empty()),
        };
        let svc = Arc::clone(self);
        tokio::spawn(async move {
            {
                let _building = svc.images.building().await;
                svc.run_build(job).await;
            }
            svc.collect_image_templates().await;
        });
        Ok(())
    }

    /// Where a build starts: `from_template` (copse's own or the team's
    /// built ones), or an image. Docker Hub's Debian and E2B's base image
    /// (the SDK's default `e2bdev/base`, `from_base_image`,
    /// `from_debian_image`) are copse's Debian `base` unless the operator
    /// mirrors Docker Hub: a host with no registry still builds them.
    /// The second value says which was chosen, for the build log.
    fn resolve_base(&self, caller: &Caller, record: &TemplateRecord, spec: &BuildSpec) -> Result<(Base, String)> {
        if let Some(from) = &spec.from_template {
            let name = split_template_name(from)?;
            if name == record.name {
                return Err(SandboxError::Invalid(format!("template {name:?} cannot be built from itself")));
            }
            if let Some(built) = self.store.template_named(&caller.team, &name)? {
                let image = built.image.ok_or_else(|| {
                    SandboxError::Invalid(format!("template {name:?} has no successful build to start from"))
                })?;
                return Ok((Base::Built { name: name.clone(), image }, format!("from your template {name}")));
            }
            return Ok((Base::Substrate(name.clone()), format!("from template {name}")));
        }
        let image = spec.from_image.as_deref().unwrap_or("e2bdev/base");
        let reference = copse_images::parse_reference(image).map_err(|e| SandboxError::Invalid(format!("{e:#}")))?;
        let mirror = self.images.registries().mirror(&reference.registry);
        let debian = reference.registry == "docker.io"
            && matches!(reference.repository.as_str(), "e2bdev/base" | "library/debian");
        if debian && mirror.is_none() && spec.registry_login.is_none() {
            return Ok((
                Base::Substrate("base".into()),
                format!(
                    "image {image} is built from copse's template base (Debian, built by debootstrap on this host): no mirror is configured for docker.io"
                ),
            ));
        }
        let via = match mirror {
            Some(m) => format!("through the mirror {}://{}", if m.plain_http { "http" } else { "https" }, m.host),
            None => format!("from {} over HTTPS", reference.registry),
        };
        let note = format!("from image {} pulled {via}", reference.whole);
        Ok((Base::Image { reference, credential: spec.registry_login.clone() }, note))
    }

    async fn check_template_or_built(&self, base: &Base) -> Result<()> {
        match base {
            Base::Substrate(name) => self.check_template(name, false).await,
            Base::Built { .. } | Base::Image { .. } => Ok(()),
        }
    }

    /// `GET /templates/{id}/builds/{buildID}/status`: the template with its
    /// latest build, if it is `build_id`.
    pub fn build_status(&self, caller: &Caller, id: &str, build_id: &str) -> Result<TemplateRecord> {
        let record = self.built_template(caller, id)?;
        if record.build.id != build_id {
            return Err(SandboxError::TemplateNotFound(format!("{id} build {build_id}")));
        }
        Ok(record)
    }

    /// The caller's built template by id or name; another team's is as
    /// missing as one that never existed.
    pub fn built_template(&self, caller: &Caller, id_or_name: &str) -> Result<TemplateRecord> {
        let by_id = self.store.template(id_or_name)?.filter(|t| caller.sees(&t.team));
        let found = match by_id {
            Some(found) => Some(found),
            None => match split_template_name(id_or_name) {
                Ok(name) => self.store.template_named(&caller.team, &name)?,
                Err(_) => None,
            },
        };
        found.ok_or_else(|| SandboxError::TemplateNotFound(id_or_name.to_string()))
    }

    /// The caller's built templates, oldest first.
    pub fn built_templates(&self, caller: &Caller) -> Result<Vec<TemplateRecord>> {
        let mut all: Vec<TemplateRecord> =
            self.store.built_templates()?.into_iter().filter(|t| caller.sees(&t.team)).collect();
        all.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        Ok(all)
    }

    /// Deletes the caller's built template `id_or_name` with its snapshot,
    /// uploads and the build cache layers no other template of the team
    /// uses; `false` if it has none of that id or name. Sandboxes created
    /// from it keep their files: the substrate removes a layer only once no
    /// sandbox stacks on it.
    pub async fn delete_built(&self, caller: &Caller, id_or_name: &str) -> Result<bool> {
        let record = match self.built_template(caller, id_or_name) {
            Ok(record) => record,
            Err(SandboxError::TemplateNotFound(_)) => return Ok(false),
            Err(e) => return Err(e),
        };
        let kept = self.template_labels(&record)?.kept_images;
        self.store.remove_template(&record.id)?;
        self.store.remove_template_labels(&record.id)?;
        self.remove_uploads(&record.id);
        if let Some(image) = record.image {
            self.forget_stored_images(std::slice::from_ref(&image)).await;
            self.blocking(move |s| s.delete_snapshot(&image.snapshot_key)).await?;
        }
        self.drop_images(kept.into_iter().map(|k| k.image).collect()).await;
        let collected = self.collect_layers(&record.team, &record.id).await?;
        tracing::info!(template = %record.id, collected, "deleted a built template and its unshared build layers");
        self.collect_image_templates().await;
        Ok(true)
    }

    /// Builds a restart interrupted can never finish: they end in error,
    /// so a poller stops and the name can be built again.
    pub fn fail_interrupted_builds(&self) -> Result<usize> {
        let mut failed = 0;
        for mut record in self.store.built_templates()? {
            // Another node's build runs on, on its own host.
            if matches!(record.build.status, BuildStatus::Building | BuildStatus::Waiting)
                && self.holds(record.node.as_deref())
            {
                record.build.status = BuildStatus::Error;
                record.build.failure = Some(crate::model::BuildFailure {
                    message: "the build was interrupted by a gateway restart; build again".into(),
                    step: None,
                });
                self.store.put_template(&record)?;
                failed += 1;
            }
        }
        Ok(failed)
    }

    /// `GET /templates/{id}/files/{hash}`: whether the files are already
    /// here, and the token the upload link carries.
    pub fn upload_link(&self, caller: &Caller, id: &str, hash: &str) -> Result<(bool, TemplateRecord)> {
        validate_files_hash(hash)?;
        let record = self.built_template(caller, id)?;
        Ok((self.upload_present(&record.id, hash), record))
    }
}
