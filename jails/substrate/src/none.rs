//! The substrate of a gateway that runs no sandboxes (`copse up
//! --no-sandboxes`): an API front of a cluster, which places every sandbox,
//! build and volume on the cluster's nodes and forwards their calls there.
//! It holds nothing, so it has nothing to recover or tear down; whatever
//! would make something on this host is refused with a message that says
//! why, in case a call ever reaches it.

use crate::{
    Capabilities, Placement, Progress, Recipe, Recovery, SandboxSpec, SnapshotInfo, Substrate, SubstrateError, Support,
    TemplateInfo, Usage,
};

/// [`NoSandboxes`]'s name, which a cluster's node table shows for an API
/// front.
pub const NAME: &str = "none";

/// No sandboxes on this host: see the module's documentation.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoSandboxes;

/// Why `what` (a sandbox, a template, a volume) cannot be made here.
pub fn refusal(what: &str) -> String {
    format!("{what}: this gateway runs no sandboxes (copse up --no-sandboxes); the cluster's nodes do")
}

fn refused(what: &str) -> anyhow::Error {
    SubstrateError::Unavailable(refusal(what)).into()
}

impl Substrate for NoSandboxes {
    fn name(&self) -> &'static str {
        NAME
    }

    fn runs_sandboxes(&self) -> bool {
        false
    }

    fn templates(&self) -> anyhow::Result<Vec<TemplateInfo>> {
        Ok(Vec::new())
    }

    fn ensure_template(&self, recipe: &Recipe, _progress: Progress<'_>) -> anyhow::Result<TemplateInfo> {
        Err(refused(&format!("template {}", recipe.name)))
    }

    fn create(&self, spec: &SandboxSpec) -> anyhow::Result<Placement> {
        Err(refused(&format!("sandbox {}", spec.id)))
    }

    fn destroy(&self, _id: &str) -> anyhow::Result<()> {
        Ok(())
    }

    fn is_alive(&self, _id: &str, _placement: &Placement) -> bool {
        false
    }

    fn usage(&self, id: &str) -> anyhow::Result<Usage> {
        Err(SubstrateError::NotFound(format!("sandbox {id} is not on this host")).into())
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { memory_snapshots: Support::No }
    }

    fn pause(&self, id: &str) -> anyhow::Result<()> {
        Err(refused(&format!("sandbox {id}")))
    }

    fn resume(&self, id: &str) -> anyhow::Result<()> {
        Err(refused(&format!("sandbox {id}")))
    }

    fn snapshot(&self, id: &str, _snapshot_id: &str, _memory: bool) -> anyhow::Result<SnapshotInfo> {
        Err(refused(&format!("sandbox {id}")))
    }

    fn snapshots(&self) -> anyhow::Result<Vec<SnapshotInfo>> {
        Ok(Vec::new())
    }

    fn delete_snapshot(&self, _snapshot_id: &str) -> anyhow::Result<()> {
        Ok(())
    }

    fn rollback(&self, spec: &SandboxSpec, _snapshot_id: &str) -> anyhow::Result<Placement> {
        Err(refused(&format!("sandbox {}", spec.id)))
    }

    fn export_snapshot(&self, snapshot_id: &str, _out: &mut dyn std::io::Write) -> anyhow::Result<()> {
        Err(refused(&format!("snapshot {snapshot_id}")))
    }

    fn import_snapshot(&self, snapshot_id: &str, _input: &mut dyn std::io::Read) -> anyhow::Result<SnapshotInfo> {
        Err(refused(&format!("snapshot {snapshot_id}")))
    }

    fn recover(&self, _known: &[(String, Placement)]) -> anyhow::Result<Recovery> {
        Ok(Recovery::default())
    }

    fn create_volume(&self, id: &str, _limit_bytes: u64) -> anyhow::Result<()> {
        Err(refused(&format!("volume {id}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_holds_nothing_and_refuses_to_make_anything_saying_why() {
        let none = NoSandboxes;
        assert!(!none.runs_sandboxes());
        assert!(none.templates().unwrap().is_empty() && none.snapshots().unwrap().is_empty());
        let err = none.pause("abc").unwrap_err();
        assert!(
            matches!(SubstrateError::find(&err), Some(SubstrateError::Unavailable(m)) if m.contains("--no-sandboxes"))
        );
        assert!(none.recover(&[]).unwrap().adopted.is_empty());
        none.destroy("abc").unwrap();
    }
}
