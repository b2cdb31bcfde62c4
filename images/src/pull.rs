//! Pulling an image: manifest (an index resolved to this host's platform),
//! config and layers, each checked against its digest, into the blob cache.

use std::path::PathBuf;

use anyhow::Context;
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};

use crate::Progress;
use crate::cache::BlobCache;
use crate::registries::Registries;

/// What an image's config asks of a container that copse carries over.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ImageConfig {
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    pub user: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
}

#[derive(Debug, Clone)]
pub struct Pulled {
    /// The reference as asked, normalised (`docker.io/library/debian:bookworm`).
    pub reference: String,
    /// The image manifest's digest (for an index: the platform's entry).
    pub digest: String,
    pub config: ImageConfig,
    /// Layer blobs in the cache, bottom first.
    pub layers: Vec<PathBuf>,
    /// Their digests, in the same order.
    pub layer_digests: Vec<String>,
    /// Blobs downloaded now, and blobs the cache already had.
    pub fetched: usize,
    pub cached: usize,
}

/// What a reference names, checked before anything is fetched: a
/// registry (with its port), a repository and a tag or digest, normalised
/// (`debian` → `docker.io/library/debian:latest`). Anything else a caller
/// might hope the client follows (a URL scheme, a host path, whitespace)
/// is refused here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    /// `docker.io`, `127.0.0.1:5000`, ...
    pub registry: String,
    pub repository: String,
    /// `docker.io/library/debian:bookworm`.
    pub whole: String,
}

pub fn parse_reference(reference: &str) -> anyhow::Result<ImageRef> {
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | '/' | ':' | '@');
    anyhow::ensure!(
        !reference.is_empty()
            && reference.chars().all(plain)
            && !reference.starts_with('/')
            && !reference.contains("//"),
        "{reference:?} is not an image reference (registry/repository:tag)"
    );
    let image: Reference = reference.parse().with_context(|| format!("{reference:?} is not an image reference"))?;
    Ok(ImageRef {
        registry: image.registry().to_string(),
        repository: image.repository().to_string(),
        whole: image.whole(),
    })
}

pub async fn pull(
    reference: &str,
    registries: &Registries,
    cache: &BlobCache,
    progress: Progress<'_>,
) -> anyhow::Result<Pulled> {
    // reqwest without a built-in provider: use ring, as the gateway's TLS
    // does. A second install (another pull, the TLS listener) is harmless.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut image: Reference = reference.parse().with_context(|| format!("{reference:?} is not an image reference"))?;
    let registry = image.registry().to_string();
    let host = match registries.mirror(&registry) {
        Some(mirror) => {
            image.set_mirror_registry(mirror.host.clone());
            progress(&format!("pulling {} through the mirror {}", image.whole(), mirror.host));
            mirror.host.clone()
        }
        None => {
            progress(&format!("pulling {}", image.whole()));
            image.resolve_registry().to_string()
        }
    };
    let client = Client::new(ClientConfig {
        protocol: ClientProtocol::HttpsExcept(registries.plain_http_hosts()),
        ..Default::default()
    });
    let auth = match registries.credential(&registry, &host) {
        Some(c) => RegistryAuth::Basic(c.username.clone(), c.password.clone()),
        None => RegistryAuth::Anonymous,
    };
    let (manifest, digest) = client
        .pull_image_manifest(&image, &auth)
        .await
        .with_context(|| format!("fetching the manifest of {} from {host}", image.whole()))?;
    progress(&format!("manifest {digest}: {} layer(s)", manifest.layers.len()));

    let mut pulled = Pulled {
        reference: image.whole(),
        digest,
        config: ImageConfig::default(),
        layers: Vec::new(),
        layer_digests: Vec::new(),
        fetched: 0,
        cached: 0,
    };
    let config_path = fetch(&client, &image, &manifest.config, cache, &mut pulled, progress, "config").await?;
    pulled.config = parse_config(&std::fs::read(&config_path)?)?;
    let count = manifest.layers.len();
    for (i, layer) in manifest.layers.iter().enumerate() {
        let path =
            fetch(&client, &image, layer, cache, &mut pulled, progress, &format!("[{}/{count}] layer", i + 1)).await?;
        pulled.layers.push(path);
        pulled.layer_digests.push(layer.digest.clone());
    }
    Ok(pulled)
}

async fn fetch(
    client: &Client,
    image: &Reference,
    blob: &OciDescriptor,
    cache: &BlobCache,
    pulled: &mut Pulled,
    progress: Progress<'_>,
    what: &str,
) -> anyhow::Result<PathBuf> {
    let path = cache.path(&blob.digest)?;
    if cache.has(&blob.digest)? {
        cache.touch(&blob.digest)?;
        pulled.cached += 1;
        progress(&format!("{what} {} cached", short(&blob.digest)));
        return Ok(path);
    }
    progress(&format!("{what} {} downloading ({})", short(&blob.digest), size(blob.size)));
    let partial = cache.partial(&blob.digest)?;
    let result = async {
        let file = tokio::fs::File::create(&partial).await?;
        // The client hashes the stream and fails on a digest mismatch.
        client.pull_blob(image, blob, file).await.with_context(|| format!("downloading {}", blob.digest))?;
        let written = tokio::fs::metadata(&partial).await?.len();
        anyhow::ensure!(
            blob.size < 0 || written == blob.size as u64,
            "{}: {written} bytes, the manifest says {}",
            blob.digest,
            blob.size
        );
        std::fs::File::open(&partial)?.sync_all()?;
        tokio::fs::rename(&partial, &path).await?;
        anyhow::Ok(())
    }
    .await;
    if result.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    result?;
    pulled.fetched += 1;
    progress(&format!("{what} {} verified", short(&blob.digest)));
    Ok(path)
}

fn short(digest: &str) -> &str {
    &digest[..digest.len().min(19)]
}

fn size(bytes: i64) -> String {
    if bytes >= 1 << 20 {
        format!("{:.1} MiB", bytes as f64 / 1048576.0)
    } else {
        format!("{} KiB", bytes.max(0) >> 10)
    }
}

fn parse_config(bytes: &[u8]) -> anyhow::Result<ImageConfig> {
    #[derive(serde::Deserialize, Default)]
    #[serde(rename_all = "PascalCase", default)]
    struct Inner {
        env: Option<Vec<String>>,
        working_dir: Option<String>,
        user: Option<String>,
        entrypoint: Option<Vec<String>>,
        cmd: Option<Vec<String>>,
    }
    #[derive(serde::Deserialize)]
    struct Outer {
        #[serde(default)]
        config: Option<Inner>,
    }
    let outer: Outer = serde_json::from_slice(bytes).context("parsing the image config")?;
    let inner = outer.config.unwrap_or_default();
    Ok(ImageConfig {
        env: inner.env.unwrap_or_default(),
        working_dir: inner.working_dir.filter(|w| !w.is_empty()),
        user: inner.user.filter(|u| !u.is_empty()),
        entrypoint: inner.entrypoint.unwrap_or_default(),
        cmd: inner.cmd.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_are_normalised_and_anything_else_refused() {
        let r = parse_reference("debian:bookworm").unwrap();
        assert_eq!((r.registry.as_str(), r.repository.as_str()), ("docker.io", "library/debian"));
        assert_eq!(r.whole, "docker.io/library/debian:bookworm");
        assert_eq!(parse_reference("127.0.0.1:5000/a/b:1").unwrap().registry, "127.0.0.1:5000");
        for bad in ["", "file:///etc/passwd", "/etc/passwd", "http://127.0.0.1:5000/a:1", "a b", "../../x", "Debian"] {
            assert!(parse_reference(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn image_config_fields_carry_over_and_nulls_are_empty() {
        let c = parse_config(br#"{"architecture":"amd64","config":{"Env":["PATH=/bin","A=1"],"WorkingDir":"/app","Cmd":null,"User":""}}"#)
            .unwrap();
        assert_eq!(c.env, ["PATH=/bin", "A=1"]);
        assert_eq!(c.working_dir.as_deref(), Some("/app"));
        assert!(c.user.is_none() && c.cmd.is_empty());
        assert_eq!(parse_config(b"{}").unwrap(), ImageConfig::default());
    }
}
