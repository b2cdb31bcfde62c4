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
use crate::network::NetworkRequest;
use crate::pool::Booted;
use crate::store::SqliteStore;
use crate::templates::CODE_INTERPRETER;

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

fn air_gapped() -> NetworkRequest {
    NetworkRequest { allow_internet_access: Some(false), ..Default::default() }
}

fn create_request(template: &str, network: NetworkRequest) -> CreateRequest {
    CreateRequest { template: template.into(), network, ..Default::default() }
}

#[tokio::test]
async fn a_cold_create_attaches_the_callers_policy_in_its_one_network_step() {
    let f = fixture(&[]);
    let policy = air_gapped().policy().unwrap();
    let (record, _) = f.svc.create(create_request("base", air_gapped())).await.unwrap();
    assert_eq!(f.substrate.events(), [Event::Attached { id: record.id.clone(), policy: policy.clone() }]);
    assert_eq!(record.network.unwrap().policy, policy);
    assert!(!record.allow_internet_access);
}

#[tokio::test]
async fn a_create_asking_for_nothing_gets_open_egress_in_one_step() {
    let f = fixture(&[]);
    let (record, _) = f.svc.create(create_request("base", NetworkRequest::default())).await.unwrap();
    assert_eq!(f.substrate.events(), [Event::Attached { id: record.id, policy: Policy::open() }]);
}

#[tokio::test]
async fn fork_children_boot_under_their_sources_policy() {
    let f = fixture(&[]);
    let policy = air_gapped().policy().unwrap();
    let (source, _) = f.svc.create(create_request("base", air_gapped())).await.unwrap();
    let children = f.svc.fork(&source.id, 2, MAX_FORKS, 60, false).await.unwrap();
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
    let policy = air_gapped().policy().unwrap();
    let (record, _) = f.svc.create(create_request("base", air_gapped())).await.unwrap();
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
    });
    let policy = air_gapped().policy().unwrap();
    assert!(f.svc.take_pooled(CODE_INTERPRETER, &policy).await.is_none());
    assert_eq!(f.svc.pools[0].ready(), 1, "the pooled sandbox waits for a caller it suits");
}
