//! One bucket of an S3-compatible store, named as the operator gives it:
//! `s3://bucket` (AWS, region from `AWS_REGION`) or
//! `http(s)://host:port/bucket` (any other store, path-style). The keys
//! come from `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY`, never from a
//! command line, where any local user could read them.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path;
use object_store::{ClientOptions, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig};

/// Where a bucket is and how to sign for it.
#[derive(Clone, PartialEq, Eq)]
pub struct BucketConfig {
    /// `None` for AWS itself.
    pub endpoint: Option<String>,
    pub bucket: String,
    pub region: String,
    pub key_id: Option<String>,
    pub secret: Option<String>,
}

impl std::fmt::Debug for BucketConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BucketConfig")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("region", &self.region)
            .field("key_id", &self.key_id)
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl BucketConfig {
    /// `url` as the operator wrote it; keys and region from `env`.
    pub fn parse(url: &str, env: impl Fn(&str) -> Option<String>) -> anyhow::Result<Self> {
        let (endpoint, bucket) = if let Some(bucket) = url.strip_prefix("s3://") {
            (None, bucket.trim_end_matches('/'))
        } else if let Some((scheme, rest)) = url.split_once("://")
            && matches!(scheme, "http" | "https")
        {
            let (host, bucket) = rest
                .split_once('/')
                .with_context(|| format!("object store {url:?} names no bucket: write {scheme}://HOST:PORT/BUCKET"))?;
            (Some(format!("{scheme}://{host}")), bucket.trim_end_matches('/'))
        } else {
            bail!("object store {url:?} is neither s3://BUCKET nor http(s)://HOST:PORT/BUCKET");
        };
        // S3's bucket naming rule, which also keeps the name one path segment.
        let valid = (3..=63).contains(&bucket.len())
            && bucket.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
            && !bucket.starts_with(['-', '.'])
            && !bucket.ends_with(['-', '.']);
        if !valid {
            bail!("object store bucket {bucket:?} is not an S3 bucket name (3-63 of a-z 0-9 . -)");
        }
        let (key_id, secret) = (env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY"));
        if key_id.is_some() != secret.is_some() {
            bail!("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY go together: set both or neither");
        }
        Ok(Self {
            endpoint,
            bucket: bucket.to_string(),
            region: env("AWS_REGION").unwrap_or_else(|| "us-east-1".into()),
            key_id,
            secret,
        })
    }

    /// The address as an operator reads it in a message.
    pub fn display(&self) -> String {
        match &self.endpoint {
            Some(endpoint) => format!("{endpoint}/{}", self.bucket),
            None => format!("s3://{}", self.bucket),
        }
    }
}

/// One object of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub key: String,
    pub size: u64,
    /// When it was last written, in ms since the epoch.
    pub modified_ms: i64,
}

pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// An open bucket. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Bucket {
    store: Arc<dyn ObjectStore>,
    name: String,
}

/// How long a store that does not answer holds a caller: a few quick
/// retries, then a clear error (the library's default waits minutes).
const RETRY: RetryConfig = RetryConfig {
    backoff: object_store::BackoffConfig {
        init_backoff: Duration::from_millis(100),
        max_backoff: Duration::from_secs(2),
        base: 2.0,
    },
    max_retries: 3,
    retry_timeout: Duration::from_secs(15),
};

impl Bucket {
    pub fn open(config: &BucketConfig) -> anyhow::Result<Self> {
        // reqwest is built without a default TLS provider (as the rest of
        // copse, ring); installing it twice is harmless.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut builder = AmazonS3Builder::new()
            .with_bucket_name(&config.bucket)
            .with_region(&config.region)
            .with_retry(RETRY)
            .with_client_options(
                ClientOptions::new()
                    .with_connect_timeout(Duration::from_secs(5))
                    .with_timeout(Duration::from_secs(120)),
            );
        if let Some(endpoint) = &config.endpoint {
            builder = builder
                .with_endpoint(endpoint)
                .with_allow_http(endpoint.starts_with("http://"))
                .with_virtual_hosted_style_request(false);
        }
        if let (Some(id), Some(secret)) = (&config.key_id, &config.secret) {
            builder = builder.with_access_key_id(id).with_secret_access_key(secret);
        } else {
            builder = builder.with_skip_signature(true);
        }
        let store = builder.build().with_context(|| format!("object store {}", config.display()))?;
        Ok(Self { store: Arc::new(store), name: config.display() })
    }

    /// Its address as the operator gave it (no keys): what another process
    /// opens it again from, with the same environment.
    pub fn address(&self) -> &str {
        &self.name
    }

    /// Whether `key` exists.
    pub async fn has(&self, key: &str) -> anyhow::Result<bool> {
        self.has_recent(key, Duration::MAX).await
    }

    /// Whether `key` exists and was written less than `within` ago.
    pub async fn has_recent(&self, key: &str, within: Duration) -> anyhow::Result<bool> {
        match self.store.head(&Path::from(key)).await {
            Ok(meta) => {
                let within_ms = i64::try_from(within.as_millis()).unwrap_or(i64::MAX);
                Ok(meta.last_modified.timestamp_millis() > now_ms().saturating_sub(within_ms))
            }
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.failed("looking up", key, e)),
        }
    }

    /// Every object in the bucket.
    pub async fn list(&self) -> anyhow::Result<Vec<Stored>> {
        use futures::TryStreamExt;
        let listed: Vec<object_store::ObjectMeta> =
            self.store.list(None).try_collect().await.map_err(|e| self.failed("listing", "", e))?;
        Ok(listed
            .into_iter()
            .map(|meta| Stored {
                key: meta.location.to_string(),
                size: meta.size,
                modified_ms: meta.last_modified.timestamp_millis(),
            })
            .collect())
    }

    pub async fn put(&self, key: &str, bytes: Bytes) -> anyhow::Result<()> {
        self.store.put(&Path::from(key), PutPayload::from(bytes)).await.map_err(|e| self.failed("writing", key, e))?;
        Ok(())
    }

    /// `key`'s bytes, or `None` when it does not exist.
    pub async fn get(&self, key: &str) -> anyhow::Result<Option<Bytes>> {
        let got = match self.store.get(&Path::from(key)).await {
            Ok(got) => got,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(self.failed("reading", key, e)),
        };
        Ok(Some(got.bytes().await.map_err(|e| self.failed("reading", key, e))?))
    }

    /// Removes `key`; one already gone is not an error.
    pub async fn delete(&self, key: &str) -> anyhow::Result<()> {
        match self.store.delete(&Path::from(key)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.failed("deleting", key, e)),
        }
    }

    fn failed(&self, doing: &str, key: &str, error: object_store::Error) -> anyhow::Error {
        anyhow::anyhow!("object store {}: {doing} {key}: {error}", self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    }

    #[test]
    fn endpoints_and_buckets_are_read_from_the_url() {
        let keys = env(&[("AWS_ACCESS_KEY_ID", "id"), ("AWS_SECRET_ACCESS_KEY", "sec")]);
        let local = BucketConfig::parse("http://127.0.0.1:8333/copse-objects/", &keys).unwrap();
        assert_eq!(local.endpoint.as_deref(), Some("http://127.0.0.1:8333"));
        assert_eq!(local.bucket, "copse-objects");
        assert_eq!((local.key_id.as_deref(), local.region.as_str()), (Some("id"), "us-east-1"));
        assert_eq!(local.display(), "http://127.0.0.1:8333/copse-objects");
        let aws = BucketConfig::parse("s3://my.bucket", env(&[("AWS_REGION", "eu-west-1")])).unwrap();
        assert_eq!((aws.endpoint, aws.region.as_str(), aws.key_id), (None, "eu-west-1", None));
    }

    #[test]
    fn bad_urls_and_half_a_key_are_refused() {
        let none = env(&[]);
        for url in ["ftp://h/b", "http://h:1", "http://h/../x", "http://h/a/b", "s3://UPPER", "s3://ab", "s3://-x-"] {
            assert!(BucketConfig::parse(url, &none).is_err(), "{url} must be refused");
        }
        let half = env(&[("AWS_ACCESS_KEY_ID", "id")]);
        assert!(BucketConfig::parse("s3://bucket", half).unwrap_err().to_string().contains("go together"));
    }

    #[test]
    fn debug_never_shows_the_secret() {
        let keys = env(&[("AWS_ACCESS_KEY_ID", "id"), ("AWS_SECRET_ACCESS_KEY", "sec-value")]);
        let config = BucketConfig::parse("s3://bucket", keys).unwrap();
        assert!(!format!("{config:?}").contains("sec-value"));
    }
}
