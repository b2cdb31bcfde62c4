//! `copse snapshot export|import`: a snapshot as one file, to move it to
//! another host. The file is a header line, the snapshot's API record as
//! one JSON line, then the substrate's own stream of its files.

use std::io::{BufRead, Read, Write};

use anyhow::{Context, bail};
use copse_substrate::Substrate;

use crate::model::{SnapshotRecord, Store, now_ms, snapshot_key, validate_snapshot_name, validate_team_name};

const MAGIC: &str = "copse-snapshot 1";

/// Writes `team`'s snapshot `id` to `out`.
pub fn export(
    store: &dyn Store,
    substrate: &dyn Substrate,
    team: &str,
    id: &str,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    let record = store.snapshot(team, id)?.with_context(|| format!("snapshot {id} of team {team} not found"))?;
    writeln!(out, "{MAGIC}")?;
    writeln!(out, "{}", serde_json::to_string(&record)?)?;
    substrate.export_snapshot(&record.key, out)?;
    out.flush()?;
    Ok(())
}

/// Reads an export into `team`; the snapshot keeps its name unless `name`
/// is given. An existing snapshot of that name is refused, not overwritten,
/// and so is a template's name.
pub fn import(
    store: &dyn Store,
    substrate: &dyn Substrate,
    team: &str,
    input: &mut dyn BufRead,
    name: Option<String>,
) -> anyhow::Result<SnapshotRecord> {
    let mut line = String::new();
    input.read_line(&mut line)?;
    if line.trim_end() != MAGIC {
        bail!("not a copse snapshot export (expected a '{MAGIC}' header)");
    }
    line.clear();
    input.read_line(&mut line)?;
    let mut record: SnapshotRecord = serde_json::from_str(&line).context("corrupt snapshot header")?;
    if let Some(name) = name {
        record.names = vec![name.clone()];
        record.id = name;
    }
    validate_team_name(team)?;
    validate_snapshot_name(&record.id)?;
    record.team = team.to_string();
    let templates = substrate.templates()?;
    if templates.iter().any(|t| t.name == record.id) {
        bail!("{} is a template's name; import the snapshot under another with --name", record.id);
    }
    if store.snapshot(team, &record.id)?.is_some() {
        bail!("a snapshot named {} exists already; import it under another name with --name", record.id);
    }
    if !templates.iter().any(|t| t.name == record.template) {
        bail!("snapshot {} needs template {}, which is not built on this host", record.id, record.template);
    }
    record.key = snapshot_key();
    let mut rest: Box<dyn Read + '_> = Box::new(input);
    // Files first, the record last: an import cut short leaves only files
    // no record names, which the gateway's start removes.
    let info = substrate.import_snapshot(&record.key, &mut rest)?;
    crate::fault::point("import:after-files");
    record.size_bytes = info.size_bytes;
    record.created_at_ms = now_ms();
    store.put_snapshot(&record)?;
    Ok(record)
}
