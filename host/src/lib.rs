//! Which substrate this host runs, assembled from the substrate crates.
//!
//! A crate of its own because `copse-bhyve` implements `copse_jails`'s
//! trait, so `copse-jails` cannot construct it. The gateway calls
//! [`host_substrate`] and sees one `dyn Substrate` either way.

use std::path::Path;

use copse_jails::{NetConfig, Substrate};

/// Linux: namespaces only; a template for another backend is refused by
/// the substrate's `ensure_template`, naming what it needs.
#[cfg(not(target_os = "freebsd"))]
pub fn host_substrate(
    state_dir: &Path,
    agent_binary: &Path,
    network: Option<&NetConfig>,
) -> anyhow::Result<Box<dyn Substrate>> {
    copse_jails::host_substrate(state_dir, agent_binary, network)
}

/// FreeBSD: jails (the default, where every template built before backends
/// existed belongs) and bhyve, routed per template.
#[cfg(target_os = "freebsd")]
pub fn host_substrate(
    state_dir: &Path,
    agent_binary: &Path,
    network: Option<&NetConfig>,
) -> anyhow::Result<Box<dyn Substrate>> {
    use copse_bhyve::substrate::{BhyveConfig, BhyveSubstrate};
    use copse_jails::{Backend, Router};
    let jails = copse_jails::host_substrate(state_dir, agent_binary, network)?;
    let bhyve = BhyveSubstrate::open(BhyveConfig::from_env(state_dir), copse_bhyve::exec::FreeBsdHost)?;
    Ok(Box::new(Router::open(
        state_dir,
        "freebsd-jail+bhyve",
        vec![(Backend::Jail, jails), (Backend::Bhyve, Box::new(bhyve))],
    )?))
}
