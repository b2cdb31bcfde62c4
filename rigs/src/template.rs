//! Pure pieces of the template rig (`copse-rig-template`): the template it
//! builds, as the SDK's `Template.to_json` writes it, its build context, and
//! the host name a sandbox port is reached by through the gateway.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

/// The port the served template's start command listens on.
pub const SERVE_PORT: u16 = 8080;
/// `COPSE_CRIU` for the gateway without memory snapshots: a path that does
/// not exist, so the gateway finds no CRIU (as `tests/test_lifecycle.py`
/// makes a CRIU-less host).
pub const CRIU_MISSING: &str = "/nonexistent/copse-rig-template/criu";
/// The served template's start command: a static server over the copied dir.
pub const START_CMD: &str = "python3 -m http.server 8080 --bind 0.0.0.0 --directory /home/user/app";
/// Succeeds once the start command answers.
pub const READY_CMD: &str = "curl -sf -o /dev/null http://127.0.0.1:8080/";

/// The small template every build sample makes: from `base`, a `RUN`
/// writing a file (it carries `nonce`, so a new nonce misses every cached
/// layer), an `ENV`, and a `COPY` of the context's `app/` dir; with `serve`,
/// also the start and ready commands.
pub fn definition(nonce: &str, serve: bool) -> Value {
    let mut def = json!({
        "fromTemplate": "base",
        "steps": [
            {"type": "RUN", "args": [format!("echo {nonce} > /home/user/bench-nonce")], "force": false},
            {"type": "ENV", "args": ["BENCH_TEMPLATE", "1"], "force": false},
            {"type": "COPY", "args": ["app/", "/home/user/app/", "", ""], "force": false},
        ],
        "force": false,
    });
    if serve {
        def["startCmd"] = json!(START_CMD);
        def["readyCmd"] = json!(READY_CMD);
    }
    def
}

/// Writes the build context's `app/` (two small files) into `dir`.
pub fn write_context(dir: &Path) -> std::io::Result<()> {
    let app = dir.join("app");
    std::fs::create_dir_all(&app)?;
    std::fs::write(app.join("index.html"), "<p>copse template rig</p>\n")?;
    std::fs::write(app.join("data.txt"), "small file copied into the template\n")
}

/// Writes `definition(nonce, serve)` to `dir/<file_stem>.json` and returns its path.
pub fn write_definition(dir: &Path, file_stem: &str, nonce: &str, serve: bool) -> std::io::Result<PathBuf> {
    let path = dir.join(format!("{file_stem}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(&definition(nonce, serve))? + "\n")?;
    Ok(path)
}

/// The `Host` reaching `port` of sandbox `id` through the gateway on `addr`
/// (`{port}-{id}.{domain}`, as `Sandbox.get_host` names it; a gateway
/// without `--domain` takes any suffix).
pub fn sandbox_host(port: u16, id: &str, addr: SocketAddr) -> String {
    format!("{port}-{id}.localhost:{}", addr.port())
}

/// `POST /v2/sandboxes` body for `template`, as the SDK sends it.
pub fn create_body(template: &str) -> String {
    json!({"templateID": template, "metadata": {}, "envVars": {}}).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nonce_is_in_the_first_step_and_serving_adds_start_and_ready() {
        let a = definition("aa11", false);
        assert_eq!(a["fromTemplate"], "base");
        let kinds: Vec<&str> = a["steps"].as_array().unwrap().iter().map(|s| s["type"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["RUN", "ENV", "COPY"]);
        assert!(a["steps"][0]["args"][0].as_str().unwrap().contains("aa11"));
        assert!(a.get("startCmd").is_none() && a.get("readyCmd").is_none());
        assert_ne!(a, definition("bb22", false));
        assert_eq!(a, definition("aa11", false));
        let s = definition("aa11", true);
        assert_eq!(s["startCmd"], START_CMD);
        assert!(START_CMD.contains(&SERVE_PORT.to_string()) && READY_CMD.contains(&SERVE_PORT.to_string()));
        assert_eq!(s["steps"], a["steps"]);
    }

    #[test]
    fn context_and_definition_files() {
        let dir = tempfile::tempdir().unwrap();
        write_context(dir.path()).unwrap();
        assert!(dir.path().join("app/index.html").is_file());
        let p = write_definition(dir.path(), "cold-1", "n1", true).unwrap();
        let v: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
        assert_eq!(v, definition("n1", true));
    }

    #[test]
    fn hosts_and_bodies() {
        let addr: SocketAddr = "127.0.0.1:4321".parse().unwrap();
        assert_eq!(sandbox_host(8080, "abc123", addr), "8080-abc123.localhost:4321");
        let b: Value = serde_json::from_str(&create_body("bench-x")).unwrap();
        assert_eq!(b["templateID"], "bench-x");
    }
}
