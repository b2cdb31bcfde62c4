//! A gateway as a node of a shared database (`copse up --database
//! postgres://…`): its id, kept in its data dir so a restart is the same
//! node and adopts its sandboxes again; the address other gateways reach
//! it on; its heartbeat; and the operator's `copse node` view.
//!
//! What a node is and how placement chooses one is `model::node`; which
//! records a node acts on is `service::nodes`; forwarding calls to the
//! node that holds a sandbox is `api::forward`.

use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use crate::model::{HEARTBEAT_MS, NodeRecord, NodeStatus, NodeStore, now_ms, validate_node_id};
use crate::service::Sandboxes;
use crate::store::Database;
use crate::tls::cluster::NodeTls;

const NODE_ID_FILE: &str = "node-id";

/// This data dir's node id: the one it was given on its first start on a
/// shared database, or a new one.
pub fn node_id(data_dir: &Path) -> anyhow::Result<String> {
    let path = data_dir.join(NODE_ID_FILE);
    match std::fs::read_to_string(&path) {
        Ok(id) => {
            let id = id.trim().to_string();
            validate_node_id(&id).map_err(anyhow::Error::msg).with_context(|| format!("reading {}", path.display()))?;
            Ok(id)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let id = crate::model::new_id();
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .with_context(|| format!("creating {}", path.display()))?;
            writeln!(file, "{id}")?;
            file.sync_all()?;
            Ok(id)
        }
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// The node id this data dir was given, if it ever joined a shared
/// database (a CLI beside it, such as a volume import, writes as that node).
pub fn existing_node_id(data_dir: &Path) -> anyhow::Result<Option<String>> {
    match data_dir.join(NODE_ID_FILE).exists() {
        true => node_id(data_dir).map(Some),
        false => Ok(None),
    }
}

/// Where other gateways reach this one: `--advertise`, or the address
/// they are served on (the peer listener with cluster TLS, else the API
/// listener) when it names one host. Without cluster TLS only a loopback
/// address will do: forwarded calls carry API keys and access tokens.
pub fn api_url(listen: SocketAddr, advertise: Option<&str>, peer_listen: Option<SocketAddr>) -> anyhow::Result<String> {
    let scheme = if peer_listen.is_some() { "https" } else { "http" };
    let served = peer_listen.unwrap_or(listen);
    let in_the_clear = || {
        anyhow::anyhow!(
            "other nodes would reach this one over plain HTTP: give --cluster-tls DIR and --cluster-listen ADDR \
             (see `copse tls cluster-ca`), or keep the cluster on loopback addresses"
        )
    };
    match advertise {
        Some(url) => {
            let uri: axum::http::Uri = url.parse().with_context(|| format!("--advertise {url:?} is not a URL"))?;
            anyhow::ensure!(
                uri.scheme_str() == Some(scheme) && uri.port_u16().is_some() && uri.path() == "/",
                "--advertise {url:?}: give {scheme}://HOST:PORT (other gateways call it{})",
                if peer_listen.is_some() { " on --cluster-listen" } else { "" }
            );
            let host = uri.host().unwrap_or_default().trim_start_matches('[').trim_end_matches(']');
            let loopback = host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
            if peer_listen.is_none() && !loopback {
                return Err(in_the_clear());
            }
            Ok(url.trim_end_matches('/').to_string())
        }
        None if served.ip().is_unspecified() => {
            anyhow::bail!(
                "serving other nodes on {served}: say where they reach this one with --advertise {scheme}://HOST:PORT"
            )
        }
        None if peer_listen.is_none() && !served.ip().is_loopback() => Err(in_the_clear()),
        None => Ok(format!("{scheme}://{served}")),
    }
}

/// Rewrites this node's record every [`HEARTBEAT_MS`], uploads its new
/// snapshots (and paused sandboxes' files) to the object store as each is
/// taken (and as often while an upload has failed), and pauses its
/// sandboxes away when a drain asks, until aborted. The three run side by
/// side: a long upload never delays a heartbeat. The snapshot table is read only when
/// there may be something to upload.
pub fn spawn_heartbeat(svc: Arc<Sandboxes>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let beats = each_beat("heartbeat", || svc.heartbeat());
        // A drain with --move-sandboxes, seen at most a heartbeat late.
        let moves = each_beat("moving sandboxes out", || svc.move_out_if_asked());
        let releases = each_beat("letting go of sandboxes other nodes took over", || svc.release_moved());
        let fetched = each_beat("removing fetched copies no record names", || svc.release_fetched());
        let uploads = async {
            let mut tick = every();
            // At start: what a previous run left unstored.
            let mut retry = true;
            loop {
                if retry {
                    tokio::select! {
                        _ = tick.tick() => {}
                        _ = svc.snapshot_taken() => {}
                    }
                } else {
                    svc.snapshot_taken().await;
                }
                retry = svc.store_snapshots().await.unwrap_or_else(|e| {
                    tracing::warn!("storing snapshots: {e:#}");
                    true
                });
            }
        };
        tokio::join!(beats, uploads, moves, releases, fetched);
    })
}

/// Every heartbeat interval, takes up a newer revocation list from the
/// database or the node's TLS directory (`NodeTls::refresh`). Whenever one
/// comes into force, forwarding starts over with fresh connections, each
/// verified against it (the peer listener closes its own, `serve`).
pub fn spawn_revocation_watch(
    tls: NodeTls,
    store: Arc<dyn NodeStore>,
    peers: crate::api::forward::Peers,
) -> tokio::task::JoinHandle<()> {
    let mut changes = tls.revocations.changes();
    tokio::spawn(async move {
        let renewals = async {
            while changes.changed().await.is_ok() {
                tracing::info!("a newer revocation list of the cluster CA is in force");
                peers.renew();
            }
        };
        let refreshes = each_beat("taking up the cluster's revocation list", || {
            let (tls, store) = (tls.clone(), store.clone());
            async move {
                tokio::task::spawn_blocking(move || tls.refresh(store.published_revocations()?.as_deref())).await??;
                Ok(())
            }
        });
        tokio::join!(renewals, refreshes);
    })
}

fn every() -> tokio::time::Interval {
    let mut tick = tokio::time::interval(Duration::from_millis(HEARTBEAT_MS as u64));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick
}

/// Runs `job` every heartbeat interval for ever; a failure is logged as
/// `what`'s and the next round runs all the same.
async fn each_beat<F, Fut>(what: &str, mut job: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let mut tick = every();
    loop {
        tick.tick().await;
        if let Err(e) = job().await {
            tracing::warn!("{what}: {e:#}");
        }
    }
}

/// `copse node ls`: one line per node.
pub fn table(nodes: &[NodeRecord], sandboxes: &[(Option<String>, bool)]) -> String {
    let now = now_ms();
    let mut out = format!(
        "{:<20}  {:<8}  {:>7}  {:>9}  {:>8}  {:>6}  {}\n",
        "NODE", "STATUS", "HEARD", "FREE MEM", "RUNNING", "PAUSED", "ADDRESS"
    );
    for node in nodes {
        let mine = sandboxes.iter().filter(|(n, _)| n.as_deref() == Some(node.id.as_str()));
        let paused = mine.clone().filter(|(_, paused)| *paused).count();
        let running = mine.count() - paused;
        out.push_str(&format!(
            "{:<20}  {:<8}  {:>6}s  {:>6} MB  {:>8}  {:>6}  {}\n",
            node.id,
            node.status(now).as_str(),
            (now - node.heartbeat_at_ms).max(0) / 1000,
            node.capacity.memory_free_mb,
            running,
            paused,
            match node.runs_sandboxes() {
                true => node.api_url.clone(),
                false => format!("{} (API only)", node.api_url),
            }
        ));
    }
    out
}

/// `copse node drain|undrain ID`: whether new sandboxes may be placed on
/// it, and whether it moves its own away. Its record's other fields stay
/// as its heartbeat wrote them.
pub fn set_draining(nodes: &dyn NodeStore, id: &str, draining: bool, moving_out: bool) -> anyhow::Result<()> {
    anyhow::ensure!(nodes.set_draining(id, draining, moving_out)?, "no node {id} in this database");
    Ok(())
}

/// `copse node rm ID`: forgets a lost node (stopped for good, or its host
/// gone) that no record needs any more. A node heard from lately is
/// refused: it would register again at its next heartbeat, and its
/// sandboxes would look homeless meanwhile. So is one that records still
/// name, listed, since those are reported lost while their node is, and
/// forgetting it would hide that: a sandbox or a volume on it, or a snapshot
/// or a built template's image it never stored in the object store. Its
/// build-cache entries and journal intents go with it: only that node
/// could use them.
pub fn remove_node(store: &dyn Database, id: &str) -> anyhow::Result<()> {
    let Some(node) = store.node(id)? else { anyhow::bail!("no node {id} in this database") };
    let now = now_ms();
    if node.status(now) != NodeStatus::Lost {
        anyhow::bail!(
            "node {id} was heard from {}s ago; stop it first (a node is lost {}s after its last heartbeat)",
            (now - node.heartbeat_at_ms).max(0) / 1000,
            crate::model::LOST_AFTER_MS / 1000
        );
    }
    let here = |n: &Option<String>| n.as_deref() == Some(id);
    let sandboxes = store.all()?.into_iter().filter(|r| here(&r.node)).count();
    let volumes = store.volumes()?.into_iter().filter(|v| here(&v.node)).count();
    let snapshots = store.snapshots()?.into_iter().filter(|s| here(&s.node) && !s.in_object_store).count();
    let mut templates = 0;
    for template in store.built_templates()?.into_iter().filter(|t| here(&t.node)) {
        let stored = store.template_labels(&template.id)?.unwrap_or_default().stored_images;
        templates += usize::from(template.image.is_none_or(|i| !stored.contains(&i.snapshot_key)));
    }
    let held: Vec<String> = [
        (sandboxes, "sandbox(es)"),
        (volumes, "volume(s)"),
        (snapshots, "snapshot(s) not in the object store"),
        (templates, "built template(s) whose image is not in the object store"),
    ]
    .into_iter()
    .filter(|(count, _)| *count > 0)
    .map(|(count, what)| format!("{count} {what}"))
    .collect();
    if !held.is_empty() {
        anyhow::bail!(
            "node {id} still holds {}; start it again on its data dir to move or delete them, or delete them through the API",
            held.join(", ")
        );
    }
    // Entries in the object store stay: other nodes fetch them.
    for layer in store.build_layers()?.into_iter().filter(|l| here(&l.node) && !l.in_object_store) {
        store.remove_build_layer(&layer.key)?;
    }
    for intent in store.intents()?.into_iter().filter(|i| here(&i.node)) {
        store.remove_intent(&intent.id)?;
    }
    anyhow::ensure!(store.remove_node(id)?, "node {id} was removed meanwhile");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_data_dir_keeps_its_node_id_and_a_bad_one_stops_the_start() {
        let dir = tempfile::tempdir().unwrap();
        let first = node_id(dir.path()).unwrap();
        assert_eq!(node_id(dir.path()).unwrap(), first);
        std::fs::write(dir.path().join(NODE_ID_FILE), "../x\n").unwrap();
        assert!(node_id(dir.path()).is_err());
    }

    #[test]
    fn other_gateways_need_an_address_that_names_a_host_and_tls_off_loopback() {
        let any: SocketAddr = "0.0.0.0:3000".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:3000".parse().unwrap();
        let one: SocketAddr = "10.0.0.5:3000".parse().unwrap();
        let peer: SocketAddr = "10.0.0.5:3443".parse().unwrap();
        assert_eq!(api_url(local, None, None).unwrap(), "http://127.0.0.1:3000");
        assert!(api_url(any, None, None).is_err());
        assert!(api_url(one, None, None).is_err(), "plain HTTP between hosts");
        assert_eq!(api_url(any, Some("http://localhost:3000/"), None).unwrap(), "http://localhost:3000");
        assert!(api_url(any, Some("http://node1:3000"), None).is_err(), "plain HTTP between hosts");
        assert!(api_url(any, Some("https://127.0.0.1:3000"), None).is_err(), "TLS needs the cluster's files");
        assert!(api_url(any, Some("http://127.0.0.1"), None).is_err());
        assert!(api_url(any, Some("http://127.0.0.1:3000/x"), None).is_err());
        // With cluster TLS, the peer listener is the address.
        assert_eq!(api_url(any, None, Some(peer)).unwrap(), "https://10.0.0.5:3443");
        assert_eq!(api_url(one, Some("https://node1:3443"), Some(peer)).unwrap(), "https://node1:3443");
        assert!(api_url(one, Some("http://node1:3443"), Some(peer)).is_err());
        assert!(api_url(one, None, Some("0.0.0.0:3443".parse().unwrap())).is_err());
    }
}
