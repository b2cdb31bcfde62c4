//! The templates copse ships, written as build definitions in the build
//! API's JSON (the shape of the SDK's `Template.to_json`, which
//! `copse template build --from-json` reads too): one directory per
//! package system, `debian/` and `freebsd/`, one file per template.
//!
//! `copse up` builds them on the substrate itself rather than in a build
//! sandbox: `base` is the root every build starts from, so nothing exists
//! to run its steps in, and every node needs its own copy of both. This
//! crate turns a definition into the substrate's [`Recipe`]; what a shipped
//! definition may say is therefore the part of the build API a root
//! filesystem build can honour:
//!
//! - the first definition starts `fromImage` the host's own system (the
//!   substrate bootstraps it: debootstrap on Linux, the base dist on
//!   FreeBSD); the others start `fromTemplate` one listed before them, whose
//!   recipe they extend;
//! - `RUN` as root; the exact line the SDK's `apt_install` writes (or
//!   `pkg install -y` on FreeBSD) becomes the recipe's packages, which each
//!   substrate installs its own way, any other command runs in the new root;
//! - `COPY` of a file this crate embeds (paths relative to `e2b-compat/`,
//!   the context an operator gives `--from-json`), owned by root;
//! - `startCmd`, with `copseService` saying which account runs it, on which
//!   port, and the path that answers once it is ready: the gateway starts it
//!   in every sandbox of the template and keeps it warm in a memory
//!   snapshot. (`readyCmd` is for the ordinary builder, which knows no
//!   `copseService`.)
//!
//! Anything else (ENV, WORKDIR, USER, RUN as another user) is refused, as
//! a recipe has no place to keep it.
//!
//! `base` carries what E2B's base image gives an agent: Python with pip,
//! Node.js with npm, git. Its `/etc/pip.conf` lets pip install beside the
//! system's packages (Debian marks its Python externally managed, PEP 668),
//! so the SDK's `pip_install` and an agent's `pip install` work there as
//! they do on E2B. A non-root `pip install` goes to the user's site, which
//! exists from the start: Python puts it on the path only if it exists when
//! the interpreter starts, so a kernel could not import what a cell
//! installed there.
//!
//! FreeBSD's code interpreter has no TypeScript package (there is none):
//! its TypeScript contexts report the missing module when a cell runs (not
//! run on FreeBSD).

use anyhow::{Context, bail, ensure};
use copse_substrate::template::{Backend, PackageSystem, Recipe, write_file_script};
use serde::Deserialize;

/// The definitions, in build order, for each package system.
const DEBIAN: &[(&str, &str)] = &[
    ("base", include_str!("../debian/base.json")),
    ("code-interpreter-v1", include_str!("../debian/code-interpreter-v1.json")),
];
const FREEBSD: &[(&str, &str)] = &[
    ("base", include_str!("../freebsd/base.json")),
    ("code-interpreter-v1", include_str!("../freebsd/code-interpreter-v1.json")),
];

/// The files a shipped definition may copy, by their path under `e2b-compat/`.
const FILES: &[(&str, &str)] = &[
    ("interpreter/copse_interpreter.py", include_str!("../../interpreter/copse_interpreter.py")),
    ("interpreter/copse_js_kernel.mjs", include_str!("../../interpreter/copse_js_kernel.mjs")),
    ("interpreter/copse_python_kernel.py", include_str!("../../interpreter/copse_python_kernel.py")),
];

/// The line the SDK's `apt_install(packages)` sends, up to the packages.
const APT_INSTALL: &str = "apt-get update && DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes apt-get install -y --no-install-recommends ";
const PKG_INSTALL: &str = "pkg install -y ";

/// A shipped template: what the substrate builds, and the service the
/// gateway starts in each of its sandboxes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shipped {
    pub recipe: Recipe,
    pub service: Option<Service>,
}

/// A long-running service a template starts in every sandbox, as an
/// unprivileged account of its own, before the sandbox is handed to anyone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    pub command: String,
    /// Not `user`: code running as `user` must not be able to signal it,
    /// trace it, read its files or take its port.
    pub user: String,
    pub port: u16,
    /// Answers 2xx once the service is ready.
    pub health_path: String,
}

/// The definition files for `os`: (template name, JSON text).
pub fn definitions(os: PackageSystem) -> &'static [(&'static str, &'static str)] {
    match os {
        PackageSystem::Debian => DEBIAN,
        PackageSystem::FreeBsd => FREEBSD,
    }
}

/// The contents of a file a shipped definition copies.
pub fn file(src: &str) -> Option<&'static str> {
    FILES.iter().find(|(path, _)| *path == src).map(|(_, content)| *content)
}

/// Every shipped template for `os`, in build order.
pub fn shipped(os: PackageSystem) -> anyhow::Result<Vec<Shipped>> {
    let mut built: Vec<Shipped> = Vec::new();
    for (name, text) in definitions(os) {
        let shipped = translate(name, text, os, &built).with_context(|| format!("shipped template {name}"))?;
        built.push(shipped);
    }
    Ok(built)
}

/// The shipped template `name` for the host's package system.
pub fn host_recipe(name: &str) -> anyhow::Result<Recipe> {
    shipped(PackageSystem::host())?
        .into_iter()
        .find(|s| s.recipe.name == name)
        .map(|s| s.recipe)
        .with_context(|| format!("copse ships no template {name:?}"))
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Definition {
    from_image: Option<String>,
    from_template: Option<String>,
    #[serde(default)]
    steps: Vec<Step>,
    start_cmd: Option<String>,
    copse_service: Option<ServiceFields>,
}

#[derive(Deserialize)]
struct Step {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    args: Vec<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ServiceFields {
    user: String,
    port: u16,
    health_path: String,
}

fn translate(name: &str, text: &str, os: PackageSystem, earlier: &[Shipped]) -> anyhow::Result<Shipped> {
    let def: Definition = serde_json::from_str(text).context("the definition does not parse")?;
    let mut recipe = match (&def.from_image, &def.from_template) {
        (Some(image), None) => {
            let system = match os {
                PackageSystem::Debian => "debian:",
                PackageSystem::FreeBsd => "freebsd:",
            };
            ensure!(image.starts_with(system), "fromImage {image:?}: a shipped root starts from {system}<release>");
            Recipe { name: name.into(), packages: vec![], post_install: vec![], backend: Backend::Jail }
        }
        (None, Some(parent)) => {
            let parent = earlier
                .iter()
                .find(|s| &s.recipe.name == parent)
                .with_context(|| format!("fromTemplate {parent:?} is not a shipped template listed before it"))?;
            Recipe { name: name.into(), ..parent.recipe.clone() }
        }
        _ => bail!("give exactly one of fromImage and fromTemplate"),
    };
    for (i, step) in def.steps.iter().enumerate() {
        add_step(&mut recipe, step, os).with_context(|| format!("step {}", i + 1))?;
    }
    let service = match (def.start_cmd, def.copse_service) {
        (Some(command), Some(fields)) => {
            Some(Service { command, user: fields.user, port: fields.port, health_path: fields.health_path })
        }
        (None, None) => None,
        _ => bail!("a shipped startCmd needs copseService (its account, port and health path), and the reverse"),
    };
    Ok(Shipped { recipe, service })
}

fn add_step(recipe: &mut Recipe, step: &Step, os: PackageSystem) -> anyhow::Result<()> {
    let arg = |i: usize| step.args.get(i).map(String::as_str).filter(|a| !a.is_empty());
    match step.kind.as_str() {
        "RUN" => {
            let command = arg(0).context("RUN needs a command")?;
            ensure!(arg(1) == Some("root"), "a shipped RUN runs as root (give \"root\" as its user)");
            match packages(command, os) {
                Some(names) => recipe.packages.extend(names),
                None => recipe.post_install.push(command.to_string()),
            }
        }
        "COPY" => {
            let src = arg(0).context("COPY needs a source")?;
            let dest = arg(1).context("COPY needs a destination")?;
            ensure!(matches!(arg(2), None | Some("root")), "a shipped COPY is owned by root");
            let content = file(src).with_context(|| format!("COPY source {src:?} is not a file copse embeds"))?;
            let path = match dest.strip_suffix('/') {
                Some(dir) => format!("{dir}/{}", src.rsplit('/').next().unwrap_or(src)),
                None => dest.to_string(),
            };
            ensure!(path.starts_with('/'), "COPY destination {dest:?} is not absolute");
            recipe.post_install.push(write_file_script(&path, content.trim_end(), arg(3).unwrap_or("0644")));
        }
        other => bail!("{other} has no place in a shipped template (RUN as root and COPY only)"),
    }
    Ok(())
}

/// The package names of a package system's install line, if `command` is
/// exactly one.
fn packages(command: &str, os: PackageSystem) -> Option<Vec<String>> {
    let prefix = match os {
        PackageSystem::Debian => APT_INSTALL,
        PackageSystem::FreeBsd => PKG_INSTALL,
    };
    let names: Vec<String> = command.strip_prefix(prefix)?.split_whitespace().map(str::to_string).collect();
    let plain = |n: &String| n.chars().all(|c| c.is_ascii_alphanumeric() || "+-._".contains(c));
    (!names.is_empty() && names.iter().all(plain)).then_some(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OS: [PackageSystem; 2] = [PackageSystem::Debian, PackageSystem::FreeBsd];

    #[test]
    fn every_package_system_ships_base_then_the_code_interpreter_on_it() {
        for os in OS {
            let shipped = shipped(os).unwrap();
            let names: Vec<&str> = shipped.iter().map(|s| s.recipe.name.as_str()).collect();
            assert_eq!(names, ["base", "code-interpreter-v1"]);
            let (base, ci) = (&shipped[0], &shipped[1]);
            assert!(["python3", "npm"].iter().all(|p| base.recipe.packages.iter().any(|b| b.contains(p))));
            assert_eq!(base.recipe.post_install.len(), 2);
            assert!(base.recipe.post_install[0].contains("break-system-packages = true"));
            assert!(base.recipe.post_install[1].contains("-m site --user-site"));
            assert!(base.service.is_none());
            assert!(base.recipe.packages.iter().all(|p| ci.recipe.packages.contains(p)));
            assert!(ci.recipe.packages.len() > base.recipe.packages.len());
            let (inherited, own) = ci.recipe.post_install.split_at(base.recipe.post_install.len());
            assert_eq!(inherited, base.recipe.post_install);
            for (i, path) in
                ["copse_interpreter.py", "copse_js_kernel.mjs", "copse_python_kernel.py"].iter().enumerate()
            {
                assert!(own[i].contains(&format!("cat > '/opt/copse/{path}'")));
                assert!(own[i].ends_with(&format!("chmod 0644 '/opt/copse/{path}'")));
            }
            assert!(own[3].contains("useradd --system"));
            let service = ci.service.as_ref().unwrap();
            assert_eq!(
                (service.user.as_str(), service.port, service.health_path.as_str()),
                ("copse-interp", 49999, "/health")
            );
            assert!(service.command.contains("/opt/copse/copse_interpreter.py --port 49999"));
        }
    }

    #[test]
    fn the_ready_command_for_the_ordinary_builder_probes_the_service() {
        for os in OS {
            let text = definitions(os)[1].1;
            let value: serde_json::Value = serde_json::from_str(text).unwrap();
            let service = shipped(os).unwrap().remove(1).service.unwrap();
            let ready = value["readyCmd"].as_str().unwrap();
            assert!(ready.contains(&format!("127.0.0.1:{}{}", service.port, service.health_path)), "{ready}");
        }
    }

    #[test]
    fn only_the_exact_install_line_becomes_packages() {
        let apt = format!("{APT_INSTALL}git curl");
        assert_eq!(packages(&apt, PackageSystem::Debian), Some(vec!["git".into(), "curl".into()]));
        assert_eq!(packages(&apt, PackageSystem::FreeBsd), None);
        assert_eq!(packages("pkg install -y git", PackageSystem::FreeBsd), Some(vec!["git".into()]));
        assert_eq!(packages(&format!("{APT_INSTALL}git; rm -rf /"), PackageSystem::Debian), None);
        assert_eq!(packages(&format!("{APT_INSTALL}git && make"), PackageSystem::Debian), None);
        assert_eq!(packages(APT_INSTALL, PackageSystem::Debian), None);
    }

    fn refused(text: &str) -> String {
        let base = shipped(PackageSystem::Debian).unwrap();
        format!("{:#}", translate("t", text, PackageSystem::Debian, &base).unwrap_err())
    }

    #[test]
    fn what_a_root_build_cannot_honour_is_refused_with_its_step() {
        let cases = [
            (r#"{"fromTemplate": "base", "steps": [{"type": "ENV", "args": ["A", "1"]}]}"#, "step 1: ENV"),
            (r#"{"fromTemplate": "base", "steps": [{"type": "RUN", "args": ["true"]}]}"#, "runs as root"),
            (r#"{"fromTemplate": "base", "steps": [{"type": "RUN", "args": ["true", "user"]}]}"#, "runs as root"),
            (r#"{"fromTemplate": "base", "steps": [{"type": "COPY", "args": ["etc/passwd", "/x"]}]}"#, "not a file"),
            (
                r#"{"fromTemplate": "base", "steps": [{"type": "COPY", "args": ["interpreter/copse_interpreter.py", "/x", "user"]}]}"#,
                "owned by root",
            ),
            (
                r#"{"fromTemplate": "base", "steps": [{"type": "COPY", "args": ["interpreter/copse_interpreter.py", "x/"]}]}"#,
                "not absolute",
            ),
            (r#"{"fromTemplate": "nope"}"#, "not a shipped template"),
            (r#"{"fromImage": "ubuntu:24.04"}"#, "debian:"),
            (r#"{"fromImage": "debian:bookworm", "fromTemplate": "base"}"#, "exactly one"),
            (r#"{"fromTemplate": "base", "startCmd": "sleep 1"}"#, "copseService"),
        ];
        for (text, expected) in cases {
            let err = refused(text);
            assert!(err.contains(expected), "{text}: {err}");
        }
    }

    #[test]
    fn a_copy_lands_in_its_directory_or_at_its_path() {
        let base = shipped(PackageSystem::Debian).unwrap();
        let text = r#"{"fromTemplate": "base", "steps": [
            {"type": "COPY", "args": ["interpreter/copse_js_kernel.mjs", "/srv/k.mjs", "", "0600"]}]}"#;
        let recipe = translate("t", text, PackageSystem::Debian, &base).unwrap().recipe;
        let copy = recipe.post_install.last().unwrap();
        assert!(copy.starts_with("mkdir -p '/srv' && cat > '/srv/k.mjs'"));
        assert!(copy.ends_with("chmod 0600 '/srv/k.mjs'"));
    }
}
