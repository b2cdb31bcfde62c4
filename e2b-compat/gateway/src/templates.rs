//! The templates copse offers out of the box, named as E2B names them, and
//! what runs in each sandbox beside the agent.

use std::sync::LazyLock;

use copse_protocol::kernels::INTERPRETER_USER;
use copse_substrate::template::{PackageSystem, Recipe, builtin, write_file_script};

pub const CODE_INTERPRETER: &str = "code-interpreter-v1";
/// The in-sandbox code-interpreter server (Python, runs inside the sandbox).
const INTERPRETER_SOURCE: &str = include_str!("../../interpreter/copse_interpreter.py");
const INTERPRETER_PATH: &str = "/opt/copse/copse_interpreter.py";
/// Its JavaScript/TypeScript kernel, which it finds beside itself.
const JS_KERNEL_SOURCE: &str = include_str!("../../interpreter/copse_js_kernel.mjs");
const JS_KERNEL_PATH: &str = "/opt/copse/copse_js_kernel.mjs";
/// Its Python kernel (ipykernel, started with the connection it is given).
const PYTHON_KERNEL_SOURCE: &str = include_str!("../../interpreter/copse_python_kernel.py");
const PYTHON_KERNEL_PATH: &str = "/opt/copse/copse_python_kernel.py";
/// The SDK reaches the code interpreter on this sandbox port.
pub const INTERPRETER_PORT: u16 = 49999;

/// A long-running service a template starts in every sandbox, as an
/// unprivileged account of its own, before the sandbox is handed to anyone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    pub command: String,
    /// Not `user`: code running as `user` must not be able to signal it,
    /// trace it, read its files or take its port.
    pub user: &'static str,
    pub port: u16,
    /// Answers 2xx once the service is ready.
    pub health_path: &'static str,
}

/// The names of [`recipes`], which no snapshot or built template may take;
/// read once, as a create asks on every call.
static SHIPPED: LazyLock<Vec<String>> = LazyLock::new(|| recipes().into_iter().map(|r| r.name).collect());

/// Whether `name` is a template copse ships.
pub fn is_shipped(name: &str) -> bool {
    SHIPPED.iter().any(|shipped| shipped == name)
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
            write_file_script(PYTHON_KERNEL_PATH, PYTHON_KERNEL_SOURCE.trim_end(), "0644"),
            add_account_script(INTERPRETER_USER),
        ],
        backend: base.backend,
    });
    recipes
}

/// A system account with no home and no login shell, by whichever tool the
/// root has (`useradd` on Debian, `pw` on FreeBSD; POSIX sh for both).
fn add_account_script(name: &str) -> String {
    format!(
        "id {name} >/dev/null 2>&1 || if command -v useradd >/dev/null 2>&1; then \
         useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin {name}; \
         else pw useradd -n {name} -d /nonexistent -s /usr/sbin/nologin -c 'copse code interpreter'; fi"
    )
}

pub fn service(template: &str) -> Option<Service> {
    (template == CODE_INTERPRETER).then(|| Service {
        // -I: nothing from the environment, the working directory or a user
        // site directory gets into the interpreter's imports.
        command: format!("exec python3 -I {INTERPRETER_PATH} --port {INTERPRETER_PORT}"),
        user: INTERPRETER_USER,
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
        assert!(ci.post_install[2].contains(PYTHON_KERNEL_PATH));
        assert!(ci.post_install[3].contains("useradd --system") && ci.post_install[3].contains(INTERPRETER_USER));
        assert_eq!(service(CODE_INTERPRETER).unwrap().user, INTERPRETER_USER);
        assert!(service("base").is_none());
    }

    #[test]
    fn the_shipped_names_are_the_recipes_names() {
        let names: Vec<String> = recipes().into_iter().map(|r| r.name).collect();
        assert_eq!(names, *SHIPPED);
        assert!(is_shipped("base") && !is_shipped("base:latest") && !is_shipped("my-app"));
    }
}
