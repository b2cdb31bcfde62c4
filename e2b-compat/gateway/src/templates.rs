//! The templates copse offers out of the box, named as E2B names them, and
//! what runs in each sandbox beside the agent.

use copse_substrate::template::{PackageSystem, Recipe, builtin, write_file_script};

pub const CODE_INTERPRETER: &str = "code-interpreter-v1";
/// The in-sandbox code-interpreter server (Python, runs inside the sandbox).
const INTERPRETER_SOURCE: &str = include_str!("../../interpreter/copse_interpreter.py");
const INTERPRETER_PATH: &str = "/opt/copse/copse_interpreter.py";
/// Its JavaScript/TypeScript kernel, which it finds beside itself.
const JS_KERNEL_SOURCE: &str = include_str!("../../interpreter/copse_js_kernel.mjs");
const JS_KERNEL_PATH: &str = "/opt/copse/copse_js_kernel.mjs";
/// The SDK reaches the code interpreter on this sandbox port.
pub const INTERPRETER_PORT: u16 = 49999;

/// A long-running service a template starts in every sandbox, as its
/// unprivileged user, before the sandbox is handed to anyone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    pub command: String,
    pub port: u16,
    /// Answers 2xx once the service is ready.
    pub health_path: &'static str,
}

pub fn recipes() -> Vec<Recipe> {
    let os = PackageSystem::host();
    let mut recipes = builtin(os);
    let base = recipes.iter().find(|r| r.name == "base").expect("every platform has base").clone();
    let extra: &[&str] = match os {
        PackageSystem::Debian => &[
            "python3-ipykernel",
            "python3-jupyter-client",
            "python3-matplotlib-inline",
            "python3-numpy",
            "python3-pandas",
            "python3-matplotlib",
            // JavaScript and TypeScript contexts.
            "nodejs",
            "node-typescript",
        ],
        // TypeScript has no FreeBSD package: those contexts report the
        // missing module when a cell runs (not run on FreeBSD).
        PackageSystem::FreeBsd => {
            &["py311-ipykernel", "py311-jupyter_client", "py311-numpy", "py311-pandas", "py311-matplotlib", "node"]
        }
    };
    let mut packages = base.packages.clone();
    packages.extend(extra.iter().map(|p| p.to_string()));
    recipes.push(Recipe {
        name: CODE_INTERPRETER.into(),
        packages,
        post_install: vec![
            write_file_script(INTERPRETER_PATH, INTERPRETER_SOURCE.trim_end(), "0644"),
            write_file_script(JS_KERNEL_PATH, JS_KERNEL_SOURCE.trim_end(), "0644"),
        ],
        backend: base.backend,
    });
    recipes
}

pub fn service(template: &str) -> Option<Service> {
    (template == CODE_INTERPRETER).then(|| Service {
        command: format!("exec python3 {INTERPRETER_PATH} --port {INTERPRETER_PORT}"),
        port: INTERPRETER_PORT,
        health_path: "/health",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_interpreter_builds_on_base_and_installs_its_server() {
        let recipes = recipes();
        let base = recipes.iter().find(|r| r.name == "base").unwrap();
        let ci = recipes.iter().find(|r| r.name == CODE_INTERPRETER).unwrap();
        assert!(base.packages.iter().all(|p| ci.packages.contains(p)));
        assert!(ci.post_install[0].contains(INTERPRETER_PATH));
        assert!(ci.post_install[1].contains(JS_KERNEL_PATH));
        assert!(service(CODE_INTERPRETER).is_some());
        assert!(service("base").is_none());
    }
}
