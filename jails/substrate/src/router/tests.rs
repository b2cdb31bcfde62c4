//! Dispatch only: the backends are doubles that record what reached them.

use std::sync::Arc;

use super::*;

type Log = Arc<Mutex<Vec<String>>>;

struct Double {
    backend: Backend,
    templates: Vec<&'static str>,
    memory_snapshots: bool,
    log: Log,
}

impl Double {
    fn note(&self, call: &str) {
        self.log.lock().unwrap().push(format!("{}:{call}", self.backend));
    }
}

fn placement() -> Placement {
    Placement { init_pid: 1, init_start: 1 }
}

fn snapshot_info(id: &str) -> SnapshotInfo {
    SnapshotInfo { id: id.into(), template: "t".into(), size_bytes: 0, memory: false }
}

impl Substrate for Double {
    fn name(&self) -> &'static str {
        "double"
    }
    fn templates(&self) -> anyhow::Result<Vec<TemplateInfo>> {
        Ok(self
            .templates
            .iter()
            .map(|n| TemplateInfo {
                name: n.to_string(),
                built_at: 0,
                size_bytes: 0,
                backend: Backend::Jail,
                recipe: String::new(),
            })
            .collect())
    }
    fn ensure_template(&self, recipe: &Recipe, _: Progress<'_>) -> anyhow::Result<TemplateInfo> {
        self.note(&format!("ensure {}", recipe.name));
        Ok(TemplateInfo {
            name: recipe.name.clone(),
            built_at: 0,
            size_bytes: 0,
            backend: Backend::Jail,
            recipe: String::new(),
        })
    }
    fn create(&self, spec: &SandboxSpec) -> anyhow::Result<Placement> {
        self.note(&format!("create {}", spec.id));
        if spec.id == "fails" {
            bail!("boom");
        }
        Ok(placement())
    }
    fn destroy(&self, id: &str) -> anyhow::Result<()> {
        self.note(&format!("destroy {id}"));
        Ok(())
    }
    fn is_alive(&self, _: &str, _: &Placement) -> bool {
        true
    }
    fn usage(&self, id: &str) -> anyhow::Result<Usage> {
        self.note(&format!("usage {id}"));
        Ok(Usage::default())
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities { memory_snapshots: if self.memory_snapshots { Support::Yes } else { Support::No } }
    }
    fn pause(&self, id: &str) -> anyhow::Result<()> {
        self.note(&format!("pause {id}"));
        Ok(())
    }
    fn resume(&self, id: &str) -> anyhow::Result<()> {
        self.note(&format!("resume {id}"));
        Ok(())
    }
    fn snapshot(&self, id: &str, snapshot_id: &str, _memory: bool) -> anyhow::Result<SnapshotInfo> {
        self.note(&format!("snapshot {id} {snapshot_id}"));
        Ok(snapshot_info(snapshot_id))
    }
    fn snapshots(&self) -> anyhow::Result<Vec<SnapshotInfo>> {
        Ok(Vec::new())
    }
    fn delete_snapshot(&self, snapshot_id: &str) -> anyhow::Result<()> {
        self.note(&format!("delete {snapshot_id}"));
        Ok(())
    }
    fn rollback(&self, spec: &SandboxSpec, snapshot_id: &str) -> anyhow::Result<Placement> {
        self.note(&format!("rollback {} {snapshot_id}", spec.id));
        Ok(placement())
    }
    fn export_snapshot(&self, snapshot_id: &str, out: &mut dyn Write) -> anyhow::Result<()> {
        self.note(&format!("export {snapshot_id}"));
        out.write_all(format!("{} stream", self.backend).as_bytes())?;
        Ok(())
    }
    fn import_snapshot(&self, snapshot_id: &str, input: &mut dyn Read) -> anyhow::Result<SnapshotInfo> {
        let mut body = String::new();
        input.read_to_string(&mut body)?;
        self.note(&format!("import {snapshot_id} {body:?}"));
        Ok(snapshot_info(snapshot_id))
    }
    fn recover(&self, known: &[(String, Placement)]) -> anyhow::Result<Recovery> {
        let ids: Vec<&str> = known.iter().map(|(id, _)| id.as_str()).collect();
        self.note(&format!("recover {ids:?}"));
        Ok(Recovery { adopted: ids.iter().map(|s| s.to_string()).collect(), removed: Vec::new() })
    }
}

fn router(dir: &Path, log: &Log) -> Router {
    let double = |backend, templates, memory_snapshots| -> (Backend, Box<dyn Substrate>) {
        (backend, Box::new(Double { backend, templates, memory_snapshots, log: log.clone() }))
    };
    Router::open(
        dir,
        "test",
        vec![double(Backend::Jail, vec!["base"], false), double(Backend::Bhyve, vec!["vm"], true)],
    )
    .unwrap()
}

fn spec(id: &str, template: &str, snapshot: Option<&str>) -> SandboxSpec {
    SandboxSpec {
        id: id.into(),
        template: template.into(),
        limits: Default::default(),
        agent_socket: "/nonexistent".into(),
        snapshot: snapshot.map(Into::into),
        network: None,
        volumes: Vec::new(),
    }
}

fn take(log: &Log) -> Vec<String> {
    std::mem::take(&mut *log.lock().unwrap())
}

#[test]
fn sandboxes_go_to_their_templates_backend_and_stay_there_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let log = Log::default();
    let r = router(dir.path(), &log);
    r.create(&spec("a", "base", None)).unwrap();
    r.create(&spec("b", "vm", None)).unwrap();
    r.pause("b").unwrap();
    r.snapshot("b", "s1", false).unwrap();
    assert_eq!(take(&log), ["jail:create a", "bhyve:create b", "bhyve:pause b", "bhyve:snapshot b s1"]);

    // A new router on the same state directory: routes come from disk.
    let r = router(dir.path(), &log);
    r.resume("b").unwrap();
    r.usage("a").unwrap();
    r.create(&spec("c", "vm", Some("s1"))).unwrap();
    r.rollback(&spec("b", "vm", None), "s1").unwrap();
    r.destroy("b").unwrap();
    r.delete_snapshot("s1").unwrap();
    assert_eq!(
        take(&log),
        [
            "bhyve:resume b",
            "jail:usage a",
            "bhyve:create c",
            "bhyve:rollback b s1",
            "bhyve:destroy b",
            "bhyve:delete s1"
        ]
    );
}

#[test]
fn failed_creates_and_unknown_ids() {
    let dir = tempfile::tempdir().unwrap();
    let log = Log::default();
    let r = router(dir.path(), &log);
    assert!(r.create(&spec("fails", "vm", None)).is_err());
    // No route was left: an unknown id is destroyed everywhere.
    r.destroy("fails").unwrap();
    // Unknown templates go to the default backend, which names the error.
    r.create(&spec("d", "nope", None)).unwrap();
    assert_eq!(take(&log), ["bhyve:create fails", "jail:destroy fails", "bhyve:destroy fails", "jail:create d"]);
}

#[test]
fn rollback_across_backends_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let log = Log::default();
    let r = router(dir.path(), &log);
    r.create(&spec("a", "base", None)).unwrap();
    r.create(&spec("b", "vm", None)).unwrap();
    r.snapshot("b", "s1", false).unwrap();
    let err = r.rollback(&spec("a", "base", None), "s1").unwrap_err();
    assert!(matches!(SubstrateError::find(&err), Some(SubstrateError::Invalid(_))), "{err}");
    let err = err.to_string();
    assert!(err.contains("bhyve snapshot") && err.contains("runs on jail"), "{err}");
}

#[test]
fn templates_and_capabilities_per_backend() {
    let dir = tempfile::tempdir().unwrap();
    let log = Log::default();
    let r = router(dir.path(), &log);
    let listed: Vec<(String, Backend)> = r.templates().unwrap().into_iter().map(|t| (t.name, t.backend)).collect();
    assert_eq!(listed, [("base".into(), Backend::Jail), ("vm".into(), Backend::Bhyve)]);
    assert_eq!(r.capabilities_for("base").memory_snapshots, Support::No);
    assert!(r.capabilities_for("vm").memory_snapshots.is_yes());
    assert_eq!(r.capabilities().memory_snapshots, Support::No, "the host-wide answer holds for every template");

    let recipe = Recipe { name: "vm2".into(), packages: vec![], post_install: vec![], backend: Backend::Bhyve };
    assert_eq!(r.ensure_template(&recipe, &|_| {}).unwrap().backend, Backend::Bhyve);
    assert_eq!(take(&log), ["bhyve:ensure vm2"]);
    assert!(r.capabilities_for("vm2").memory_snapshots.is_yes());
}

#[test]
fn a_backend_the_host_lacks_is_refused_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let log = Log::default();
    let jail_only = Router::open(
        dir.path(),
        "test",
        vec![(
            Backend::Jail,
            Box::new(Double { backend: Backend::Jail, templates: vec![], memory_snapshots: false, log: log.clone() }),
        )],
    )
    .unwrap();
    let recipe = Recipe { name: "vm".into(), packages: vec![], post_install: vec![], backend: Backend::Bhyve };
    let err = jail_only.ensure_template(&recipe, &|_| {}).unwrap_err();
    assert!(matches!(SubstrateError::find(&err), Some(SubstrateError::Unsupported(_))), "{err}");
    let err = err.to_string();
    assert!(err.contains("bhyve") && err.contains("FreeBSD"), "{err}");
    // A stream of a backend the host lacks is refused the same way.
    let err = jail_only.import_snapshot("s", &mut &b"copse-backend bhyve\nx"[..]).unwrap_err();
    assert_eq!(SubstrateError::find(&err), Some(&SubstrateError::Unsupported("this host has no bhyve backend".into())));
    assert!(take(&log).is_empty());
}

#[test]
fn exports_name_their_backend_and_bare_streams_are_the_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let log = Log::default();
    let r = router(dir.path(), &log);
    r.create(&spec("b", "vm", None)).unwrap();
    r.snapshot("b", "s1", false).unwrap();
    let mut stream = Vec::new();
    r.export_snapshot("s1", &mut stream).unwrap();
    assert_eq!(stream, b"copse-backend bhyve\nbhyve stream");
    take(&log);

    r.import_snapshot("s2", &mut stream.as_slice()).unwrap();
    r.import_snapshot("s3", &mut &b"legacy"[..]).unwrap();
    r.import_snapshot("s4", &mut &b""[..]).unwrap();
    assert_eq!(take(&log), [r#"bhyve:import s2 "bhyve stream""#, r#"jail:import s3 "legacy""#, r#"jail:import s4 """#]);
    r.delete_snapshot("s2").unwrap();
    assert_eq!(take(&log), ["bhyve:delete s2"]);
    let err = r.import_snapshot("s5", &mut &b"copse-backend kvm\nx"[..]).unwrap_err();
    assert!(matches!(SubstrateError::find(&err), Some(SubstrateError::Invalid(_))), "{err}");
}

#[test]
fn recover_splits_known_sandboxes_by_owner_and_forgets_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let log = Log::default();
    let r = router(dir.path(), &log);
    r.create(&spec("a", "base", None)).unwrap();
    r.create(&spec("b", "vm", None)).unwrap();
    r.create(&spec("gone", "vm", None)).unwrap();
    take(&log);
    let known = [("a".to_string(), placement()), ("b".to_string(), placement()), ("old".to_string(), placement())];
    let recovery = r.recover(&known).unwrap();
    assert_eq!(take(&log), [r#"jail:recover ["a", "old"]"#, r#"bhyve:recover ["b"]"#]);
    assert_eq!(recovery.adopted, ["a", "old", "b"]);
    assert!(!r.routes().sandboxes.contains_key("gone"));
}
