//! Where images come from: the operator's mirror map (`docker.io=http://
//! 127.0.0.1:5000`) and registry credentials.
//!
//! Plain HTTP is used only for a mirror the operator named with an
//! `http://` URL; every other registry is reached over HTTPS.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, bail};
use base64::Engine;

/// A registry served from another address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mirror {
    /// `host[:port]` requests go to instead.
    pub host: String,
    pub plain_http: bool,
}

#[derive(Clone, PartialEq, Eq)]
pub struct Credential {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credential({}, <password>)", self.username)
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Registries {
    /// Keyed by the registry as references name it (`docker.io`, `ghcr.io`).
    mirrors: BTreeMap<String, Mirror>,
    /// Keyed by registry or mirror host.
    credentials: BTreeMap<String, Credential>,
}

impl Registries {
    /// Parses repeated `REGISTRY=URL` settings (`docker.io=http://127.0.0.1:5000`).
    pub fn with_mirrors(specs: &[String]) -> anyhow::Result<Self> {
        let mut out = Self::default();
        for spec in specs {
            let (registry, mirror) = parse_mirror(spec)?;
            out.mirrors.insert(registry, mirror);
        }
        Ok(out)
    }

    /// Reads credentials from a Docker/Podman-style auth file
    /// (`{"auths": {"REGISTRY": {"auth": base64("user:password")}}}`, or
    /// `username`/`password` fields).
    pub fn with_auth_file(mut self, path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        self.credentials.extend(parse_auth_file(&text).with_context(|| format!("parsing {}", path.display()))?);
        Ok(self)
    }

    /// Adds the credentials a build request carries for `registry` (and
    /// its mirror, if it has one), ahead of the operator's: the requester
    /// named them for this image.
    pub fn with_credential(mut self, registry: &str, credential: Credential) -> Self {
        if let Some(mirror) = self.mirror(registry) {
            self.credentials.insert(mirror.host.clone(), credential.clone());
        }
        self.credentials.insert(canonical(registry), credential);
        self
    }

    pub fn mirror(&self, registry: &str) -> Option<&Mirror> {
        self.mirrors.get(&canonical(registry))
    }

    pub fn mirrors(&self) -> impl Iterator<Item = (&String, &Mirror)> {
        self.mirrors.iter()
    }

    /// Credentials for a pull from `registry` through `host`: the mirror's
    /// own first, then the registry's.
    pub fn credential(&self, registry: &str, host: &str) -> Option<&Credential> {
        self.credentials.get(host).or_else(|| self.credentials.get(&canonical(registry)))
    }

    /// Hosts reached over plain HTTP.
    pub fn plain_http_hosts(&self) -> Vec<String> {
        self.mirrors.values().filter(|m| m.plain_http).map(|m| m.host.clone()).collect()
    }
}

/// Docker Hub goes by several names; references resolve to `index.docker.io`.
fn canonical(registry: &str) -> String {
    match registry {
        "index.docker.io" | "registry-1.docker.io" | "docker.io" => "docker.io".into(),
        other => other.to_ascii_lowercase(),
    }
}

pub fn parse_mirror(spec: &str) -> anyhow::Result<(String, Mirror)> {
    let Some((registry, url)) = spec.split_once('=') else {
        bail!("registry mirror {spec:?}: expected REGISTRY=URL, e.g. docker.io=http://127.0.0.1:5000");
    };
    let (plain_http, rest) = if let Some(rest) = url.strip_prefix("http://") {
        (true, rest)
    } else if let Some(rest) = url.strip_prefix("https://") {
        (false, rest)
    } else {
        bail!("registry mirror {spec:?}: the URL must start with http:// or https://");
    };
    let host = rest.trim_end_matches('/');
    let valid = |s: &str| {
        !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '[' | ']'))
    };
    if !valid(registry) || !valid(host) {
        bail!("registry mirror {spec:?}: a registry and a mirror are host[:port], with no path");
    }
    Ok((canonical(registry), Mirror { host: host.to_ascii_lowercase(), plain_http }))
}

fn parse_auth_file(text: &str) -> anyhow::Result<BTreeMap<String, Credential>> {
    #[derive(serde::Deserialize)]
    struct File {
        #[serde(default)]
        auths: BTreeMap<String, Entry>,
    }
    #[derive(serde::Deserialize)]
    struct Entry {
        auth: Option<String>,
        username: Option<String>,
        password: Option<String>,
    }
    let file: File = serde_json::from_str(text)?;
    let mut out = BTreeMap::new();
    for (registry, entry) in file.auths {
        let credential = match (entry.auth, entry.username, entry.password) {
            (Some(auth), _, _) => {
                let plain =
                    base64::engine::general_purpose::STANDARD.decode(auth.trim()).context("auth is not base64")?;
                let plain = String::from_utf8(plain).context("auth is not UTF-8")?;
                let (username, password) = plain.split_once(':').context("auth is not user:password")?;
                Credential { username: username.into(), password: password.into() }
            }
            (None, Some(username), Some(password)) => Credential { username, password },
            _ => bail!("{registry}: needs auth, or username and password"),
        };
        // Entries may be written as URLs (`https://index.docker.io/v1/`).
        let host = registry.trim_start_matches("https://").trim_start_matches("http://");
        let host = host.split('/').next().unwrap_or(host);
        out.insert(canonical(host), credential);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mirrors_parse_and_only_http_urls_are_plain() {
        let r = Registries::with_mirrors(&[
            "docker.io=http://127.0.0.1:5000/".into(),
            "ghcr.io=https://mirror.example:8443".into(),
        ])
        .unwrap();
        assert_eq!(r.mirror("index.docker.io").unwrap(), &Mirror { host: "127.0.0.1:5000".into(), plain_http: true });
        assert!(!r.mirror("ghcr.io").unwrap().plain_http);
        assert_eq!(r.plain_http_hosts(), ["127.0.0.1:5000"]);
        assert!(r.mirror("quay.io").is_none());
    }

    #[test]
    fn malformed_mirrors_are_refused() {
        for bad in ["docker.io", "docker.io=127.0.0.1:5000", "docker.io=http://h/path", "=http://h", "a b=http://h"] {
            assert!(parse_mirror(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn auth_files_in_docker_form_give_credentials() {
        let text = r#"{"auths": {
            "https://index.docker.io/v1/": {"auth": "dXNlcjpwYTpzcw=="},
            "127.0.0.1:5000": {"username": "u", "password": "p"}}}"#;
        let creds = parse_auth_file(text).unwrap();
        assert_eq!(creds["docker.io"], Credential { username: "user".into(), password: "pa:ss".into() });
        let r = Registries { credentials: creds, ..Default::default() };
        assert_eq!(r.credential("docker.io", "127.0.0.1:5000").unwrap().username, "u");
        assert_eq!(r.credential("index.docker.io", "mirror:1").unwrap().username, "user");
        assert!(!format!("{:?}", r).contains("pa:ss"));
    }

    #[test]
    fn a_requests_credential_wins_for_its_registry_and_mirror() {
        let text = r#"{"auths": {"127.0.0.1:5000": {"username": "operator", "password": "p"}}}"#;
        let r = Registries { credentials: parse_auth_file(text).unwrap(), ..Default::default() };
        let r = Registries {
            mirrors: Registries::with_mirrors(&["r.test=http://127.0.0.1:5000".into()]).unwrap().mirrors,
            ..r
        };
        let asked = Credential { username: "asker".into(), password: "q".into() };
        let r = r.with_credential("r.test", asked.clone());
        assert_eq!(r.credential("r.test", "127.0.0.1:5000"), Some(&asked));
        assert!(r.credential("other.test", "other.test").is_none());
    }
}
