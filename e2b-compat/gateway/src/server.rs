//! `copse up`: open the state, make sure templates exist, re-adopt or clean
//! what a previous run left, then serve until SIGINT/SIGTERM.

use std::sync::Arc;

use anyhow::Context;
use copse_substrate::template::Recipe;
use copse_substrate::{Substrate, Support};

use crate::api::{self, Exposure};
use crate::config::{self, Config};
use crate::keys::{ApiKeys, Origin};
use crate::model::Caller;
use crate::progress::Reporter;
use crate::service::{Sandboxes, Secrets, Volumes};
use crate::store::{self, Database, Indexed};
use crate::tenancy::Directory;
use crate::vault::Vault;
use crate::{reaper, serve, telemetry, tls};

pub fn open_substrate(config: &Config) -> anyhow::Result<Arc<dyn Substrate>> {
    config::private_data_dir(&config.data_dir)?;
    if !config.sandboxes {
        return Ok(Arc::new(copse_substrate::none::NoSandboxes));
    }
    Ok(Arc::from(copse_host::host_substrate(&config.data_dir, &config.agent_binary, config.network.as_ref())?))
}

/// The state database: PostgreSQL when a URL is configured, else SQLite
/// in the data dir.
pub fn open_store(config: &Config) -> anyhow::Result<Box<dyn Database>> {
    match &config.database_url {
        Some(url) => Ok(Box::new(store::PostgresStore::open(url)?)),
        None => {
            config::private_data_dir(&config.data_dir)?;
            Ok(Box::new(store::SqliteStore::open(&config.database())?))
        }
    }
}

/// This gateway's seat in a shared database (`None` on its own SQLite).
fn membership(config: &Config) -> anyhow::Result<Option<crate::service::Membership>> {
    let Some(url) = &config.database_url else { return Ok(None) };
    config::private_data_dir(&config.data_dir)?;
    Ok(Some(
        crate::service::Membership::new(
            crate::cluster::node_id(&config.data_dir)?,
            crate::cluster::api_url(
                config.listen,
                config.advertise.as_deref(),
                config.cluster_tls.as_ref().map(|c| c.listen),
            )?,
            Arc::new(store::PostgresStore::open(url)?),
        )
        .with_objects(config.object_store.as_ref().map(copse_objects::Bucket::open).transpose()?, config.lazy_fetch),
    ))
}

pub fn default_recipes() -> Vec<Recipe> {
    crate::templates::recipes()
}

/// Builds each recipe that is missing or was built from an older recipe,
/// showing progress. (The Linux substrate rebuilds an outdated template;
/// FreeBSD's and bhyve's keep what they built: not run on FreeBSD.)
pub fn ensure_templates(substrate: &dyn Substrate, recipes: &[Recipe]) -> anyhow::Result<()> {
    for recipe in recipes {
        let built = substrate.templates()?.into_iter().find(|t| t.name == recipe.name);
        if let Some(built) = &built {
            // Names are unique across backends: the gateway routes by name.
            anyhow::ensure!(
                built.backend == recipe.backend,
                "template {} is already built for the {} backend, not {}",
                recipe.name,
                built.backend,
                recipe.backend
            );
            if built.recipe == recipe.fingerprint() {
                continue;
            }
        }
        let title = match built {
            Some(_) => format!("updating template {} (its recipe changed)", recipe.name),
            None => format!("building template {}", recipe.name),
        };
        let reporter = Reporter::new(&title);
        let result = substrate.ensure_template(recipe, &|line| reporter.line(line));
        reporter.finish();
        result?;
    }
    Ok(())
}

/// One log line per feature this host could offer but lacks what it needs
/// for, saying what is missing and how to install it; requests that need
/// the feature are then answered 503 with the same words.
fn report_missing_features(substrate: &dyn Substrate) {
    if let Support::Missing(why) = substrate.capabilities().memory_snapshots {
        tracing::warn!("{why}");
    }
}

/// The copse egress CA (made on the data dir's first start), handed to the
/// substrate's egress proxy with the roots it verifies upstreams against.
fn egress_interception(config: &Config, substrate: &dyn Substrate) -> anyhow::Result<Arc<copse_substrate::EgressCa>> {
    let ca = Arc::new(copse_substrate::EgressCa::load_or_create(&config.egress_ca_dir())?);
    let interceptor = copse_substrate::Interceptor::new(ca.clone(), config.egress_upstream_ca.as_deref())
        .context("the egress proxy's upstream roots (--egress-upstream-ca)")?;
    substrate.set_interceptor(Arc::new(interceptor));
    Ok(ca)
}

pub async fn run(config: Config) -> anyhow::Result<()> {
    // A bad certificate fails before templates are built or sandboxes touched.
    let tls = config.tls.as_ref().map(|files| tls::acceptor(&files.cert, &files.key)).transpose()?;
    let node_tls = config.cluster_tls.as_ref().map(|c| tls::cluster::NodeTls::load(&c.dir)).transpose()?;
    // So is a short key; a generated one exists before anything is built.
    config::private_data_dir(&config.data_dir)?;
    let keys = ApiKeys::load(&config.data_dir, &config.listen)?;
    // A damaged keyring stops the start too, before anything is built.
    let vault = Vault::open(&config.data_dir)?;
    anyhow::ensure!(
        !config.sandboxes || config.agent_binary.is_file(),
        "agent binary {} not found (build it with `mise run build`)",
        config.agent_binary.display()
    );
    let membership = membership(&config)?;
    let substrate = open_substrate(&config)?;
    for (registry, mirror) in config.registries.mirrors() {
        let scheme = if mirror.plain_http { "http" } else { "https" };
        tracing::info!("registry {registry} is pulled from the mirror {scheme}://{}", mirror.host);
    }
    if substrate.runs_sandboxes() {
        let substrate = substrate.clone();
        tokio::task::spawn_blocking(move || {
            report_missing_features(substrate.as_ref());
            ensure_templates(substrate.as_ref(), &default_recipes())
        })
        .await??;
    }
    let node = membership.as_ref().map(|m| m.id.clone());
    let (store, access_tokens) = Indexed::new(open_store(&config)?, node.as_deref(), vault.clone())?;
    // Its own connection: `data_version` then moves when anyone else,
    // the CLI among them, changes keys or teams.
    let directory = Directory::open(open_store(&config)?, keys.clone())?;
    let usage = store.usage();
    let secrets = Arc::new(Secrets::new(Arc::<dyn Database>::from(open_store(&config)?), vault));
    // Before any sandbox is adopted: its requests may need a rule's secret.
    substrate.set_secret_resolver(secrets.resolver());
    let egress_ca = match &config.network {
        Some(_) if substrate.runs_sandboxes() => Some(egress_interception(&config, substrate.as_ref())?),
        _ => None,
    };
    let svc = Arc::new(
        Sandboxes::new(substrate.clone(), Box::new(store), config.run_dir(), &config.pools)
            .with_secrets(secrets.clone())
            .with_network(config.network.as_ref())
            .with_disk_mb(config.disk_mb)
            .with_registries(config.registries.clone(), &config.data_dir)
            .with_sandbox_log(crate::sandbox_log::SandboxLog::open(config.sandbox_logs())?)
            .with_tenancy(usage, directory.clone())
            .with_egress_ca(egress_ca.as_deref().map(copse_substrate::EgressCa::cert_pem))
            .with_membership(membership),
    );
    let recovery = svc.recover().await?;
    if !recovery.adopted.is_empty() || !recovery.removed.is_empty() {
        tracing::info!(adopted = ?recovery.adopted, removed = ?recovery.removed, "recovered sandboxes from the previous run");
    }
    // Bound before the node is registered: other nodes may forward to it
    // as soon as it is.
    let peer_listener = match &config.cluster_tls {
        Some(cluster) => Some(
            tokio::net::TcpListener::bind(cluster.listen)
                .await
                .with_context(|| format!("listening for other nodes on {}", cluster.listen))?,
        ),
        None => None,
    };
    // Registered before it listens: a create on another gateway may be
    // placed here as soon as this returns.
    let heartbeat = match svc.node() {
        Some(node) => {
            svc.heartbeat().await.context("registering this node")?;
            tracing::info!(node, "node of a shared database");
            Some(crate::cluster::spawn_heartbeat(svc.clone()))
        }
        None => None,
    };
    let abandoned = {
        let (data_dir, substrate) = (config.data_dir.clone(), substrate.clone());
        let store = open_store(&config)?;
        tokio::task::spawn_blocking(move || {
            crate::volume_archive::remove_abandoned_imports(&data_dir, store.as_ref(), substrate.as_ref())
        })
        .await??
    };
    if !abandoned.is_empty() {
        tracing::info!(volumes = ?abandoned, "removed volumes whose import a crash cut short");
    }
    let interrupted = svc.fail_interrupted_builds()?;
    if interrupted > 0 {
        tracing::info!(interrupted, "template builds interrupted by the previous run ended in error");
    }
    svc.collect_image_templates().await;
    // From here sandboxes boot in the background (warm-up, pools), so a
    // signal must reach the drain below, however early it comes: tokio
    // replaces the default action (death, leaving those boots on the host)
    // only once a handler is registered.
    let signalled = shutdown_signal()?;
    let reaper = reaper::spawn(&svc);
    let refresher = directory.spawn_refresher();
    let warmer = svc.spawn_warmer();
    let pools = svc.spawn_pools();
    let listener = match config.api {
        true => Some(
            tokio::net::TcpListener::bind(config.listen)
                .await
                .with_context(|| format!("listening on {}", config.listen))?,
        ),
        false => None,
    };
    let metrics = match config.metrics_listen {
        Some(at) => {
            let (bound, task) = telemetry::listener::spawn(at, svc.clone()).await?;
            println!("operator metrics on http://{bound}/metrics");
            Some(task)
        }
        None => None,
    };
    let exposure = Exposure { domain: config.domain.as_deref().map(|d| d.trim_end_matches('.').to_ascii_lowercase()) };
    match &listener {
        Some(listener) => {
            let runs = match substrate.runs_sandboxes() {
                true => substrate.name(),
                false => "API only: sandboxes run on the cluster's nodes",
            };
            print_usage(listener.local_addr()?, &exposure, tls.is_some(), keys.origin(), runs)
        }
        None => println!(
            "copse {} node {}: no E2B API of its own (--no-api); the cluster's gateways place sandboxes here ({})",
            env!("CARGO_PKG_VERSION"),
            svc.node().unwrap_or("-"),
            substrate.name()
        ),
    }
    let volumes = Arc::new(
        Volumes::new(Arc::<dyn Database>::from(open_store(&config)?), substrate.clone(), svc.clone())
            .with_directory(directory.clone()),
    );
    let gate = api::Gate { directory, rates: Default::default() };
    let peers = api::forward::Peers::new(node_tls.as_ref().map(|t| t.client.clone()));
    let app = api::router(svc.clone(), secrets, volumes, gate, exposure)
        .layer(axum::Extension(access_tokens))
        .layer(axum::Extension(peers.clone()));
    let keep_sandboxes = config.keep_sandboxes;
    let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
    let (peers_stop_tx, peers_stop_rx) = tokio::sync::watch::channel(false);
    let revocation_watch = match &node_tls {
        Some(node_tls) => Some(crate::cluster::spawn_revocation_watch(
            node_tls.clone(),
            Arc::<dyn Database>::from(open_store(&config)?),
            peers.clone(),
        )),
        None => None,
    };
    let mut peer_server = match (peer_listener, node_tls) {
        (Some(listener), Some(node_tls)) => {
            println!("serving other nodes on https://{} (mutual TLS)", listener.local_addr()?);
            let app = app.clone().layer(axum::Extension(api::forward::PeerLink));
            // Every node's calls come from its one address.
            let limits = serve::Limits { per_client: PEER_CONNECTIONS, ..config.limits };
            let mut stop = peers_stop_rx;
            let stopped = async move {
                let _ = stop.wait_for(|stopped| *stopped).await;
            };
            let tls = serve::Tls { acceptor: node_tls.acceptor, revocations: Some(node_tls.revocations) };
            Some(tokio::spawn(serve::serve(listener, Some(tls), app, limits, stopped)))
        }
        _ => None,
    };
    let stop = {
        let svc = svc.clone();
        async move {
            signalled.await;
            reaper.abort();
            if let Some(heartbeat) = heartbeat {
                heartbeat.abort();
                // Its last beat must not come after a front leaves.
                let _ = heartbeat.await;
                svc.leave_if_front().await;
            }
            if let Some(metrics) = metrics {
                metrics.abort();
            }
            refresher.abort();

            // Sandboxes go first: their command streams are the responses
            // graceful shutdown would otherwise wait on for ever.
            svc.drain_pools(pools).await;
            svc.stop_warmer(warmer).await;
            if !keep_sandboxes {
                kill_all(&svc).await;
            }
            svc.settle().await;
            // The grace for streams still open starts now: counted from the
            // signal, it could cut short a drain that waits for a boot or a
            // warm-up in flight, leaving its sandbox behind.
            let _ = stopping_tx.send(());
            let _ = peers_stop_tx.send(true);
        }
    };
    // Streams still open (sandboxes kept on purpose) get a grace period.
    let grace = async {
        let _ = stopping_rx.await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    match listener {
        Some(listener) => {
            let server = serve::serve(listener, tls.map(serve::Tls::from), app, config.limits, stop);
            tokio::select! {
                result = server => result?,
                _ = grace => tracing::warn!("closing connections still open after {SHUTDOWN_GRACE:?}"),
            }
        }
        // A worker node: the peer listener is its only server.
        None => {
            stop.await;
            if let Some(peer_server) = peer_server.as_mut() {
                tokio::select! {
                    result = peer_server => result??,
                    _ = grace => tracing::warn!("closing connections still open after {SHUTDOWN_GRACE:?}"),
                }
            }
        }
    }
    if let Some(peer_server) = peer_server {
        peer_server.abort();
    }
    if let Some(watch) = revocation_watch {
        watch.abort();
    }
    println!("copse stopped");
    Ok(())
}

/// The banner: where the API is and how to point the SDK at it. It names
/// where a key can be found, never a key.
fn print_usage(addr: std::net::SocketAddr, exposure: &Exposure, tls: bool, keys: &Origin, substrate: &str) {
    let version = env!("CARGO_PKG_VERSION");
    let key = key_hint(keys);
    match (&exposure.domain, tls) {
        (Some(domain), true) => {
            println!("copse {version} serving the E2B API on https://api.{domain} ({addr}, {substrate})");
            println!("sandbox ports are https://<port>-<sandboxID>.{domain}; point the E2B SDK at it with:");
            println!("  export E2B_DOMAIN={domain}");
            println!("  {key}");
            println!("  unset E2B_API_URL E2B_SANDBOX_URL");
            println!("(the names must resolve to {}: see `copse tls init`)", addr.ip());
        }
        (domain, _) => {
            println!("copse {version} serving the E2B API on http://{addr} ({substrate})");
            println!("point the E2B SDK at it with:");
            println!("  export E2B_API_URL=http://{addr}");
            println!("  export E2B_SANDBOX_URL=http://{addr}");
            println!("  {key}");
            if let Some(domain) = domain {
                println!(
                    "sandbox ports are reachable as http://<port>-<sandboxID>.{domain} (route those names to {addr})"
                );
            }
        }
    }
}

/// The banner's line for E2B_API_KEY.
fn key_hint(keys: &Origin) -> String {
    match keys {
        Origin::File { generated: Some(file), .. } => {
            format!("export E2B_API_KEY=\"$(cat {})\"   # readable by copse's user only", file.display())
        }
        Origin::File { keys, generated: None } => {
            format!("export E2B_API_KEY=...   # a key whose hash is in {}", keys.display())
        }
        Origin::Environment => "export E2B_API_KEY=...   # a key from COPSE_API_KEY".to_string(),
    }
}

/// Connections one node may hold open to another's peer listener: its
/// forwarded command streams and uploads, for every sandbox there.
const PEER_CONNECTIONS: usize = 4096;

/// How long open connections may finish after the sandboxes are gone.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Running sandboxes die with the gateway (unless kept on purpose); paused
/// ones are durable by definition and wait for the next start.
async fn kill_all(svc: &Sandboxes) {
    let Ok(records) = svc.list(&Caller::operator(), &Default::default()) else { return };
    for record in records.into_iter().filter(|r| r.paused.is_none() && svc.holds(r.node.as_deref())) {
        if let Err(e) = svc.kill(&Caller::operator(), &record.id).await {
            tracing::error!("killing {} on shutdown: {e:#}", record.id);
        }
    }
}

/// SIGTERM or SIGINT, caught from this call on (a signal that arrives
/// before the returned future is polled is kept for it).
fn shutdown_signal() -> anyhow::Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("catching SIGTERM")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("catching SIGINT")?;
    Ok(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = term.recv() => {}
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_banner_says_where_a_key_is_never_what_it_is() {
        let generated = Origin::File { keys: "/d/api-keys".into(), generated: Some("/d/generated-api-key".into()) };
        assert!(key_hint(&generated).starts_with(r#"export E2B_API_KEY="$(cat /d/generated-api-key)""#));
        let file = Origin::File { keys: "/d/api-keys".into(), generated: None };
        assert!(key_hint(&file).contains("/d/api-keys"));
        assert!(key_hint(&Origin::Environment).contains("COPSE_API_KEY"));
    }
}
