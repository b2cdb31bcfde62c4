//! A template as the build API takes it (the SDK's `Template.to_json`
//! shape): a base, steps, start and ready commands. The CLI makes one from
//! a Dockerfile or reads one from that JSON.

use anyhow::{Context, bail};

/// The build API's body is the definition: one shape for the SDK, the
/// gateway and the CLI.
pub use copse_gateway::api::wire::{TemplateBuildStart as Definition, TemplateStep as Step};

/// The JSON `Template.to_json` wrote. Registry credentials are not taken
/// from a file: the gateway's own settings carry those.
pub fn from_json(text: &str) -> anyhow::Result<Definition> {
    let value: serde_json::Value = serde_json::from_str(text).context("the template JSON does not parse")?;
    if value.get("fromImageRegistry").is_some_and(|r| !r.is_null()) {
        bail!("fromImageRegistry is not supported by the CLI: configure the registry on the gateway");
    }
    let def: Definition = serde_json::from_value(value).context("the template JSON has an unexpected shape")?;
    if def.from_image.is_none() && def.from_template.is_none() {
        bail!("the template JSON names no base (fromImage or fromTemplate)");
    }
    Ok(def)
}

/// One word for `sh`, whatever it contains.
pub fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_the_sdks_to_json_writes() {
        let text = r#"{
  "steps": [
    {"type": "RUN", "args": ["echo hi", "root"], "force": false},
    {"type": "COPY", "args": ["app/", "/home/user/app/", "", ""], "force": false,
     "filesHash": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"}
  ],
  "force": false,
  "fromTemplate": "base",
  "startCmd": "python3 -m http.server 8080",
  "readyCmd": "curl -s localhost:8080"
}"#;
        let def = from_json(text).unwrap();
        assert_eq!(def.from_template.as_deref(), Some("base"));
        assert_eq!(def.steps.len(), 2);
        assert_eq!(def.steps[1].files_hash.as_deref().map(str::len), Some(64));
        assert_eq!(def.ready_cmd.as_deref(), Some("curl -s localhost:8080"));
        let round: serde_json::Value = serde_json::to_value(&def).unwrap();
        assert_eq!(round["steps"][0]["type"], "RUN");
        assert_eq!(round["fromTemplate"], "base");
    }

    #[test]
    fn refuses_a_json_without_base_or_with_credentials() {
        assert!(from_json(r#"{"steps": []}"#).is_err());
        assert!(from_json(r#"{"fromImage": "x", "fromImageRegistry": {"type": "aws"}}"#).is_err());
        assert!(from_json("not json").is_err());
    }
}
