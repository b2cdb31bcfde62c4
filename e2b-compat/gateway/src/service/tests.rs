//! The order in which a sandbox gets its egress policy, against a substrate
//! that records what it is asked and an agent that accepts every `/init`:
//! the caller's policy is part of the boot (one network step, before any
//! process of the template starts), except for pooled sandboxes, which are
//! updated on hand-out and whose services never ran under a looser policy
//! than asked.

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::sync::{Arc, Mutex};

use copse_substrate::template::{Backend, TemplateInfo};
use copse_substrate::{
    Capabilities, NetConfig, Placement, Policy, Progress, Recipe, Recovery, SandboxSpec, SnapshotInfo, Substrate,
    Support, Usage,
};

use super::pools::POOL_POLICY;
use super::{CreateRequest, MAX_FORKS, Sandboxes};
use crate::keys::ApiKeys;
use crate::model::{Caller, DEFAULTS_ROW, Quotas, SandboxError, Store, Team};
use crate::network::NetworkRequest;
use crate::pool::Booted;
use crate::store::{Indexed, SqliteStore};
use crate::templates::CODE_INTERPRETER;
use crate::tenancy::Directory;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    /// The sandbox's network was attached under this policy, at boot.
    Attached { id: String, policy: Policy },
    /// Its policy was replaced afterwards: a second network step.
    Updated { id: String, policy: Policy },
}

#[derive(Default)]
struct RecordingSubstrate {
    events: Mutex<Vec<Event>>,
}

impl RecordingSubstrate {
    fn events(&self) -> Vec<Event> {
        self.events.lock().unwrap().clone()
    }

    fn record(&self, event: Event) {
        self.events.lock().unwrap().push(event);
    }
}

/// Answers 200 to every request on `socket`, like an agent taking `/init`.
fn accepting_agent(socket: &std::path::Path) -> anyhow::Result<()> {
    let listener = UnixListener::bind(socket)?;
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let mut request = Vec::new();
            let mut buf = [0u8; 4096];
            // Reads the head and the body its content-length announces.
            while let Ok(n) = stream.read(&mut buf) {
                if n == 0 {
                    break;
                }
                request.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&request).to_ascii_lowercase();
                if let Some(end) = text.find("\r\n\r\n") {
                    let length = text
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    if request.len() >= end + 4 + length {
                        break;
                    }
                }
            }
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
        }
    });
    Ok(())
}

impl Substrate for RecordingSubstrate {
    fn name(&self) -> &'static str {
        "recording"
    }

    fn templates(&self) -> anyhow::Result<Vec<TemplateInfo>> {
        Ok(["base", CODE_INTERPRETER]
            .iter()
            .map(|name| TemplateInfo {
                name: name.to_string(),
                built_at: 0,
                size_bytes: 0,
                backend: Backend::Jail,
                recipe: String::new(),
            })
            .collect())
    }

    fn ensure_template(&self, _recipe: &Recipe, _progress: Progress<'_>) -> anyhow::Result<TemplateInfo> {
        unimplemented!()
    }

    fn create(&self, spec: &SandboxSpec) -> anyhow::Result<Placement> {
        if let Some(network) = &spec.network {
            self.record(Event::Attached { id: spec.id.clone(), policy: network.policy.clone() });
        }
        accepting_agent(&spec.agent_socket)?;
        Ok(Placement { init_pid: 1, init_start: 1 })
    }

    fn destroy(&self, _id: &str) -> anyhow::Result<()> {
        Ok(())
    }

    fn is_alive(&self, _id: &str, _placement: &Placement) -> bool {
        true
    }

    fn usage(&self, _id: &str) -> anyhow::Result<Usage> {
        unimplemented!()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { memory_snapshots: Support::No }
    }

    fn pause(&self, _id: &str) -> anyhow::Result<()> {
        unimplemented!()
    }

    fn resume(&self, _id: &str) -> anyhow::Result<()> {
        unimplemented!()
    }

    fn snapshot(&self, _id: &str, snapshot_id: &str, memory: bool) -> anyhow::Result<SnapshotInfo> {
        Ok(SnapshotInfo { id: snapshot_id.to_string(), template: "base".into(), size_bytes: 0, memory })
    }

    fn snapshots(&self) -> anyhow::Result<Vec<SnapshotInfo>> {
        Ok(Vec::new())
    }

    fn delete_snapshot(&self, _snapshot_id: &str) -> anyhow::Result<()> {
        Ok(())
    }

    fn rollback(&self, _spec: &SandboxSpec, _snapshot_id: &str) -> anyhow::Result<Placement> {
        unimplemented!()
    }

    fn export_snapshot(&self, _snapshot_id: &str, _out: &mut dyn std::io::Write) -> anyhow::Result<()> {
        unimplemented!()
    }

    fn import_snapshot(&self, _snapshot_id: &str, _input: &mut dyn std::io::Read) -> anyhow::Result<SnapshotInfo> {
        unimplemented!()
    }

    fn recover(&self, _known: &[(String, Placement)]) -> anyhow::Result<Recovery> {
        Ok(Recovery::default())
    }

    fn update_network(&self, id: &str, policy: &Policy) -> anyhow::Result<()> {
        self.record(Event::Updated { id: id.to_string(), policy: policy.clone() });
        Ok(())
    }
}

struct Fixture {
    svc: Sandboxes,
    substrate: Arc<RecordingSubstrate>,
    _dir: tempfile::TempDir,
}

fn fixture(pools: &[(String, usize)]) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let substrate = Arc::new(RecordingSubstrate::default());
    let store = SqliteStore::open(&dir.path().join("copse.db")).unwrap();
    let network = NetConfig::new("t", "10.9.0.0/24").unwrap();
    let svc = Sandboxes::new(substrate.clone(), Box::new(store), dir.path().to_path_buf(), pools)
        .with_network(Some(&network));
    Fixture { svc, substrate, _dir: dir }
}

fn op() -> Caller {
    Caller::operator()
}

/// A fixture whose store counts each team's holdings, with `quotas` as
/// every team's limits.
fn tenant_fixture(quotas: Quotas) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let substrate = Arc::new(RecordingSubstrate::default());
    let db = dir.path().join("copse.db");
    let (store, _) =
        Indexed::new(Box::new(SqliteStore::open(&db).unwrap()), None, crate::vault::Vault::open(dir.path()).unwrap())
            .unwrap();
    let settings = SqliteStore::open(&db).unwrap();
    settings.put_team(&Team { name: DEFAULTS_ROW.into(), quotas, created_at_ms: 0 }).unwrap();
    let directory = Directory::open(Box::new(settings), ApiKeys::new(["operator-key-0123456789abcdef"]).unwrap());
    let usage = store.usage();
    let svc = Sandboxes::new(substrate.clone(), Box::new(store), dir.path().to_path_buf(), &[])
        .with_tenancy(usage, directory.unwrap());
    Fixture { svc, substrate, _dir: dir }
}

#[tokio::test]
async fn another_teams_sandboxes_and_snapshots_are_missing_not_forbidden() {
    let f = tenant_fixture(Quotas::default());
    let (a, b) = (Caller::team("a"), Caller::team("b"));
    let (mine, _) = f.svc.create(&a, create_request("base", NetworkRequest::default())).await.unwrap();
    assert_eq!(mine.team, "a");
    assert!(matches!(f.svc.get(&b, &mine.id), Err(SandboxError::NotFound(_))));
    assert!(matches!(f.svc.kill(&b, &mine.id).await, Err(SandboxError::NotFound(_))));
    assert!(matches!(f.svc.pause(&b, &mine.id, true).await, Err(SandboxError::NotFound(_))));
    assert!(matches!(f.svc.fork(&b, &mine.id, 1, MAX_FORKS, 60, false).await, Err(SandboxError::NotFound(_))));
    assert!(matches!(f.svc.set_timeout(&b, &mine.id, 60), Err(SandboxError::NotFound(_))));
    assert!(f.svc.list(&b, &Default::default()).unwrap().is_empty());
    assert_eq!(f.svc.list(&op(), &Default::default()).unwrap().len(), 1, "an admin sees every team");
    let snap = f.svc.create_snapshot(&a, &mine.id, Some("mine".into()), Some(false)).await.unwrap();
    assert_eq!(snap.team, "a");
    assert!(f.svc.snapshots(&b, None, None).unwrap().is_empty());
    assert!(matches!(f.svc.delete_snapshot(&b, "mine").await, Err(SandboxError::SnapshotNotFound(_))));
    // Team b's create naming a's snapshot finds no such template.
    let err = f.svc.create(&b, create_request("mine", NetworkRequest::default())).await.unwrap_err();
    assert!(matches!(err, SandboxError::UnknownTemplate { .. }), "{err:?}");
    // Nor may a snapshot take a template's name.
    let err = f.svc.create_snapshot(&a, &mine.id, Some("base".into()), Some(false)).await.unwrap_err();
    assert!(matches!(err, SandboxError::Invalid(_)), "{err:?}");
    f.svc.kill(&a, &mine.id).await.unwrap();
}

#[tokio::test]
async fn a_fork_that_does_not_fit_is_refused_whole() {
    let f = tenant_fixture(Quotas { max_sandboxes: Some(3), max_sandbox_timeout_s: Some(600), ..Default::default() });
    let a = Caller::team("a");
    let (source, _) = f.svc.create(&a, create_request("base", NetworkRequest::default())).await.unwrap();
    let before = f.substrate.events().len();
    let err = f.svc.fork(&a, &source.id, 3, MAX_FORKS, 60, false).await.unwrap_err();
    assert!(matches!(&err, SandboxError::QuotaExceeded(m) if m.contains("limit of 3 running")), "{err:?}");
    assert_eq!(f.substrate.events().len(), before, "nothing was booted or snapshotted");
    let children = f.svc.fork(&a, &source.id, 2, MAX_FORKS, 60, false).await.unwrap();
    assert!(children.iter().all(|c| c.is_ok()));
    let err = f.svc.create(&a, create_request("base", NetworkRequest::default())).await.unwrap_err();
    assert!(matches!(err, SandboxError::QuotaExceeded(_)), "{err:?}");
    // Another team is not held to a's count; lifetimes are capped for all.
    f.svc.create(&Caller::team("b"), create_request("base", NetworkRequest::default())).await.unwrap();
    let long = CreateRequest { timeout_s: Some(601), ..create_request("base", NetworkRequest::default()) };
    assert!(matches!(f.svc.create(&Caller::team("b"), long).await, Err(SandboxError::QuotaExceeded(_))));
}

fn air_gapped() -> NetworkRequest {
    NetworkRequest { allow_internet_access: Some(false), ..Default::default() }
}

fn create_request(template: &str, network: NetworkRequest) -> CreateRequest {
    CreateRequest { template: template.into(), network, ..Default::default() }
}

#[tokio::test]
async fn a_cold_create_attaches_the_callers_policy_in_its_one_network_step() {
    let f = fixture(&[]);
    let policy = air_gapped().policy("team").unwrap();
    let (record, _) = f.svc.create(&op(), create_request("base", air_gapped())).await.unwrap();
    assert_eq!(f.substrate.events(), [Event::Attached { id: record.id.clone(), policy: policy.clone() }]);
    assert_eq!(record.network.unwrap().policy, policy);
    assert!(!record.allow_internet_access);
}

#[tokio::test]
async fn a_create_asking_for_nothing_gets_open_egress_in_one_step() {
    let f = fixture(&[]);
    let (record, _) = f.svc.create(&op(), create_request("base", NetworkRequest::default())).await.unwrap();
    assert_eq!(f.substrate.events(), [Event::Attached { id: record.id, policy: Policy::open() }]);
}

#[tokio::test]
async fn fork_children_boot_under_their_sources_policy() {
    let f = fixture(&[]);
    let policy = air_gapped().policy("team").unwrap();
    let (source, _) = f.svc.create(&op(), create_request("base", air_gapped())).await.unwrap();
    let children = f.svc.fork(&op(), &source.id, 2, MAX_FORKS, 60, false).await.unwrap();
    let ids: Vec<String> = children.into_iter().map(|c| c.unwrap().id).collect();
    let events = f.substrate.events();
    assert!(!events.iter().any(|e| matches!(e, Event::Updated { .. })), "{events:?}");
    for id in ids {
        assert!(events.contains(&Event::Attached { id, policy: policy.clone() }), "{events:?}");
    }
}

#[tokio::test]
async fn a_pooled_sandbox_without_a_service_is_updated_on_hand_out() {
    let f = fixture(&[("base".into(), 1)]);
    let pooled = f.svc.boot("base", &POOL_POLICY).await.unwrap();
    let pooled_id = pooled.id.clone();
    f.svc.pools[0].put(pooled);
    let policy = air_gapped().policy("team").unwrap();
    let (record, _) = f.svc.create(&op(), create_request("base", air_gapped())).await.unwrap();
    assert_eq!(record.id, pooled_id);
    assert_eq!(
        f.substrate.events(),
        [
            Event::Attached { id: pooled_id.clone(), policy: Policy::open() },
            Event::Updated { id: pooled_id, policy: policy.clone() },
        ]
    );
    assert_eq!(record.network.unwrap().policy, policy);
}

#[tokio::test]
async fn a_pooled_sandbox_whose_service_runs_goes_only_to_a_caller_asking_for_the_pools_policy() {
    let f = fixture(&[(CODE_INTERPRETER.into(), 1)]);
    f.svc.pools[0].put(Booted {
        id: "pooled".into(),
        placement: Placement { init_pid: 1, init_start: 1 },
        agent_socket: "/nonexistent".into(),
        network: None,
        phases: Default::default(),
    });
    let policy = air_gapped().policy("team").unwrap();
    assert!(f.svc.take_pooled(CODE_INTERPRETER, &policy).await.is_none());
    assert_eq!(f.svc.pools[0].ready(), 1, "the pooled sandbox waits for a caller it suits");
}

#[tokio::test]
async fn a_label_edit_that_lost_a_race_runs_again_on_the_winners_labels() {
    let f = fixture(&[]);
    let record: crate::model::TemplateRecord = serde_json::from_value(serde_json::json!({
        "id": "t1", "team": "acme", "name": "app", "created_at_ms": 0, "build_count": 1, "upload_token": "u",
        "build": { "id": "b1", "status": "ready", "log": [], "created_at_ms": 0, "updated_at_ms": 0,
                   "cpu_count": 1, "memory_mb": 512 }
    }))
    .unwrap();
    let mut runs = 0;
    let (labels, ()) = f
        .svc
        .change_labels(&record, |labels| {
            runs += 1;
            if runs == 1 {
                // Another edit reads and writes between this one's read and
                // its write.
                f.svc
                    .change_labels(&record, |other| {
                        other.public = true;
                        Ok(())
                    })
                    .unwrap();
            }
            labels.assign("v1", "b1", "a1".into(), 0)
        })
        .unwrap();
    assert_eq!(runs, 2);
    assert!(labels.public, "the other edit was undone");
    assert_eq!(labels.tag("v1").map(|t| t.build_id()), Some("b1"));
    assert_eq!(labels.revision, 2);
}
