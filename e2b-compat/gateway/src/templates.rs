//! The templates copse offers out of the box, named as E2B names them, and
//! what runs in each sandbox beside the agent. Their build definitions live
//! in `e2b-compat/templates` (the `copse-templates` crate), in the build
//! API's JSON; this module reads them once.

use std::sync::LazyLock;

use copse_substrate::template::{PackageSystem, Recipe};
pub use copse_templates::Service;

pub const CODE_INTERPRETER: &str = "code-interpreter-v1";

/// The shipped templates for this host's package system. Their definitions
/// are compiled in, and a unit test translates every one of them, so this
/// cannot fail in a build that passed its tests.
static SHIPPED: LazyLock<Vec<copse_templates::Shipped>> = LazyLock::new(|| {
    copse_templates::shipped(PackageSystem::host()).expect("the shipped template definitions translate")
});

/// Whether `name` is a template copse ships.
pub fn is_shipped(name: &str) -> bool {
    SHIPPED.iter().any(|shipped| shipped.recipe.name == name)
}

pub fn recipes() -> Vec<Recipe> {
    SHIPPED.iter().map(|shipped| shipped.recipe.clone()).collect()
}

pub fn service(template: &str) -> Option<Service> {
    SHIPPED.iter().find(|shipped| shipped.recipe.name == template)?.service.clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::wire::TemplateBuildStart;
    use crate::service::{RawStep, parse_steps};
    use copse_protocol::kernels::INTERPRETER_USER;

    /// The SDK reaches the code interpreter on this sandbox port.
    const SDK_PORT: u16 = 49999;

    #[test]
    fn the_code_interpreter_runs_as_its_own_account_on_the_sdks_port() {
        let interpreter = service(CODE_INTERPRETER).unwrap();
        assert_eq!(interpreter.user, INTERPRETER_USER);
        assert_eq!(interpreter.port, SDK_PORT);
        assert!(interpreter.command.starts_with("exec python3 -I "), "no environment reaches its imports");
        assert!(service("base").is_none());
        let names: Vec<String> = recipes().into_iter().map(|r| r.name).collect();
        assert_eq!(names, ["base", CODE_INTERPRETER]);
        assert!(is_shipped("base") && !is_shipped("base:latest") && !is_shipped("my-app"));
    }

    /// The definitions are ordinary builds: the build API takes their JSON
    /// and the builder's own step check passes every step (a COPY's hash is
    /// what the CLI adds on upload).
    #[test]
    fn the_builder_accepts_every_shipped_definition() {
        for os in [PackageSystem::Debian, PackageSystem::FreeBsd] {
            for (name, text) in copse_templates::definitions(os) {
                let def: TemplateBuildStart = serde_json::from_str(text).unwrap();
                assert!(def.from_image.is_some() != def.from_template.is_some(), "{name}");
                let raw: Vec<RawStep> = def
                    .steps
                    .into_iter()
                    .map(|s| RawStep {
                        files_hash: (s.kind == "COPY").then(|| "0".repeat(64)),
                        kind: s.kind,
                        args: s.args,
                        force: s.force,
                    })
                    .collect();
                parse_steps(&raw).unwrap_or_else(|e| panic!("{name}: {e}"));
            }
        }
    }
}
