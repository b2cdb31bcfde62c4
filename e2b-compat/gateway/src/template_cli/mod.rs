//! `copse template build -f Dockerfile | --from-json`, `template ls|rm|tags`:
//! thin clients of the running gateway's template API, the routes the
//! SDK's `Template.build` uses, so a template built here is the same as
//! one built through the SDK.

mod archive;
pub mod definition;
pub mod dockerfile;
pub(crate) mod http;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Value, json};

use definition::Definition;
use http::Api;

/// How often the build's status is polled (the SDK's rate).
const POLL_EVERY: Duration = Duration::from_millis(200);

pub struct BuildArgs {
    pub name: String,
    pub tags: Vec<String>,
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
    pub cpu_count: Option<u32>,
    pub memory_mb: Option<u32>,
    /// Where COPY sources are read from.
    pub context: PathBuf,
}

/// The definition a Dockerfile or a `to_json` file describes, with the
/// command line's start and ready commands over its own.
pub fn definition(dockerfile: Option<&Path>, from_json: Option<&Path>, args: &BuildArgs) -> anyhow::Result<Definition> {
    let mut def = match (dockerfile, from_json) {
        (Some(path), None) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            dockerfile::parse(&text).with_context(|| format!("{}", path.display()))?
        }
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            definition::from_json(&text).with_context(|| format!("{}", path.display()))?
        }
        _ => bail!("give exactly one of -f DOCKERFILE and --from-json FILE"),
    };
    if args.start_cmd.is_some() {
        def.start_cmd = args.start_cmd.clone();
    }
    if args.ready_cmd.is_some() {
        def.ready_cmd = args.ready_cmd.clone();
    }
    if def.ready_cmd.is_some() && def.start_cmd.is_none() {
        bail!("--ready-cmd needs a start command (--start-cmd, or CMD in the Dockerfile)");
    }
    Ok(def)
}

/// Requests the build, uploads each COPY's files unless the gateway has
/// them, starts it and follows its log until it ends.
pub fn build(api_url: &str, key: &str, mut def: Definition, args: &BuildArgs) -> anyhow::Result<()> {
    let api = Api::new(api_url, key)?;
    let mut request = json!({ "name": args.name });
    if !args.tags.is_empty() {
        request["tags"] = json!(args.tags);
    }
    if let Some(cpu) = args.cpu_count {
        request["cpuCount"] = json!(cpu);
    }
    if let Some(memory) = args.memory_mb {
        request["memoryMB"] = json!(memory);
    }
    let requested = api.json("POST", "/v3/templates", Some(&request), &[202])?;
    let id = field(&requested, "templateID")?;
    let build_id = field(&requested, "buildID")?;

    for step in def.steps.iter_mut().filter(|s| s.kind == "COPY") {
        let src = step.args.first().context("a COPY step names no source")?.clone();
        let tar = archive::pack(&args.context, &src)?;
        let hash = step.files_hash.clone().unwrap_or_else(|| archive::hash(&step.args, &tar));
        let link = api.json("GET", &format!("/templates/{id}/files/{hash}"), None, &[201])?;
        if !link.get("present").and_then(Value::as_bool).unwrap_or(false) {
            let url = field(&link, "url")?;
            api.put(&url, tar)?;
        }
        step.files_hash = Some(hash);
    }
    let body = serde_json::to_value(&def)?;
    api.json("POST", &format!("/v2/templates/{id}/builds/{build_id}"), Some(&body), &[202])?;
    follow(&api, &id, &build_id, &args.name, def.steps.len())
}

fn follow(api: &Api, id: &str, build_id: &str, name: &str, steps: usize) -> anyhow::Result<()> {
    let bar = std::io::stderr().is_terminal().then(|| {
        let bar = ProgressBar::new(steps as u64);
        bar.set_style(
            ProgressStyle::with_template("{prefix} [{elapsed}] {bar:30} {pos}/{len} {wide_msg}")
                .expect("valid template"),
        );
        bar.set_prefix(format!("building {name}"));
        bar.enable_steady_tick(Duration::from_millis(120));
        bar
    });
    let mut offset = 0usize;
    loop {
        let status =
            api.json("GET", &format!("/templates/{id}/builds/{build_id}/status?logsOffset={offset}"), None, &[200])?;
        let entries = status.get("logEntries").and_then(Value::as_array).cloned().unwrap_or_default();
        offset += entries.len();
        for entry in &entries {
            let message = entry.get("message").and_then(Value::as_str).unwrap_or("");
            let step = entry.get("step").and_then(Value::as_str).and_then(|s| s.parse::<u64>().ok());
            match &bar {
                Some(bar) => {
                    if let Some(step) = step {
                        bar.set_position(step.min(steps as u64));
                    }
                    bar.println(message);
                }
                None => eprintln!("{message}"),
            }
        }
        // A finished build's last lines may need more pages: read them all.
        let finished = entries.is_empty();
        match status.get("status").and_then(Value::as_str) {
            Some("ready") if finished => {
                if let Some(bar) = &bar {
                    bar.finish_and_clear();
                }
                println!("template {name} ({id}) built: build {build_id}");
                return Ok(());
            }
            Some("error") if finished => {
                if let Some(bar) = &bar {
                    bar.abandon();
                }
                let reason = status.pointer("/reason/message").and_then(Value::as_str).unwrap_or("no reason given");
                bail!("the build of {name} failed: {reason}");
            }
            _ if finished => std::thread::sleep(POLL_EVERY),
            _ => {}
        }
    }
}

/// `copse template ls`: the shipped templates and the team's own.
pub fn ls(api_url: &str, key: &str) -> anyhow::Result<()> {
    let api = Api::new(api_url, key)?;
    let shipped = api.json("GET", "/default-templates", None, &[200])?;
    let built = api.json("GET", "/v2/templates", None, &[200])?;
    println!("{:<32} {:<22} {:<9} {:<8} CREATED", "NAME", "TEMPLATE ID", "STATUS", "VISIBLE");
    for (t, kind) in list(&shipped).iter().map(|t| (t, "shipped")).chain(list(&built).iter().map(|t| (t, "own"))) {
        let text = |k: &str| t.get(k).and_then(Value::as_str).unwrap_or("").to_string();
        let name = t.pointer("/names/0").and_then(Value::as_str).unwrap_or("");
        let visible = match (kind, t.get("public").and_then(Value::as_bool)) {
            ("shipped", _) => "shipped",
            (_, Some(true)) => "public",
            _ => "team",
        };
        println!(
            "{:<32} {:<22} {:<9} {:<8} {}",
            name,
            text("templateID"),
            text("buildStatus"),
            visible,
            text("createdAt")
        );
    }
    Ok(())
}

fn list(value: &Value) -> Vec<Value> {
    value.as_array().cloned().unwrap_or_default()
}

/// `copse template rm`.
pub fn rm(api_url: &str, key: &str, name: &str) -> anyhow::Result<()> {
    Api::new(api_url, key)?.json("DELETE", &format!("/templates/{}", http::path(name)), None, &[204])?;
    println!("removed template {name}");
    Ok(())
}

/// `copse template tags NAME [--add T… [--from TAG]] [--remove T…]`:
/// changes first, then the list.
pub fn tags(api_url: &str, key: &str, name: &str, add: &[String], from: &str, remove: &[String]) -> anyhow::Result<()> {
    let api = Api::new(api_url, key)?;
    if !add.is_empty() {
        let body = json!({ "target": format!("{name}:{from}"), "tags": add });
        api.json("POST", "/templates/tags", Some(&body), &[201])?;
    }
    if !remove.is_empty() {
        api.json("DELETE", "/templates/tags", Some(&json!({ "name": name, "tags": remove })), &[204])?;
    }
    let tags = api.json("GET", &format!("/templates/{}/tags", http::path(name)), None, &[200])?;
    println!("{:<24} {:<38} ASSIGNED", "TAG", "BUILD");
    for t in list(&tags) {
        let text = |k: &str| t.get(k).and_then(Value::as_str).unwrap_or("").to_string();
        println!("{:<24} {:<38} {}", text("tag"), text("buildID"), text("createdAt"));
    }
    Ok(())
}

fn field(value: &Value, name: &str) -> anyhow::Result<String> {
    value.get(name).and_then(Value::as_str).map(str::to_string).with_context(|| format!("the answer has no {name}"))
}
