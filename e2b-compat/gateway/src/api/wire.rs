//! The E2B control plane's JSON shapes, exactly as the official SDKs send
//! and expect them. Nothing outside `api` sees these types.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

/// Body of `POST /v2/sandboxes` (and the v1 `POST /sandboxes`).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: Option<String>,
    pub timeout: Option<i64>,
    #[serde(default)]
    pub metadata: Option<HashMap<String, String>>,
    #[serde(default)]
    pub env_vars: Option<HashMap<String, String>>,
    pub auto_pause: Option<bool>,
    pub auto_pause_memory: Option<bool>,
    pub auto_resume: Option<AutoResume>,
    /// Snake case on the wire, unlike every other key.
    #[serde(rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
    pub secure: Option<bool>,
    pub network: Option<NetworkConfig>,
    #[serde(default)]
    pub volume_mounts: Option<Vec<VolumeMount>>,
    // Read only to be refused when set (`NewSandbox::unsupported`).
    mcp: Option<serde_json::Value>,
    iam: Option<serde_json::Value>,
}

impl NewSandbox {
    /// The first field the caller set that copse does not implement: the
    /// caller gets a 400 naming it rather than a sandbox without it.
    pub fn unsupported(&self) -> Option<&'static str> {
        let own = [("mcp", &self.mcp), ("iam", &self.iam)];
        own.into_iter().find(|(_, value)| is_set(value)).map(|(name, _)| name)
    }
}

/// `network` of the create body, and the body of `PUT /sandboxes/{id}/network`
/// (which also carries `allow_internet_access`).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkConfig {
    pub allow_out: Option<Vec<String>>,
    pub deny_out: Option<Vec<String>>,
    pub dns_servers: Option<Vec<String>>,
    #[serde(rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
    /// `false`: requests to the sandbox's ports need its traffic token.
    /// Only read on create, as E2B does.
    pub allow_public_traffic: Option<bool>,
    /// The `Host` the sandbox's servers are handed. Only read on create,
    /// as E2B does.
    pub mask_request_host: Option<String>,
    pub egress_proxy: Option<EgressProxyConfig>,
    /// Ports whose servers speak TLS. Only read on create, as E2B does;
    /// any integer is read so that a bad one gets a 400 naming the field.
    pub https_ports: Option<Vec<i64>>,
    pub rules: Option<NetworkRules>,
}

/// `network.rules`: per host (a name, `*.` wildcard, address or CIDR
/// block), the ordered rules for requests to it.
pub type NetworkRules = BTreeMap<String, Vec<NetworkRule>>;

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transform: Option<NetworkTransform>,
}

/// Header values may hold `${e2b.secrets.<name>}` placeholders, which
/// stay placeholders everywhere but in the egress proxy.
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkTransform {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<BTreeMap<String, String>>,
}

/// `network.egressProxy`: a SOCKS5 upstream. `Debug` leaves the password out.
#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EgressProxyConfig {
    pub address: String,
    pub username: Option<String>,
    pub password: Option<String>,
    pub tls: Option<EgressProxyTls>,
}

/// `network.egressProxy.tls`. `enabled: false` asks for no TLS, and then
/// the other fields may not be set.
#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EgressProxyTls {
    pub enabled: bool,
    pub server_name: Option<String>,
    pub ca_cert: Option<String>,
}

impl std::fmt::Debug for EgressProxyConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EgressProxyConfig")
            .field("address", &self.address)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("tls", &self.tls.as_ref().map(|t| (t.enabled, &t.server_name)))
            .finish()
    }
}

/// `network` of the sandbox info (the SDK's `SandboxInfo.network`), as far
/// as copse reports it: the ingress settings fixed at create, and the SOCKS5
/// upstream without its password (E2B never returns it either).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkInfo {
    pub allow_public_traffic: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mask_request_host: Option<String>,
    /// Left out when none was asked for, as the SDK reads a missing list.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub https_ports: Vec<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub egress_proxy: Option<EgressProxyInfo>,
    /// Left out when it is E2B's default (the SDK reads a missing list as
    /// `8.8.8.8`); `[]` is "no server" and is sent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dns_servers: Option<Vec<String>>,
    /// As asked for: placeholders, never the secrets' values.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rules: Option<NetworkRules>,
}

#[derive(Debug, Serialize)]
pub struct EgressProxyInfo {
    pub address: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<EgressProxyTlsInfo>,
}

/// As asked for, without the CA certificate (E2B never returns it).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EgressProxyTlsInfo {
    pub enabled: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
}

/// Whether the caller asked for something: SDKs send `null`, `[]` or `{}`
/// for an option left at its default, and those ask for nothing.
fn is_set(value: &Option<serde_json::Value>) -> bool {
    match value {
        None | Some(serde_json::Value::Null) => false,
        Some(serde_json::Value::Array(items)) => !items.is_empty(),
        Some(serde_json::Value::Object(fields)) => !fields.is_empty(),
        Some(_) => true,
    }
}

#[derive(Debug, Default, Deserialize)]
pub struct AutoResume {
    #[serde(default)]
    pub enabled: bool,
}

/// Body of connect (v1 and v2) and of the older `/resume`.
#[derive(Debug, Default, Deserialize)]
pub struct ConnectBody {
    pub timeout: Option<i64>,
    /// `false`: start afresh from the files even if memory was kept.
    pub memory: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
pub struct PauseBody {
    pub memory: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
pub struct SnapshotRequest {
    pub name: Option<String>,
    pub memory: Option<bool>,
}

#[derive(Debug, Serialize)]
pub struct SnapshotInfo {
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    pub names: Vec<String>,
}

/// Query of `GET /snapshots`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotsQuery {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: Option<String>,
    pub name: Option<String>,
    pub limit: Option<usize>,
    pub next_token: Option<String>,
}

/// Body of fork (E2B) and clone (copse).
#[derive(Debug, Default, Deserialize)]
pub struct ForkRequest {
    pub timeout: Option<i64>,
    pub count: Option<u32>,
    /// Carry the source's memory and processes into the children. E2B's
    /// fork does where the substrate can; copse's clone only when asked.
    pub memory: Option<bool>,
}

/// One child of a fork: the sandbox or why it failed.
#[derive(Debug, Serialize)]
pub struct ForkResult {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<Sandbox>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<serde_json::Value>,
}

#[derive(Debug, Default, Deserialize)]
pub struct RollbackRequest {
    #[serde(rename = "snapshotID")]
    pub snapshot_id: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub struct TimeoutBody {
    pub timeout: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
pub struct RefreshBody {
    pub duration: Option<i64>,
}

/// Reply to create and connect.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Sandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    pub envd_version: String,
    pub envd_access_token: String,
    pub traffic_access_token: Option<String>,
    pub domain: Option<String>,
    pub alias: Option<String>,
}

/// One entry of the list endpoints; also the base of `SandboxDetail`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ListedSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    pub alias: Option<String>,
    pub started_at: String,
    pub end_at: String,
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    pub state: &'static str,
    pub envd_version: String,
    pub metadata: HashMap<String, String>,
    pub volume_mounts: Vec<VolumeMount>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxDetail {
    #[serde(flatten)]
    pub listed: ListedSandbox,
    pub envd_access_token: String,
    pub allow_internet_access: bool,
    pub domain: Option<String>,
    pub lifecycle: Lifecycle,
    pub network: NetworkInfo,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Lifecycle {
    pub auto_resume: bool,
    pub on_timeout: &'static str,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxMetric {
    pub timestamp: String,
    pub timestamp_unix: i64,
    pub cpu_count: u32,
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

/// Query of `GET /sandboxes/{id}/metrics`: Unix seconds.
#[derive(Debug, Default, Deserialize)]
pub struct MetricsQuery {
    pub start: Option<i64>,
    pub end: Option<i64>,
}

/// Query of `GET /sandboxes/metrics`: comma-separated ids.
#[derive(Debug, Default, Deserialize)]
pub struct ManyMetricsQuery {
    pub sandbox_ids: Option<String>,
}

impl ManyMetricsQuery {
    /// The ids named, sorted, each once.
    pub fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .sandbox_ids
            .as_deref()
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }
}

/// Reply to `GET /sandboxes/metrics`: the newest sample per sandbox id.
#[derive(Debug, Serialize)]
pub struct SandboxesWithMetrics {
    pub sandboxes: std::collections::BTreeMap<String, SandboxMetric>,
}

/// Query of the older `GET /sandboxes/{id}/logs`.
#[derive(Debug, Default, Deserialize)]
pub struct LogsQuery {
    /// Unix milliseconds.
    pub start: Option<i64>,
    pub limit: Option<usize>,
}

/// Query of `GET /v2/sandboxes/{id}/logs`.
#[derive(Debug, Default, Deserialize)]
pub struct LogsV2Query {
    /// Unix milliseconds.
    pub cursor: Option<i64>,
    pub limit: Option<usize>,
    /// `forward` (the default) or `backward`.
    pub direction: Option<String>,
    /// The least severe level returned: debug, info, warn, error.
    pub level: Option<String>,
    pub search: Option<String>,
}

/// One line of the older logs reply.
#[derive(Debug, Serialize)]
pub struct SandboxLog {
    pub timestamp: String,
    pub line: String,
}

#[derive(Debug, Serialize)]
pub struct SandboxLogEntry {
    pub timestamp: String,
    pub message: String,
    pub level: &'static str,
    pub fields: std::collections::BTreeMap<String, String>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxLogs {
    pub logs: Vec<SandboxLog>,
    pub log_entries: Vec<SandboxLogEntry>,
}

#[derive(Debug, Serialize)]
pub struct SandboxLogsV2 {
    pub logs: Vec<SandboxLogEntry>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Template {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "buildID")]
    pub build_id: String,
    pub aliases: Vec<String>,
    pub public: bool,
    pub created_at: String,
    pub size_bytes: u64,
}

/// Query of `GET /v2/sandboxes`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListQuery {
    pub metadata: Option<String>,
    pub state: Option<String>,
    pub limit: Option<usize>,
    pub next_token: Option<String>,
    pub template: Option<String>,
}

/// The SDK percent-encodes each key and value, joins them as a query
/// string, and sends that as one parameter (which the HTTP layer decodes
/// once): so parse it as a query string and decode each part once more.
pub fn decode_metadata_filter(raw: &str) -> HashMap<String, String> {
    url::form_urlencoded::parse(raw.as_bytes()).map(|(k, v)| (percent_decode(&k), percent_decode(&v))).collect()
}

fn percent_decode(s: &str) -> String {
    url::form_urlencoded::parse(format!("x={}", s.replace('+', "%2B")).as_bytes())
        .next()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_default()
}

/// One entry of `volumeMounts`, in a create body and in a sandbox's
/// detail: a volume (by name) and where it appears.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeMount {
    pub name: String,
    pub path: String,
}

/// Body of `POST /volumes`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewVolume {
    pub name: String,
}

/// An entry of `GET /volumes`.
#[derive(Debug, Serialize)]
pub struct VolumeInfo {
    #[serde(rename = "volumeID")]
    pub volume_id: String,
    pub name: String,
}

/// Reply to `POST /volumes` and `GET /volumes/{id}`: with the token the
/// volume's content API demands.
#[derive(Debug, Serialize)]
pub struct VolumeAndToken {
    #[serde(rename = "volumeID")]
    pub volume_id: String,
    pub name: String,
    pub token: String,
}

/// Body of `POST /secrets`.
#[derive(Debug, Deserialize)]
pub struct NewSecret {
    pub name: String,
    pub value: String,
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
}

/// Body of `POST /secrets/{id}`: a new version.
#[derive(Debug, Deserialize)]
pub struct SecretUpdate {
    pub value: String,
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
}

/// Query of `GET /secrets`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SecretsQuery {
    pub limit: Option<usize>,
    pub next_token: Option<String>,
}

/// What every secrets route answers: never a value.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SecretInfo {
    #[serde(rename = "secretID")]
    pub secret_id: String,
    pub name: String,
    pub current_version: u32,
    pub metadata: BTreeMap<String, String>,
    pub created_at: String,
    pub updated_at: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_filter_is_decoded_twice() {
        // What the SDK sends for {"k": "v", "a b": "x&y"} after httpx has
        // been undone by the HTTP layer.
        let filter = decode_metadata_filter("k=v&a%2520b=x%2526y");
        assert_eq!(filter.get("k").map(String::as_str), Some("v"));
        assert_eq!(filter.get("a b").map(String::as_str), Some("x&y"));
    }

    #[test]
    fn create_body_accepts_what_the_sdk_sends() {
        let body = r#"{"templateID":"base","timeout":30,"autoPause":false,"allow_internet_access":false,
            "metadata":{"a":"b"},"envVars":{"X":"1"},"volumeMounts":[],"network":{"allowOut":[]}}"#;
        let parsed: NewSandbox = serde_json::from_str(body).unwrap();
        assert_eq!(parsed.template_id.as_deref(), Some("base"));
        assert_eq!(parsed.timeout, Some(30));
        assert_eq!(parsed.allow_internet_access, Some(false));
        assert_eq!(parsed.env_vars.unwrap()["X"], "1");
    }

    #[test]
    fn volume_mounts_are_read_and_their_unknown_fields_refused() {
        let parsed: NewSandbox =
            serde_json::from_str(r#"{"volumeMounts":[{"name":"data","path":"/mnt/data"}]}"#).unwrap();
        let mounts = parsed.volume_mounts.unwrap();
        assert_eq!((mounts[0].name.as_str(), mounts[0].path.as_str()), ("data", "/mnt/data"));
        let extra = r#"{"volumeMounts":[{"name":"data","path":"/mnt","readOnly":true}]}"#;
        assert!(serde_json::from_str::<NewSandbox>(extra).is_err());
        assert!(serde_json::from_str::<NewVolume>(r#"{"name":"v","size":1}"#).is_err());
    }

    #[test]
    fn create_body_carries_allow_public_traffic_in_network() {
        let body = r#"{"templateID":"base","network":{"allowPublicTraffic":false}}"#;
        let parsed: NewSandbox = serde_json::from_str(body).unwrap();
        assert_eq!(parsed.network.unwrap().allow_public_traffic, Some(false));
        let body = r#"{"network":{"maskRequestHost":"${PORT}-app.example.com"}}"#;
        let parsed: NewSandbox = serde_json::from_str(body).unwrap();
        assert_eq!(parsed.unsupported(), None);
        assert_eq!(parsed.network.unwrap().mask_request_host.as_deref(), Some("${PORT}-app.example.com"));
    }

    #[test]
    fn fields_copse_does_not_implement_are_named_when_set() {
        let refused = |body: &str| serde_json::from_str::<NewSandbox>(body).unwrap().unsupported();
        assert_eq!(refused(r#"{"volumeMounts":[{"name":"v","path":"/mnt"}]}"#), None);
        assert_eq!(refused(r#"{"mcp":{"github":{}}}"#), Some("mcp"));
        assert_eq!(refused(r#"{"iam":{"tokens":{"t":{}}}}"#), Some("iam"));
        let rules = r#"{"network":{"rules":{"api.example.com":[{"transform":{"headers":{"X-Key":"k"}}}]}}}"#;
        assert_eq!(refused(rules), None);
        assert!(serde_json::from_str::<NewSandbox>(r#"{"network":{"rules":{"a.test":[{"match":{}}]}}}"#).is_err());
        assert_eq!(refused(r#"{"network":{"egressProxy":{"address":"p:1080","tls":{"enabled":true}}}}"#), None);
        assert_eq!(refused(r#"{"network":{"egressProxy":{"address":"p:1080","tls":null}}}"#), None);
        let unknown = r#"{"network":{"egressProxy":{"address":"p:1080","tls":{"enabled":true,"x":1}}}}"#;
        assert!(serde_json::from_str::<NewSandbox>(unknown).is_err(), "unknown tls fields are refused");
        let tls =
            r#"{"network":{"egressProxy":{"address":"p:1","tls":{"enabled":true,"serverName":"s","caCert":"c"}}}}"#;
        let tls = serde_json::from_str::<NewSandbox>(tls).unwrap().network.unwrap().egress_proxy.unwrap().tls.unwrap();
        assert_eq!((tls.enabled, tls.server_name.as_deref(), tls.ca_cert.as_deref()), (true, Some("s"), Some("c")));
        assert_eq!(refused(r#"{"network":{"httpsPorts":[8443]}}"#), None);
    }

    #[test]
    fn defaults_sdks_send_for_unimplemented_fields_ask_for_nothing() {
        let body = r#"{"volumeMounts":[],"mcp":null,"network":{"allowOut":["1.1.1.1"],"rules":{},"egressProxy":null}}"#;
        assert_eq!(serde_json::from_str::<NewSandbox>(body).unwrap().unsupported(), None);
    }

    #[test]
    fn listed_sandbox_uses_the_sdks_key_names() {
        let listed = ListedSandbox {
            template_id: "base".into(),
            sandbox_id: "s".into(),
            client_id: "c".into(),
            alias: None,
            started_at: "t0".into(),
            end_at: "t1".into(),
            cpu_count: 2,
            memory_mb: 512,
            disk_size_mb: 1024,
            state: "running",
            envd_version: "0.6.4".into(),
            metadata: HashMap::new(),
            volume_mounts: vec![VolumeMount { name: "v".into(), path: "/mnt/v".into() }],
        };
        let json = serde_json::to_value(&listed).unwrap();
        assert_eq!(json["volumeMounts"], serde_json::json!([{"name": "v", "path": "/mnt/v"}]));
        for key in ["templateID", "sandboxID", "clientID", "startedAt", "endAt", "cpuCount", "memoryMB", "diskSizeMB"] {
            assert!(json.get(key).is_some(), "missing {key}");
        }
    }
}

/// Body of `POST /v3/templates`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateBuildRequest {
    pub name: Option<String>,
    /// Older SDKs send the name as `alias`.
    pub alias: Option<String>,
    #[serde(default)]
    pub tags: Option<Vec<String>>,
    pub cpu_count: Option<u32>,
    #[serde(rename = "memoryMB")]
    pub memory_mb: Option<u32>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateRequested {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "buildID")]
    pub build_id: String,
    pub public: bool,
    pub names: Vec<String>,
    pub tags: Vec<String>,
    pub aliases: Vec<String>,
}

/// Answer of `GET /templates/{id}/files/{hash}`.
#[derive(Debug, Serialize)]
pub struct TemplateFileUpload {
    pub present: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
}

/// Body of `POST /v2/templates/{id}/builds/{buildID}`: the SDK's
/// `Template.to_json` shape, which `copse template build` also sends.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateBuildStart {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_template: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_image_registry: Option<serde_json::Value>,
    #[serde(default)]
    pub force: bool,
    #[serde(default)]
    pub steps: Vec<TemplateStep>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_cmd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_cmd: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateStep {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files_hash: Option<String>,
    /// `skip_cache` was called before it.
    #[serde(default)]
    pub force: bool,
}

impl TemplateStep {
    /// One builder step of `kind` (`RUN`, `COPY`, …), as the SDK sends it.
    pub fn of(kind: &str, args: Vec<String>) -> Self {
        Self { kind: kind.into(), args, files_hash: None, force: false }
    }
}

/// Query of `GET /templates/{id}/builds/{buildID}/status`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BuildStatusQuery {
    pub logs_offset: Option<usize>,
    pub limit: Option<usize>,
}

#[derive(Debug, Serialize)]
pub struct BuildLogEntry {
    pub timestamp: String,
    pub message: String,
    pub level: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BuildStatusReason {
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
    pub log_entries: Vec<BuildLogEntry>,
}

/// Answer of `GET /templates/{id}/builds/{buildID}/status`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateBuildInfo {
    pub logs: Vec<String>,
    pub log_entries: Vec<BuildLogEntry>,
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "buildID")]
    pub build_id: String,
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<BuildStatusReason>,
}

/// Answer of `GET /templates/aliases/{alias}`.
#[derive(Debug, Serialize)]
pub struct TemplateAlias {
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub public: bool,
}

/// A built template in `GET /v2/templates` and `GET /templates/{id}`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BuiltTemplate {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "buildID")]
    pub build_id: String,
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u32,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    pub public: bool,
    pub aliases: Vec<String>,
    pub names: Vec<String>,
    pub created_at: String,
    pub updated_at: String,
    pub created_by: Option<serde_json::Value>,
    pub last_spawned_at: Option<String>,
    pub spawn_count: u64,
    pub build_count: u32,
    pub envd_version: String,
    pub build_status: String,
    /// Only in `GET /default-templates`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub is_default: Option<bool>,
    /// Only in `GET /templates/{id}`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub builds: Option<Vec<TemplateBuildSummary>>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateBuildSummary {
    #[serde(rename = "buildID")]
    pub build_id: String,
    pub status: String,
    pub created_at: String,
    pub updated_at: String,
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u32,
}

/// `GET /templates/{id}/builds/{buildID}/logs`.
#[derive(Debug, Deserialize)]
pub struct BuildLogsQuery {
    pub cursor: Option<i64>,
    pub limit: Option<usize>,
    pub direction: Option<String>,
    pub level: Option<String>,
    /// `persistent` or `temporary`: copse keeps one log, both read it.
    #[allow(dead_code)]
    pub source: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct BuildLogs {
    pub logs: Vec<BuildLogEntry>,
}

/// `PATCH /templates/{id}` and `/v2/templates/{id}`.
#[derive(Debug, Deserialize)]
pub struct TemplateUpdate {
    pub public: Option<bool>,
}

#[derive(Debug, Serialize)]
pub struct TemplateUpdated {
    pub names: Vec<String>,
}

#[derive(Debug, Deserialize)]
pub struct AssignTags {
    pub target: String,
    pub tags: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct AssignedTags {
    pub tags: Vec<String>,
    #[serde(rename = "buildID")]
    pub build_id: String,
}

#[derive(Debug, Deserialize)]
pub struct RemoveTags {
    pub name: String,
    pub tags: Vec<String>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateTag {
    pub tag: String,
    #[serde(rename = "buildID")]
    pub build_id: String,
    pub created_at: String,
}

#[derive(Debug, Serialize)]
pub struct TagCount {
    pub total: usize,
}

#[derive(Debug, Deserialize)]
pub struct TagExistsQuery {
    pub tag: String,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TagExists {
    pub exists: bool,
    pub normalized_tag: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TagGroupsQuery {
    pub assignment_limit: Option<usize>,
    pub tags_limit: Option<usize>,
    pub tags_cursor: Option<String>,
    pub search: Option<String>,
    pub sort: Option<String>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TagAssignment {
    pub assignment_id: String,
    pub build_id: String,
    pub assigned_at: String,
    pub build_created_at: String,
    pub build_finished_at: Option<String>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TagGroup {
    pub tag: String,
    pub assignments: Vec<TagAssignment>,
    pub has_more: bool,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TagGroups {
    pub tags: Vec<TagGroup>,
    pub next_cursor: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct TagAssignmentsQuery {
    pub cursor: Option<String>,
    pub limit: Option<usize>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TagAssignments {
    pub data: Vec<TagAssignment>,
    pub next_cursor: Option<String>,
}
