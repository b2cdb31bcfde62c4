//! Which substrate this host runs, assembled from the substrate crates:
//! the one place that picks a backend by platform.
//!
//! A crate of its own because every backend depends on `copse-substrate`
//! (for the trait), so that crate cannot construct them. The gateway and
//! the conformance suite call [`host_substrate`] and see one
//! `dyn Substrate` either way.

use std::path::Path;

use copse_substrate::{NetConfig, Substrate};

/// Linux: namespaces only; a template for another backend is refused by
/// the substrate's `ensure_template`, naming what it needs.
/// `network`: the sandbox network to create or re-use (none: loopback only).
#[cfg(target_os = "linux")]
pub fn host_substrate(
    state_dir: &Path,
    agent_binary: &Path,
    network: Option<&NetConfig>,
) -> anyhow::Result<Box<dyn Substrate>> {
    let mut substrate = copse_namespaces::LinuxSubstrate::open(state_dir, agent_binary)?;
    if let Some(config) = network {
        substrate = substrate.with_network(config.clone())?;
    }
    Ok(Box::new(substrate))
}

/// FreeBSD: jails (the default, where every template built before backends
/// existed belongs) and bhyve, routed per template.
/// `network`: the sandbox network to create or re-use (none: loopback
/// only): epairs on an `if_bridge` with one pf anchor per sandbox
/// (`copse_cubenet::freebsd`), which needs pf enabled and the operator's
/// `pf.conf` fragment (docs/freebsd.md).
#[cfg(target_os = "freebsd")]
pub fn host_substrate(
    state_dir: &Path,
    agent_binary: &Path,
    network: Option<&NetConfig>,
) -> anyhow::Result<Box<dyn Substrate>> {
    use copse_bhyve::substrate::{BhyveConfig, BhyveSubstrate};
    use copse_substrate::{Backend, Router};
    let mut jails = copse_freebsd_jails::JailSubstrate::open(state_dir, agent_binary)?;
    if let Some(config) = network {
        jails = jails.with_network(config.clone())?;
    }
    let bhyve = BhyveSubstrate::open(BhyveConfig::from_env(state_dir), copse_bhyve::exec::FreeBsdHost)?;
    Ok(Box::new(Router::open(
        state_dir,
        "freebsd-jail+bhyve",
        vec![(Backend::Jail, Box::new(jails)), (Backend::Bhyve, Box::new(bhyve))],
    )?))
}

/// A sandbox's agent socket, ready to connect to: `AgentSocket::open(path)`
/// pins the socket the substrate made, whatever the sandbox has put in its
/// place, and `.path()` reaches it. Keep it alive until the connect
/// returns. On Linux the socket sits in a directory the sandbox writes, so
/// it is opened without following what is there.
#[cfg(target_os = "linux")]
pub use copse_namespaces::agent_socket::AgentSocket;

/// FreeBSD: the host binds the socket outside the jail's root (jails) or
/// relays it itself (bhyve), where no sandbox writes, so its path is used
/// as it is; not run on FreeBSD.
#[cfg(not(target_os = "linux"))]
#[derive(Debug)]
pub struct AgentSocket(std::path::PathBuf);

#[cfg(not(target_os = "linux"))]
impl AgentSocket {
    pub fn open(socket: &Path) -> std::io::Result<Self> {
        Ok(Self(socket.to_path_buf()))
    }

    pub fn path(&self) -> std::path::PathBuf {
        self.0.clone()
    }
}

/// `copse lazy-image DIR`: serves a lazily fetched layer's image in the
/// directory [`Substrate::new_lazy_layer`] gave, until its layer is
/// removed (`copse_namespaces::lazy`).
#[cfg(target_os = "linux")]
pub fn serve_layer_image(
    dir: &Path,
    source: std::sync::Arc<dyn copse_substrate::ImageSource>,
    ready: impl FnOnce(),
) -> anyhow::Result<()> {
    copse_namespaces::lazy::serve(dir, source, ready)
}

/// FreeBSD's substrates mount no layer images (`new_lazy_layer` is `None`
/// there), so nothing asks for this.
#[cfg(not(target_os = "linux"))]
pub fn serve_layer_image(
    dir: &Path,
    _source: std::sync::Arc<dyn copse_substrate::ImageSource>,
    _ready: impl FnOnce(),
) -> anyhow::Result<()> {
    anyhow::bail!("{}: this host's substrate mounts no layer images", dir.display())
}
