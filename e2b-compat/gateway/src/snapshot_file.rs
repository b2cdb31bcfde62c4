//! `copse snapshot export|import`: a snapshot as one file, to move it to
//! another host. The file is a header line, the snapshot's API record as
//! one JSON line, then the substrate's own stream of its files.
//! `copse snapshot push|pull` move the same stream through an object store
//! (`copse_objects`: content-addressed chunks, so a second snapshot of a
//! sandbox sends only what changed), under `snapshots/<team>/<id>`.
//! The nodes of a cluster use the same stream on their own
//! (`service/objects.rs`): [`push_record`] and [`fetch_files`].

use std::io::{BufRead, Read, Write};

use anyhow::{Context, bail};
use copse_objects::{Bucket, PullReport, PushReport, ReaderStopped};
use copse_substrate::Substrate;
use tokio::runtime::Handle;

use crate::model::{SnapshotRecord, Store, now_ms, snapshot_key, validate_snapshot_name, validate_team_name};

const MAGIC: &str = "copse-snapshot 1";
/// A header line longer than this is not one copse wrote: a record is a
/// few hundred bytes.
const MAX_HEADER_LINE: u64 = 1 << 20;

/// Writes `team`'s snapshot `id` to `out`.
pub fn export(
    store: &dyn Store,
    substrate: &dyn Substrate,
    team: &str,
    id: &str,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    let record = store.snapshot(team, id)?.with_context(|| format!("snapshot {id} of team {team} not found"))?;
    write_export(substrate, &record, out)
}

fn write_export(substrate: &dyn Substrate, record: &SnapshotRecord, out: &mut dyn Write) -> anyhow::Result<()> {
    writeln!(out, "{MAGIC}")?;
    writeln!(out, "{}", serde_json::to_string(record)?)?;
    substrate.export_snapshot(&record.key, out)?;
    out.flush()?;
    Ok(())
}

/// The record an export's header holds; `input` is left at the
/// substrate's stream.
fn read_header(input: &mut dyn BufRead) -> anyhow::Result<SnapshotRecord> {
    let mut line = String::new();
    (&mut *input).take(MAX_HEADER_LINE).read_line(&mut line)?;
    if line.trim_end() != MAGIC {
        bail!("not a copse snapshot export (expected a '{MAGIC}' header)");
    }
    line.clear();
    (&mut *input).take(MAX_HEADER_LINE).read_line(&mut line)?;
    if !line.ends_with('\n') {
        bail!("corrupt snapshot header: no record line within {MAX_HEADER_LINE} bytes");
    }
    serde_json::from_str(&line).context("corrupt snapshot header")
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
    let mut record = read_header(input)?;
    // Whether it is in an object store is for the host it goes to to say.
    record.in_object_store = false;
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
pub fn object_key(team: &str, id: &str) -> anyhow::Result<String> {
    validate_team_name(team)?;
    validate_snapshot_name(id)?;
    if id.split('/').any(|segment| segment.is_empty() || segment == ".") {
        bail!("snapshot name {id:?} has an empty or '.' path segment, which an object store key cannot keep");
    }
    Ok(format!("snapshots/{team}/{id}"))
}

/// Where the files of `team`'s paused sandbox `sandbox_id` wait in an
/// object store for the node that resumes it (`service/relocate.rs`).
pub fn paused_object_key(team: &str, sandbox_id: &str) -> anyhow::Result<String> {
    validate_team_name(team)?;
    if sandbox_id.is_empty() || !sandbox_id.chars().all(|c| c.is_ascii_alphanumeric()) {
        bail!("sandbox id {sandbox_id:?} is not one copse made");
    }
    Ok(format!("paused/{team}/{sandbox_id}"))
}

/// Where `team`'s volume `volume_id` waits in an object store while it
/// moves between nodes (`service/volume_moves.rs`).
pub fn volume_object_key(team: &str, volume_id: &str) -> anyhow::Result<String> {
    validate_team_name(team)?;
    if volume_id.is_empty() || !volume_id.chars().all(|c| c.is_ascii_alphanumeric()) {
        bail!("volume id {volume_id:?} is not one copse made");
    }
    Ok(format!("volumes/{team}/{volume_id}"))
}

/// Where a built template's image (its snapshot `snapshot_key`) waits in
/// an object store for a node that starts the template without holding it
/// (`service/image_objects.rs`). The key is random and unique, so one image
/// is one manifest; the fetching node checks the stream's header against
/// the template's record.
pub fn image_object_key(snapshot_key: &str) -> anyhow::Result<String> {
    if snapshot_key.is_empty() || !snapshot_key.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
        bail!("image snapshot {snapshot_key:?} is not one copse made");
    }
    Ok(format!("images/{snapshot_key}"))
}

/// Where a build cache entry's files (its key `layer_key`, a hex SHA-256
/// that names the team) wait in an object store for a build on another
/// node (`service/layer_objects.rs`); the fetching node checks the
/// stream's header against the entry's record.
pub fn layer_object_key(layer_key: &str) -> anyhow::Result<String> {
    if layer_key.len() != 64 || !layer_key.chars().all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)) {
        bail!("build layer {layer_key:?} is not one copse made");
    }
    Ok(format!("layers/{layer_key}"))
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
    let record = store.snapshot(team, id)?.with_context(|| format!("snapshot {id} of team {team} not found"))?;
    push_record(substrate, &record, bucket, runtime()?.handle())
}

/// Exports the snapshot `record` names into `bucket`, as [`push`] does;
/// `runtime` runs the uploads (called off it: this blocks).
pub fn push_record(
    substrate: &dyn Substrate,
    record: &SnapshotRecord,
    bucket: &Bucket,
    runtime: &Handle,
) -> anyhow::Result<PushReport> {
    push_under(substrate, record, &object_key(&record.team, &record.id)?, bucket, runtime)
}

/// Exports the files `record` names into `bucket` under `key`.
pub fn push_under(
    substrate: &dyn Substrate,
    record: &SnapshotRecord,
    key: &str,
    bucket: &Bucket,
    runtime: &Handle,
) -> anyhow::Result<PushReport> {
    push_stream(bucket, key, runtime, |out| write_export(substrate, record, out))
}

/// Stores what `produce` writes in `bucket` under `key`, as it is
/// written; no manifest if `produce` fails.
pub fn push_stream(
    bucket: &Bucket,
    key: &str,
    runtime: &Handle,
    produce: impl FnOnce(&mut dyn Write) -> anyhow::Result<()> + Send,
) -> anyhow::Result<PushReport> {
    let (reader, mut writer) = std::io::pipe()?;
    std::thread::scope(|scope| {
        let exporter = scope.spawn(move || produce(&mut writer));
        let exported = || exporter.join().unwrap_or_else(|_| bail!("the export panicked"));
        runtime.block_on(copse_objects::push(bucket, key, reader, exported))
    })
}

/// `copse snapshot gc`: see [`copse_objects::collect_garbage`].
pub fn collect_garbage(
    bucket: &Bucket,
    min_age: std::time::Duration,
    dry_run: bool,
) -> anyhow::Result<copse_objects::GcReport> {
    runtime()?.block_on(copse_objects::collect_garbage(bucket, min_age, dry_run))
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
    let runtime = runtime()?;
    let key = object_key(team, id)?;
    let what = format!("snapshot {id} of team {team}");
    stream_from(bucket, &key, &what, runtime.handle(), |input| import(store, substrate, team, input, name))
}

/// Fetches the files of the snapshot `record` describes from `bucket`
/// into this host's substrate under the record's own key, for a node that
/// was asked to start a snapshot another node took. What the bucket holds
/// under its name must be that snapshot: one replaced or swapped there
/// since (its header names other files) is refused, never started.
pub fn fetch_files(
    substrate: &dyn Substrate,
    record: &SnapshotRecord,
    bucket: &Bucket,
    runtime: &Handle,
) -> anyhow::Result<PullReport> {
    fetch_under(substrate, record, &object_key(&record.team, &record.id)?, bucket, runtime)
}

/// Fetches the files `record` names from `bucket`'s `key`, as
/// [`fetch_files`] does.
pub fn fetch_under(
    substrate: &dyn Substrate,
    record: &SnapshotRecord,
    key: &str,
    bucket: &Bucket,
    runtime: &Handle,
) -> anyhow::Result<PullReport> {
    let what = format!("{} of team {}", record.id, record.team);
    let (_, report) = stream_from(bucket, key, &what, runtime, |input| {
        let stored = read_header(input)?;
        if (stored.team.as_str(), stored.key.as_str()) != (record.team.as_str(), record.key.as_str()) {
            bail!(
                "the object store holds another version of {} than the database names; it was not fetched",
                record.id
            );
        }
        let mut rest: Box<dyn Read + '_> = Box::new(input);
        substrate.import_snapshot(&record.key, &mut rest)
    })?;
    Ok(report)
}

/// Streams the export of `what` under `key` in `bucket` into `consume`
/// (on a thread of its own: it reads a blocking stream).
fn stream_from<T: Send>(
    bucket: &Bucket,
    key: &str,
    what: &str,
    runtime: &Handle,
    consume: impl FnOnce(&mut dyn BufRead) -> anyhow::Result<T> + Send,
) -> anyhow::Result<(T, PullReport)> {
    let manifest = runtime
        .block_on(copse_objects::manifest(bucket, key))?
        .with_context(|| format!("the object store has no {what}"))?;
    stream_manifest(bucket, &manifest, runtime, consume)
}

/// Streams what `manifest` names into `consume`, each chunk checked
/// against its hash before `consume` reads it.
pub fn stream_manifest<T: Send>(
    bucket: &Bucket,
    manifest: &copse_objects::Manifest,
    runtime: &Handle,
    consume: impl FnOnce(&mut dyn BufRead) -> anyhow::Result<T> + Send,
) -> anyhow::Result<(T, PullReport)> {
    let (sink, reader) = copse_objects::stream(4);
    std::thread::scope(|scope| {
        let consumer = scope.spawn(move || consume(&mut std::io::BufReader::new(reader)));
        let pulled = runtime.block_on(copse_objects::pull(bucket, manifest, sink));
        let consumed = consumer.join().unwrap_or_else(|_| bail!("the import panicked"));
        match (pulled, consumed) {
            (Ok(report), Ok(value)) => Ok((value, report)),
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
    use super::{MAGIC, MAX_HEADER_LINE, image_object_key, layer_object_key, object_key, read_header};

    #[test]
    fn a_header_is_read_up_to_the_stream_and_an_endless_line_is_refused() {
        let record = r#"{"id":"s","names":["s"],"key":"k","template":"base","source_sandbox":"x","created_at_ms":0,"size_bytes":0}"#;
        let mut stream = format!("{MAGIC}\n{record}\nTAR").into_bytes();
        let mut input = std::io::Cursor::new(&mut stream[..]);
        assert_eq!(read_header(&mut input).unwrap().key, "k");
        assert_eq!(std::io::Read::bytes(input).count(), 3, "left at the substrate's stream");
        let endless = format!("{MAGIC}\n{{\"id\":\"{}", "x".repeat(MAX_HEADER_LINE as usize + 10));
        let refused = read_header(&mut std::io::Cursor::new(endless.as_bytes())).unwrap_err();
        assert!(refused.to_string().contains("no record line"), "{refused}");
    }

    #[test]
    fn image_keys_take_only_the_snapshot_keys_copse_makes() {
        let key = crate::model::snapshot_key();
        assert_eq!(image_object_key(&key).unwrap(), format!("images/{key}"));
        for odd in ["", "../x", "a/b", "a.b", "x y"] {
            assert!(image_object_key(odd).is_err(), "{odd:?} must be refused");
        }
    }

    #[test]
    fn layer_keys_take_only_build_cache_keys() {
        let key = "0123456789abcdef".repeat(4);
        assert_eq!(layer_object_key(&key).unwrap(), format!("layers/{key}"));
        for odd in [String::new(), key.to_uppercase(), format!("{key}0"), format!("../{}", &key[3..])] {
            assert!(layer_object_key(&odd).is_err(), "{odd:?} must be refused");
        }
    }

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
