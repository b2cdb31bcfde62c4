//! `copse snapshot export|import`: a snapshot as one file, to move it to
//! another host. The file is a header line, the snapshot's API record as
//! one JSON line, then the substrate's own stream of its files.
//! `copse snapshot push|pull` move the same stream through an object store
//! (`copse_objects`: content-addressed chunks, so a second snapshot of a
//! sandbox sends only what changed), under `snapshots/<team>/<id>`.

use std::io::{BufRead, Read, Write};

use anyhow::{Context, bail};
use copse_objects::{Bucket, PullReport, PushReport, ReaderStopped};
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

/// Where `team`'s snapshot `id` is kept in an object store. A snapshot
/// name may hold `/` (E2B's `namespace/alias`); an S3 key's empty and `.`
/// segments are dropped or resolved by clients, which would give two names
/// one key, so such names stay on their host.
fn object_key(team: &str, id: &str) -> anyhow::Result<String> {
    validate_team_name(team)?;
    validate_snapshot_name(id)?;
    if id.split('/').any(|segment| segment.is_empty() || segment == ".") {
        bail!("snapshot name {id:?} has an empty or '.' path segment, which an object store key cannot keep");
    }
    Ok(format!("snapshots/{team}/{id}"))
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?)
}

/// `copse snapshot push`: exports `team`'s snapshot `id` into `bucket`,
/// sending only the chunks it lacks; the snapshot's manifest there is
/// replaced only once the whole export has been stored.
pub fn push(
    store: &dyn Store,
    substrate: &dyn Substrate,
    team: &str,
    id: &str,
    bucket: &Bucket,
) -> anyhow::Result<PushReport> {
    let key = object_key(team, id)?;
    let runtime = runtime()?;
    let (reader, mut writer) = std::io::pipe()?;
    std::thread::scope(|scope| {
        let exporter = scope.spawn(move || export(store, substrate, team, id, &mut writer));
        let exported = || exporter.join().unwrap_or_else(|_| bail!("the export panicked"));
        runtime.block_on(copse_objects::push(bucket, &key, reader, exported))
    })
}

/// `copse snapshot pull`: imports `team`'s snapshot `id` from `bucket`
/// as [`import`] does from a file (under `name` if given), each chunk
/// checked against its hash before the import reads it.
pub fn pull(
    store: &dyn Store,
    substrate: &dyn Substrate,
    team: &str,
    id: &str,
    name: Option<String>,
    bucket: &Bucket,
) -> anyhow::Result<(SnapshotRecord, PullReport)> {
    let key = object_key(team, id)?;
    let runtime = runtime()?;
    let manifest = runtime
        .block_on(copse_objects::manifest(bucket, &key))?
        .with_context(|| format!("the object store has no snapshot {id} of team {team}"))?;
    let (sink, reader) = copse_objects::stream(4);
    std::thread::scope(|scope| {
        let importer = scope.spawn(move || import(store, substrate, team, &mut std::io::BufReader::new(reader), name));
        let pulled = runtime.block_on(copse_objects::pull(bucket, &manifest, sink));
        let imported = importer.join().unwrap_or_else(|_| bail!("the import panicked"));
        match (pulled, imported) {
            (Ok(report), Ok(record)) => Ok((record, report)),
            // The import refused the stream (a name taken, a template
            // missing): its reason, not the fetch's "reader stopped".
            (Err(e), Err(refused)) if e.is::<ReaderStopped>() => Err(refused),
            (Ok(_), Err(refused)) => Err(refused),
            (Err(e), _) => Err(e),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::object_key;

    #[test]
    fn object_keys_are_one_per_name_and_stay_under_the_teams_prefix() {
        assert_eq!(object_key("default", "ns/app:v1").unwrap(), "snapshots/default/ns/app:v1");
        for (team, id) in [("default", "a//b"), ("default", "./x"), ("default", "x/"), ("default", "/x")] {
            assert!(object_key(team, id).is_err(), "{id} must be refused");
        }
        for (team, id) in [("../t", "x"), ("default", "../x"), ("default", "a/../b"), ("", "x")] {
            assert!(object_key(team, id).is_err(), "{team}/{id} must be refused");
        }
    }
}
