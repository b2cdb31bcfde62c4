//! The archives a copy step uploads: kept on the host, never unpacked
//! there, as `DATA_DIR/template-files/<template id>/<files hash>`. Both
//! names are checked (ids are ours, hashes hex), so a path is never built
//! from anything a caller chose freely; the directory is the gateway's own
//! (0700), not a sandbox's.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::PathBuf;

use bytes::Bytes;
use futures::{Stream, StreamExt};

use super::Sandboxes;
use crate::model::{Result, SandboxError, TemplateRecord, validate_files_hash};

/// The largest archive one copy may upload.
pub const MAX_UPLOAD_BYTES: u64 = 256 << 20;

impl Sandboxes {
    fn uploads_dir(&self, template_id: &str) -> PathBuf {
        self.template_files.join(template_id)
    }

    pub(super) fn upload_path(&self, template_id: &str, hash: &str) -> PathBuf {
        self.uploads_dir(template_id).join(hash)
    }

    pub(super) fn upload_present(&self, template_id: &str, hash: &str) -> bool {
        validate_files_hash(hash).is_ok() && self.upload_path(template_id, hash).is_file()
    }

    /// The upload link's `PUT`: the template is named by id and the link's
    /// token stands for the API key the SDK does not send with it.
    /// The node building template `id`, for an upload presenting its
    /// `token`; `None` for an unknown template or a wrong token (answered
    /// alike wherever they arrive), and on a single host.
    pub fn upload_node(&self, id: &str, token: &str) -> Result<Option<String>> {
        let record = self.store.template(id)?.filter(|r| copse_protocol::signature::equal(token, &r.upload_token));
        Ok(record.and_then(|r| r.node))
    }

    pub async fn accept_upload<S, E>(&self, id: &str, hash: &str, token: &str, mut body: S) -> Result<()>
    where
        S: Stream<Item = std::result::Result<Bytes, E>> + Unpin,
        E: std::fmt::Display,
    {
        validate_files_hash(hash)?;
        let record: Option<TemplateRecord> = self.store.template(id)?;
        let record = record
            .filter(|r| copse_protocol::signature::equal(token, &r.upload_token))
            .ok_or_else(|| SandboxError::TemplateNotFound(id.to_string()))?;
        let dir = self.uploads_dir(&record.id);
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir).map_err(anyhow::Error::from)?;
        let partial = dir.join(format!(".{hash}.{}", crate::model::new_id()));
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&partial)
            .map_err(anyhow::Error::from)?;
        let mut written = 0u64;
        let copied: Result<()> = async {
            while let Some(chunk) = body.next().await {
                let chunk = chunk.map_err(|e| SandboxError::Invalid(format!("reading the upload: {e}")))?;
                written += chunk.len() as u64;
                if written > MAX_UPLOAD_BYTES {
                    return Err(SandboxError::Invalid(format!(
                        "the upload is larger than {} MiB",
                        MAX_UPLOAD_BYTES >> 20
                    )));
                }
                file.write_all(&chunk).map_err(anyhow::Error::from)?;
            }
            file.sync_all().map_err(anyhow::Error::from)?;
            Ok(())
        }
        .await;
        let finished = copied.and_then(|()| {
            std::fs::rename(&partial, self.upload_path(&record.id, hash)).map_err(|e| anyhow::Error::from(e).into())
        });
        if finished.is_err() {
            let _ = std::fs::remove_file(&partial);
        }
        finished
    }

    pub(super) fn read_upload(&self, template_id: &str, hash: &str) -> Result<Vec<u8>> {
        validate_files_hash(hash)?;
        std::fs::read(self.upload_path(template_id, hash)).map_err(|e| anyhow::Error::from(e).into())
    }

    pub(super) fn remove_uploads(&self, template_id: &str) {
        let dir = self.uploads_dir(template_id);
        if let Err(e) = std::fs::remove_dir_all(&dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!("removing {}: {e}", dir.display());
        }
    }
}
