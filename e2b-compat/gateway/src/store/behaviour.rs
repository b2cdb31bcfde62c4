//! What every [`Database`] does, whichever engine holds it. Each test here
//! runs against SQLite (`sqlite.rs`) and against a real PostgreSQL
//! (`postgres.rs`) through [`behaviours!`]; what only one engine has (file
//! modes, old SQLite layouts) is tested beside it.

use super::Database;
use crate::model::{
    Admit, BuildLayer, Capacity, Change, DEFAULT_TEAM, Intent, KeyRecord, NodeRecord, PlaceClaim, SandboxError,
    SandboxRecord, SecretRecord, SnapshotRecord, Team, TeamUsage, TemplateLabels, TemplateRecord, VolumeMove,
    VolumeRecord,
};

/// One fresh database and ways into it.
pub trait Backend {
    /// Another connection to it: a second one is what the CLI beside a
    /// running gateway, or another gateway, has.
    fn open(&self) -> Box<dyn Database>;
    /// Runs SQL on it directly, as an operator's edit or a torn write would.
    fn execute(&self, sql: &str);
    /// The quarantine table's (kind, id, record), ordered by kind and id.
    fn quarantined(&self) -> Vec<(String, String, String)>;
}

/// One `#[test]` per behaviour, each with a fresh `$backend`.
macro_rules! behaviours {
    ($backend:expr) => {
        $crate::store::behaviour::behaviours!(
            @each $backend;
            a_build_layer_is_found_only_by_its_team_and_outlives_the_connection,
            a_volume_name_is_taken_once_per_team,
            a_volume_moves_only_from_the_node_and_state_its_mover_read,
            a_nodes_heartbeat_replaces_its_record_but_not_the_operators_drain,
            a_node_is_removed_only_once_lost_and_holding_nothing,
            a_teams_places_are_claimed_one_at_a_time_and_settled_by_the_owners_heartbeat,
            a_secret_name_is_taken_once_and_freed_by_removal,
            journal_intents_outlive_the_connection_until_cleared_and_a_torn_one_is_quarantined,
            an_unreadable_row_is_quarantined_and_the_rest_still_listed,
            snapshot_names_are_per_team,
            a_snapshot_is_updated_only_while_it_names_the_same_files,
            a_paused_sandbox_is_claimed_only_while_it_names_the_same_node_and_files,
            keys_are_revoked_by_an_unambiguous_prefix_and_other_connections_are_noticed,
            sandboxes_are_listed_by_id_and_expire_by_their_end,
            templates_are_found_by_id_and_by_name_within_their_team
        );
    };
    (@each $backend:expr; $($name:ident),*) => {
        $(
            #[test]
            fn $name() {
                let backend = $backend;
                $crate::store::behaviour::$name(&backend);
            }
        )*
    };
}
pub(super) use behaviours;

pub fn a_build_layer_is_found_only_by_its_team_and_outlives_the_connection(db: &dyn Backend) {
    let layer = BuildLayer {
        key: "k1".into(),
        team: "a".into(),
        substrate_template: "base".into(),
        snapshot_key: "s1".into(),
        envs: vec![("A".into(), "1".into())],
        user: "user".into(),
        workdir: Some("/w".into()),
        templates: vec!["t1".into()],
        created_at_ms: 1,
        node: Some("n".into()),
        in_object_store: false,
    };
    db.open().put_build_layer(&layer).unwrap();
    let store = db.open();
    assert_eq!(store.build_layer("a", "k1").unwrap(), Some(layer.clone()));
    assert_eq!(store.build_layer("b", "k1").unwrap(), None);
    // A torn row is quarantined, not fatal to the listing.
    db.execute("INSERT INTO build_layers (id, team, record) VALUES ('k2', 'a', '{')");
    assert_eq!(store.build_layers().unwrap(), vec![layer]);
    assert!(store.remove_build_layer("k1").unwrap());
    assert_eq!(store.build_layers().unwrap(), vec![]);
}

pub fn a_volume_name_is_taken_once_per_team(db: &dyn Backend) {
    let store = db.open();
    let volume = |id: &str, team: &str| VolumeRecord {
        id: id.into(),
        team: team.into(),
        name: "data".into(),
        token: "t".into(),
        created_at_ms: 0,
        node: Some("n1".into()),
        moved_out: None,
    };
    assert!(store.insert_volume(&volume("a", DEFAULT_TEAM)).unwrap());
    assert!(!db.open().insert_volume(&volume("b", DEFAULT_TEAM)).unwrap(), "taken, whoever asks");
    assert!(store.insert_volume(&volume("c", "acme")).unwrap(), "names are per team");
    assert_eq!(store.volume_named("acme", "data").unwrap().unwrap().id, "c");
    assert_eq!(store.volume("a").unwrap().unwrap().team, DEFAULT_TEAM);
    assert_eq!(store.volume("a").unwrap().unwrap().node.as_deref(), Some("n1"));
    assert_eq!(store.volumes().unwrap().len(), 2);
    assert!(store.remove_volume("a").unwrap());
    assert!(!store.remove_volume("a").unwrap());
    assert!(store.volume_named(DEFAULT_TEAM, "data").unwrap().is_none());
}

pub fn a_volume_moves_only_from_the_node_and_state_its_mover_read(db: &dyn Backend) {
    let (one, two) = (db.open(), db.open());
    let mut volume = VolumeRecord {
        id: "v".into(),
        team: DEFAULT_TEAM.into(),
        name: "data".into(),
        token: "t".into(),
        created_at_ms: 0,
        node: Some("n1".into()),
        moved_out: None,
    };
    assert!(one.insert_volume(&volume).unwrap());
    volume.moved_out = Some(VolumeMove::Uploading);
    assert!(!one.swap_volume(&volume, Some("n2"), None).unwrap(), "not on n2");
    assert!(one.swap_volume(&volume, Some("n1"), None).unwrap());
    let stored = VolumeMove::Stored { manifest_sha256: "aa".into() };
    volume.moved_out = Some(stored.clone());
    assert!(!one.swap_volume(&volume, Some("n1"), None).unwrap(), "no longer unmoved");
    assert!(one.swap_volume(&volume, Some("n1"), Some(&VolumeMove::Uploading)).unwrap());
    // Two nodes fetch it; the first to swap takes it.
    let taken = |node: &str| VolumeRecord { node: Some(node.into()), moved_out: None, ..volume.clone() };
    assert!(two.swap_volume(&taken("n2"), Some("n1"), Some(&stored)).unwrap());
    assert!(!one.swap_volume(&taken("n3"), Some("n1"), Some(&stored)).unwrap(), "taken already");
    let other = VolumeMove::Stored { manifest_sha256: "bb".into() };
    assert!(!one.swap_volume(&taken("n3"), Some("n2"), Some(&other)).unwrap(), "another upload");
    let now = one.volume("v").unwrap().unwrap();
    assert_eq!((now.node.as_deref(), now.moved_out), (Some("n2"), None));
}

pub fn a_nodes_heartbeat_replaces_its_record_but_not_the_operators_drain(db: &dyn Backend) {
    let (gateway, operator) = (db.open(), db.open());
    let mut node = NodeRecord {
        id: "bbbbbbbbbbbbbbbbbbbb".into(),
        api_url: "http://10.0.0.2:49982".into(),
        substrate: "linux-namespaces".into(),
        capacity: Capacity { cpus: 2, memory_mb: 8192, memory_free_mb: 4096, disk_free_mb: 100, running: 0 },
        templates: vec!["base".into()],
        started_at_ms: 1,
        heartbeat_at_ms: 1,
        draining: false,
        moving_out: false,
        teams: [("acme".to_string(), TeamUsage { running: 2, paused: 1, snapshots: 3, disk_bytes: 4 << 30 })].into(),
    };
    assert!(!operator.set_draining(&node.id, true, false).unwrap(), "no such node yet");
    gateway.beat(&node, &[]).unwrap();
    gateway.beat(&NodeRecord { id: "aaaaaaaaaaaaaaaaaaaa".into(), ..node.clone() }, &[]).unwrap();
    assert!(operator.set_draining(&node.id, true, true).unwrap());
    // The next heartbeat was computed before the drain: it keeps it.
    node.heartbeat_at_ms = 2_001;
    node.capacity.running = 3;
    gateway.beat(&node, &[]).unwrap();
    let seen = operator.nodes().unwrap();
    assert_eq!(seen.iter().map(|n| n.id.as_str()).collect::<Vec<_>>(), ["aaaaaaaaaaaaaaaaaaaa", node.id.as_str()]);
    assert_eq!(operator.node(&node.id).unwrap(), Some(NodeRecord { draining: true, moving_out: true, ..node.clone() }));
    assert!(operator.set_draining(&node.id, false, false).unwrap());
    gateway.beat(&node, &[]).unwrap();
    let undrained = operator.node(&node.id).unwrap().unwrap();
    assert!(!undrained.draining && !undrained.moving_out);
    assert!(operator.remove_node(&node.id).unwrap());
    assert!(!operator.remove_node(&node.id).unwrap());
    // The revocation list: the last one published, seen by another
    // connection.
    assert_eq!(gateway.published_revocations().unwrap(), None);
    operator.publish_revocations("first").unwrap();
    operator.publish_revocations("second").unwrap();
    assert_eq!(gateway.published_revocations().unwrap().as_deref(), Some("second"));
    assert_eq!(gateway.node(&node.id).unwrap(), None);
}

pub fn a_teams_places_are_claimed_one_at_a_time_and_settled_by_the_owners_heartbeat(db: &dyn Backend) {
    let (a, b) = (db.open(), db.open());
    let running = |running| TeamUsage { running, ..Default::default() };
    let node = |id: &str, started_at_ms: i64, held: u64| NodeRecord {
        id: id.into(),
        api_url: String::new(),
        substrate: "linux-namespaces".into(),
        capacity: Capacity::default(),
        templates: vec![],
        started_at_ms,
        heartbeat_at_ms: started_at_ms,
        draining: false,
        moving_out: false,
        teams: [("acme".to_string(), running(held))].into(),
    };
    let claim = |id: &str, node: &str, at_ms: i64| PlaceClaim {
        id: id.into(),
        node: node.into(),
        team: "acme".into(),
        usage: running(1),
        at_ms,
    };
    // Admits one more running sandbox while the other nodes hold fewer
    // than `max`.
    let below = |max: u64| -> Admit {
        Box::new(move |elsewhere: TeamUsage| {
            if elsewhere.running + 1 > max {
                return Err(SandboxError::QuotaExceeded(format!("{} elsewhere", elsewhere.running)));
            }
            Ok(())
        })
    };
    let held = |store: &dyn crate::store::Database, node: &str| store.held_elsewhere(node, "acme").unwrap().running;

    a.beat(&node("a", 100, 1), &[]).unwrap();
    b.beat(&node("b", 100, 0), &[]).unwrap();
    assert_eq!((held(b.as_ref(), "b"), held(a.as_ref(), "a")), (1, 0), "a node's own figures are left out");
    a.claim_places(&claim("c1", "a", 150), below(3)).unwrap().unwrap();
    assert_eq!(held(b.as_ref(), "b"), 2, "figures and claims add up");
    assert_eq!(b.held_elsewhere("b", "bolt").unwrap(), TeamUsage::default(), "another team's are its own");
    let refused = b.claim_places(&claim("c2", "b", 150), below(2)).unwrap().unwrap_err();
    assert!(refused.to_string().contains("2 elsewhere"), "{refused}");
    assert_eq!(held(a.as_ref(), "a"), 0, "a refused claim is not stored");

    // Settled by the heartbeat whose figures include it: counted once.
    a.beat(&node("a", 100, 2), &["c1".to_string()]).unwrap();
    assert_eq!(held(b.as_ref(), "b"), 2);
    // A claim of an earlier run goes with the restarted node's first
    // heartbeat; one of this run stays until settled.
    a.claim_places(&claim("c3", "a", 150), below(9)).unwrap().unwrap();
    a.claim_places(&claim("c4", "a", 250), below(9)).unwrap().unwrap();
    a.beat(&node("a", 200, 0), &[]).unwrap();
    assert_eq!(held(b.as_ref(), "b"), 1);
    assert!(a.remove_node("a").unwrap());
    assert_eq!(held(b.as_ref(), "b"), 0, "a removed node's claims go with it");

    // Nodes claiming together for one team: never more than the limit.
    let stores: Vec<_> = (0..8).map(|_| db.open()).collect();
    let admitted = std::thread::scope(|s| {
        let claiming: Vec<_> = stores
            .into_iter()
            .enumerate()
            .map(|(i, store)| {
                s.spawn(move || {
                    let node = format!("n{i}");
                    store.claim_places(&claim(&format!("t{i}"), &node, 300), below(4)).unwrap().is_ok()
                })
            })
            .collect();
        claiming.into_iter().map(|h| h.join().unwrap()).filter(|admitted| *admitted).count()
    });
    assert_eq!(admitted, 4);
}

fn secret(id: &str, name: &str) -> SecretRecord {
    SecretRecord {
        id: id.into(),
        team: DEFAULT_TEAM.into(),
        name: name.into(),
        metadata: Default::default(),
        created_at_ms: 0,
        updated_at_ms: 0,
        versions: Vec::new(),
    }
}

fn key(hash: &str, prefix: &str, team: &str) -> KeyRecord {
    KeyRecord {
        hash: hash.into(),
        prefix: prefix.into(),
        team: team.into(),
        label: String::new(),
        admin: false,
        created_at_ms: 1,
        last_used_ms: None,
    }
}

pub fn a_node_is_removed_only_once_lost_and_holding_nothing(db: &dyn Backend) {
    let store = db.open();
    let id = "cccccccccccccccccccc";
    let beat = |at_ms: i64| NodeRecord {
        id: id.into(),
        api_url: "http://10.0.0.3:49982".into(),
        substrate: "linux-namespaces".into(),
        capacity: Capacity { cpus: 2, memory_mb: 8192, memory_free_mb: 4096, disk_free_mb: 100, running: 0 },
        templates: vec!["base".into()],
        started_at_ms: 1,
        heartbeat_at_ms: at_ms,
        draining: false,
        moving_out: false,
        teams: Default::default(),
    };
    let err = |store: &dyn crate::store::Database| crate::cluster::remove_node(store, id).unwrap_err().to_string();
    assert!(err(store.as_ref()).contains("no node"), "unknown");
    store.beat(&beat(crate::model::now_ms()), &[]).unwrap();
    assert!(err(store.as_ref()).contains("heard from"), "a live node stays");
    store.beat(&beat(crate::model::now_ms() - crate::model::LOST_AFTER_MS - 1_000), &[]).unwrap();
    let mut on_it = sandbox("s", 10);
    on_it.node = Some(id.into());
    store.put(&on_it).unwrap();
    let mut unstored = snapshot("acme", "snap", "k");
    unstored.node = Some(id.into());
    store.put_snapshot(&unstored).unwrap();
    let message = err(store.as_ref());
    assert!(message.contains("1 sandbox(es), 1 snapshot(s) not in the object store"), "{message}");
    assert!(store.node(id).unwrap().is_some(), "nothing removed");
    store.remove("s").unwrap();
    unstored.in_object_store = true;
    store.put_snapshot(&unstored).unwrap();
    let layer = BuildLayer {
        key: "l1".into(),
        team: "acme".into(),
        substrate_template: "base".into(),
        snapshot_key: "k1".into(),
        envs: vec![],
        user: "user".into(),
        workdir: None,
        templates: vec!["t".into()],
        created_at_ms: 0,
        node: Some(id.into()),
        in_object_store: false,
    };
    store.put_build_layer(&layer).unwrap();
    let stored = BuildLayer { key: "l2".into(), snapshot_key: "k2".into(), in_object_store: true, ..layer };
    store.put_build_layer(&stored).unwrap();
    crate::cluster::remove_node(store.as_ref(), id).unwrap();
    assert!(store.node(id).unwrap().is_none());
    assert!(store.build_layer("acme", "l1").unwrap().is_none(), "its build cache goes with it");
    assert!(store.build_layer("acme", "l2").unwrap().is_some(), "but for entries in the object store");
    assert!(store.snapshot("acme", "snap").unwrap().is_some(), "a stored snapshot stays, for other nodes");
}

pub fn a_secret_name_is_taken_once_and_freed_by_removal(db: &dyn Backend) {
    let store = db.open();
    assert!(store.insert_secret(&secret("a", "key")).unwrap());
    assert!(!store.insert_secret(&secret("b", "key")).unwrap());
    assert_eq!(store.secret_named(DEFAULT_TEAM, "key").unwrap().unwrap().id, "a");
    assert!(store.secret_named("acme", "key").unwrap().is_none());
    let mut theirs = secret("t", "key");
    theirs.team = "acme".into();
    assert!(store.insert_secret(&theirs).unwrap(), "names are per team");
    assert!(store.secret("b").unwrap().is_none());
    assert!(!store.update_secret(&secret("b", "other")).unwrap());
    let mut renamed = secret("a", "key");
    renamed.updated_at_ms = 7;
    assert!(store.update_secret(&renamed).unwrap());
    assert_eq!(db.open().secret("a").unwrap().unwrap().updated_at_ms, 7);
    assert!(store.remove_secret("a").unwrap());
    assert!(store.insert_secret(&secret("b", "key")).unwrap());
    assert_eq!(store.secrets().unwrap().len(), 2);
}

pub fn journal_intents_outlive_the_connection_until_cleared_and_a_torn_one_is_quarantined(db: &dyn Backend) {
    let intent = |id: &str| Intent {
        id: id.into(),
        sandbox: "s1".into(),
        change: Change::Resume { files: Some("k1".into()) },
        started_at_ms: 1,
        node: None,
    };
    {
        let store = db.open();
        store.put_intent(&intent("a")).unwrap();
        store.put_intent(&intent("b")).unwrap();
        store.remove_intent("a").unwrap();
        db.execute("INSERT INTO journal (id, record) VALUES ('c', 'torn')");
    }
    let store = db.open();
    assert_eq!(store.intents().unwrap(), [intent("b")]);
    let kept = db.quarantined();
    assert_eq!(kept.iter().map(|(kind, id, _)| (kind.as_str(), id.as_str())).collect::<Vec<_>>(), [("journal", "c")]);
}

pub fn an_unreadable_row_is_quarantined_and_the_rest_still_listed(db: &dyn Backend) {
    let store = db.open();
    store.insert_secret(&secret("a", "key")).unwrap();
    store.insert_secret(&secret("c", "other")).unwrap();
    db.execute("UPDATE team_secrets SET record = 'garbage' WHERE id = 'a'");
    db.execute("INSERT INTO sandboxes (id, end_at_ms, record) VALUES ('x', 0, '{\"id\": 1')");

    assert!(store.all().unwrap().is_empty());
    assert!(store.get("x").unwrap().is_none());
    let listed = store.secrets().unwrap();
    assert_eq!(listed.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), ["c"]);
    assert!(store.secret_named(DEFAULT_TEAM, "key").unwrap().is_none());
    let quarantined = db.quarantined();
    assert_eq!(quarantined.len(), 2);
    assert_eq!((quarantined[0].0.as_str(), quarantined[0].1.as_str()), ("sandboxes", "x"));
    assert_eq!((quarantined[1].0.as_str(), quarantined[1].1.as_str()), ("team_secrets", "a"));
    assert_eq!(quarantined[1].2, "garbage");
    // The name is free again.
    assert!(store.insert_secret(&secret("b", "key")).unwrap());
}

pub fn snapshot(team: &str, id: &str, key: &str) -> SnapshotRecord {
    serde_json::from_value(serde_json::json!({
        "id": id, "team": team, "names": [], "key": key, "template": "base",
        "source_sandbox": "x", "created_at_ms": 0, "size_bytes": 0
    }))
    .unwrap()
}

pub fn snapshot_names_are_per_team(db: &dyn Backend) {
    let store = db.open();
    store.put_snapshot(&snapshot(DEFAULT_TEAM, "s1", "k")).unwrap();
    store.put_snapshot(&snapshot("acme", "s1", "other")).unwrap();
    assert_eq!(store.snapshot("acme", "s1").unwrap().unwrap().key, "other");
    assert_eq!(store.snapshot(DEFAULT_TEAM, "s1").unwrap().unwrap().key, "k");
    assert!(store.snapshot("nobody", "s1").unwrap().is_none());
    // Put again: replaced, not added.
    store.put_snapshot(&snapshot("acme", "s1", "third")).unwrap();
    let all = db.open().snapshots().unwrap();
    assert_eq!(
        all.iter().map(|s| (s.team.as_str(), s.key.as_str())).collect::<Vec<_>>(),
        [("acme", "third"), (DEFAULT_TEAM, "k")]
    );
    assert!(store.remove_snapshot("acme", "s1").unwrap());
    assert!(!store.remove_snapshot("acme", "s1").unwrap());
    assert!(store.snapshot(DEFAULT_TEAM, "s1").unwrap().is_some());
}

pub fn a_snapshot_is_updated_only_while_it_names_the_same_files(db: &dyn Backend) {
    let store = db.open();
    let mut stored = snapshot(DEFAULT_TEAM, "s1", "k");
    stored.in_object_store = true;
    assert!(!store.update_snapshot(&stored).unwrap(), "no record: nothing is brought back");
    assert!(store.snapshot(DEFAULT_TEAM, "s1").unwrap().is_none());
    store.put_snapshot(&snapshot(DEFAULT_TEAM, "s1", "k")).unwrap();
    assert!(db.open().update_snapshot(&stored).unwrap());
    assert!(store.snapshot(DEFAULT_TEAM, "s1").unwrap().unwrap().in_object_store);
    // Replaced by a snapshot of other files: the update of the old one is refused.
    store.put_snapshot(&snapshot(DEFAULT_TEAM, "s1", "k2")).unwrap();
    assert!(!store.update_snapshot(&stored).unwrap());
    let now = store.snapshot(DEFAULT_TEAM, "s1").unwrap().unwrap();
    assert_eq!((now.key.as_str(), now.in_object_store), ("k2", false));
}

pub fn keys_are_revoked_by_an_unambiguous_prefix_and_other_connections_are_noticed(db: &dyn Backend) {
    let gateway = db.open();
    let before = gateway.tenancy_generation().unwrap();
    let cli = db.open();
    cli.put_key(&key("sha256:aa", "e2b_abc1", "acme")).unwrap();
    cli.put_key(&key("sha256:bb", "e2b_abc2", "acme")).unwrap();
    let after = gateway.tenancy_generation().unwrap();
    assert_ne!(after, before, "the CLI's write is visible");
    gateway.keys_used(&[("sha256:aa".into(), 42), ("sha256:gone".into(), 43)]).unwrap();
    assert_eq!(gateway.tenancy_generation().unwrap(), after, "use is no change to reload for");
    assert_eq!(gateway.keys().unwrap().len(), 2);
    assert_eq!(cli.keys().unwrap()[0].last_used_ms, Some(42));
    assert!(cli.revoke_key("e2b_abc").is_err(), "ambiguous");
    assert!(cli.revoke_key("e2b_zzz").unwrap().is_none());
    assert_eq!(cli.revoke_key("e2b_abc2").unwrap().unwrap().hash, "sha256:bb");
    assert_eq!(gateway.keys().unwrap().len(), 1);
    let revoked = gateway.tenancy_generation().unwrap();
    assert_ne!(revoked, after, "a revocation is a change");
    let team = Team { name: "acme".into(), quotas: Default::default(), created_at_ms: 0 };
    cli.put_team(&team).unwrap();
    assert_eq!(gateway.teams().unwrap(), vec![team]);
    assert_ne!(gateway.tenancy_generation().unwrap(), revoked, "so is a team's");
}

fn sandbox(id: &str, end_at_ms: i64) -> SandboxRecord {
    let mut json = serde_json::json!({
        "id": id, "template": "base", "access_token": "t", "metadata": {}, "env_vars": {},
        "started_at_ms": 0, "end_at_ms": end_at_ms, "state": "running", "allow_internet_access": true,
        "auto_pause": false, "agent_socket": "/nonexistent",
        "placement": { "init_pid": 0, "init_start": 0 },
    });
    json["limits"] = serde_json::to_value(copse_substrate::Limits::default()).unwrap();
    serde_json::from_value(json).unwrap()
}

pub fn sandboxes_are_listed_by_id_and_expire_by_their_end(db: &dyn Backend) {
    let store = db.open();
    for (id, end) in [("b", 20), ("a", 10), ("c", 30)] {
        store.put(&sandbox(id, end)).unwrap();
    }
    // A longer timeout moves the expiry, in the indexed column too.
    store.put(&sandbox("a", 40)).unwrap();
    let other = db.open();
    assert_eq!(other.all().unwrap().iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), ["a", "b", "c"]);
    assert_eq!(other.get("a").unwrap().unwrap().end_at_ms, 40);
    let mut expired = other.expired(30).unwrap();
    expired.sort();
    assert_eq!(expired, ["b", "c"]);
    assert!(other.remove("b").unwrap());
    assert!(!other.remove("b").unwrap());
    assert!(store.get("b").unwrap().is_none());
}

pub fn a_paused_sandbox_is_claimed_only_while_it_names_the_same_node_and_files(db: &dyn Backend) {
    let (one, two) = (db.open(), db.open());
    let mut record = sandbox("s", i64::MAX);
    record.node = Some("a".into());
    record.paused = Some(crate::model::Paused {
        remaining_ms: 1_000,
        files_only: Some("k1".into()),
        paused_at_ms: Some(1),
        memory: true,
        in_object_store: true,
        lazy: None,
        oci: Some(crate::model::OciBase { digest: "sha256:m".into(), layers: vec!["sha256:l".into()] }),
    });
    one.put(&record).unwrap();
    let claim = |store: &dyn Database, node: &str| {
        store.swap_paused(&SandboxRecord { node: Some(node.into()), ..record.clone() }, Some("a")).unwrap()
    };
    assert!(claim(one.as_ref(), "b"), "the first claim wins");
    assert!(!claim(two.as_ref(), "c"), "a second claim from the same state loses");
    assert_eq!(two.get("s").unwrap().unwrap().node.as_deref(), Some("b"));
    assert_eq!(two.get("s").unwrap().unwrap().paused, record.paused, "what it was stored with stays");
    // Paused on other files since: a claim that read the old ones loses.
    let mut moved = SandboxRecord { node: Some("b".into()), ..record.clone() };
    moved.paused.as_mut().unwrap().files_only = Some("k2".into());
    one.put(&moved).unwrap();
    assert!(!two.swap_paused(&SandboxRecord { node: Some("c".into()), ..record.clone() }, Some("b")).unwrap());
    let mut unnoded = sandbox("t", i64::MAX);
    two.put(&unnoded).unwrap();
    unnoded.end_at_ms = 5;
    assert!(two.swap_paused(&unnoded, None).unwrap(), "no node and no paused files match themselves");
    assert_eq!(one.get("t").unwrap().unwrap().end_at_ms, 5);
}

pub fn templates_are_found_by_id_and_by_name_within_their_team(db: &dyn Backend) {
    let store = db.open();
    let template = |id: &str, team: &str, name: &str| -> TemplateRecord {
        serde_json::from_value(serde_json::json!({
            "id": id, "team": team, "name": name, "created_at_ms": 0, "build_count": 1, "upload_token": "u",
            "build": { "id": "b1", "status": "ready", "log": [], "created_at_ms": 0, "updated_at_ms": 0,
                       "cpu_count": 1, "memory_mb": 512 }
        }))
        .unwrap()
    };
    store.put_template(&template("t1", "acme", "py")).unwrap();
    store.put_template(&template("t2", "other", "py")).unwrap();
    assert_eq!(store.template_named("acme", "py").unwrap().unwrap().id, "t1");
    assert_eq!(store.template_named("other", "py").unwrap().unwrap().id, "t2");
    assert!(store.template_named("nobody", "py").unwrap().is_none());
    assert_eq!(db.open().built_templates().unwrap().len(), 2);
    let labels = TemplateLabels { public: true, revision: 1, ..TemplateLabels::new("t1", "acme") };
    assert!(store.swap_template_labels(&labels).unwrap());
    assert_eq!(db.open().template_labels("t1").unwrap(), Some(labels.clone()));
    // Two edits that read revision 1: the second to write loses and
    // changes nothing.
    let first = TemplateLabels { public: false, revision: 2, ..labels.clone() };
    let second = TemplateLabels { image_build: Some("b0".into()), revision: 2, ..labels.clone() };
    assert!(db.open().swap_template_labels(&first).unwrap());
    assert!(!store.swap_template_labels(&second).unwrap());
    assert!(!store.swap_template_labels(&labels).unwrap(), "a first write must find no row");
    assert_eq!(store.template_labels("t1").unwrap(), Some(first));
    assert!(store.remove_template_labels("t1").unwrap());
    assert!(store.template_labels("t1").unwrap().is_none());
    assert!(store.remove_template("t1").unwrap());
    assert!(store.template("t1").unwrap().is_none());
    assert!(store.template("t2").unwrap().is_some());
}
