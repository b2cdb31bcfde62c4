//! Every rig copse has or plans, with its task and the clock definition of
//! each metric it records. Rigs copy their entry into the result file
//! (`rig_version`, `clock`); the site lists planned rigs without a result as
//! "not yet measured".

/// One rig: its name in result files, the version of its measurement (bumped
/// whenever a metric's meaning changes), the mise task and what it measures.
#[derive(Debug, Clone, Copy)]
pub struct RigDef {
    pub name: &'static str,
    pub version: u32,
    pub task: &'static str,
    pub title: &'static str,
    /// Metric → what starts and what stops its clock (or how it is derived).
    pub clock: &'static [(&'static str, &'static str)],
}

const SERVER_TIMING: [(&str, &str); 4] = [
    (
        "server_boot_ms",
        "gateway's own account (Server-Timing `boot` of the create response): taking a sandbox out of the pool, or booting one",
    ),
    (
        "server_handover_ms",
        "gateway's own account (Server-Timing `handover`): registering the sandbox and building the response",
    ),
    ("server_total_ms", "gateway's own account (Server-Timing `total`): request handler entered → response ready"),
    (
        "api_overhead_ms",
        "create_ms − server_total_ms: HTTP, JSON, routing and client time outside the gateway's own account",
    ),
];

pub const RIGS: &[RigDef] = &[
    RigDef {
        name: "create-latency",
        version: 2,
        task: "bench:create",
        title: "Create → first command",
        clock: &[
            (
                "total_ms",
                "client sends POST /v2/sandboxes → receives the `end` event of the first command (/bin/true; SDK: `bash -l -c true`)",
            ),
            (
                "create_ms",
                "client sends POST /v2/sandboxes → create response body read (SDK: Sandbox.create() returns)",
            ),
            ("exec_ms", "create response read → `end` event of the first command received"),
            ("exec_start_event_ms", "create response read → `start` event of the first command received"),
            ("delete_ms", "DELETE /sandboxes/{id} round trip; untimed clean-up, for information"),
            ("kill_ms", "(SDK) sbx.kill() round trip; untimed clean-up, for information"),
            SERVER_TIMING[0],
            SERVER_TIMING[1],
            SERVER_TIMING[2],
            SERVER_TIMING[3],
            ("spawn_true_ms", "anchor: fork+exec of /bin/true → child reaped (std::process::Command spawn + wait)"),
            (
                "unshare_mnpiu_fork_true_ms",
                "anchor (v1 files): `unshare -m -n -p -i -u --fork /bin/true` spawned → reaped",
            ),
            ("fork_exec_ms", "anchor: fork+exec of /bin/true → child reaped, one per worker at the tier's concurrency"),
            (
                "unshare_ms",
                "anchor: `unshare --mount --net --pid --ipc --uts --cgroup --fork /bin/true` spawned → reaped (the namespaces a copse sandbox gets)",
            ),
            (
                "runc_ms",
                "anchor: `runc run` of a bundle over the base template's rootfs (copse's six namespaces) spawned → reaped: OCI runtime create + exec + delete",
            ),
            (
                "podman_ms",
                "anchor: `podman run --rm --network none --runtime runc --rootfs <base rootfs>:O /bin/true` spawned → reaped",
            ),
        ],
    },
    RigDef {
        name: "run-code",
        version: 1,
        task: "bench:run-code",
        title: "Create → first run_code result",
        clock: &[
            (
                "first_result_ms",
                "client sends POST /v2/sandboxes → main `result` line of the first /execute received (SDK: on_result callback)",
            ),
            ("create_ms", "create round trip, response body read (SDK: Sandbox.create())"),
            ("execute_ms", "create response read → main result line"),
            ("execute_end_ms", "create response read → `end_of_execution` line"),
            ("run_code_ms", "(SDK) run_code call → return"),
            ("total_ms", "(SDK) Sandbox.create() call → run_code return"),
            (
                "roundtrip_ms",
                "warm sandbox: /execute request sent → response body complete (SDK: run_code call → return)",
            ),
            ("result_ms", "warm sandbox: /execute request sent → main result line (SDK: on_result)"),
            ("end_of_execution_ms", "warm sandbox: /execute request sent → `end_of_execution` line"),
            ("delete_ms", "DELETE round trip; untimed clean-up, for information"),
            ("kill_ms", "(SDK) sbx.kill() round trip; untimed clean-up, for information"),
            SERVER_TIMING[0],
            SERVER_TIMING[1],
            SERVER_TIMING[2],
            SERVER_TIMING[3],
        ],
    },
    RigDef {
        name: "template",
        version: 1,
        task: "bench:template",
        title: "Your own template: build and create",
        clock: &[
            (
                "build_ms",
                "`copse template build --from-json` spawned → exited 0 (the SDK's template API routes; includes the CLI's 200 ms status poll)",
            ),
            (
                "total_ms",
                "client sends POST /v2/sandboxes → receives the `end` event of the first command (/bin/true through the agent's process API)",
            ),
            (
                "first_http_ms",
                "client sends POST /v2/sandboxes → first 200 to GET / on port 8080 through the gateway's host routing (502s retried)",
            ),
            ("exec_ms", "create response read → `end` event of /bin/true"),
            ("http_ms", "create response read → first 200 on port 8080"),
            (
                "first_result_ms",
                "client sends POST /v2/sandboxes (code-interpreter-v1, no pool) → main `result` line of the first /execute received",
            ),
            ("create_ms", "create round trip, response body read"),
            ("execute_ms", "create response read → main result line"),
            ("execute_end_ms", "create response read → `end_of_execution` line"),
            ("delete_ms", "DELETE round trip; untimed clean-up, for information"),
            SERVER_TIMING[0],
            SERVER_TIMING[1],
            SERVER_TIMING[2],
            SERVER_TIMING[3],
        ],
    },
    RigDef {
        name: "density",
        version: 1,
        task: "bench:density",
        title: "Idle sandboxes per host",
        clock: &[
            (
                "create_ms",
                "client sends POST /v2/sandboxes → response read (template `code-interpreter-v1`: → first run_code result, so its kernel runs)",
            ),
            (
                "avail_per_sandbox_mib",
                "not a clock: (MemAvailable before the batch − MemAvailable after it) ÷ sandboxes in the batch, /proc/meminfo",
            ),
            (
                "cgroup_per_sandbox_mib",
                "not a clock: mean of the sandboxes' memory cgroup usage (memory.usage_in_bytes, v1; memory.current, v2) after the batch",
            ),
            (
                "cgroup_rss_per_sandbox_mib",
                "not a clock: mean of the sandboxes' cgroup `rss` (v1) / `anon` (v2) from memory.stat after the batch",
            ),
        ],
    },
    RigDef {
        name: "load",
        version: 1,
        task: "bench:load",
        title: "Snippet requests under sustained load",
        clock: &[
            (
                "latency_ms",
                "load tool (hey) sends the HTTP request to the rig's front → response body received; the front runs the snippet in a sandbox",
            ),
            ("req_per_s", "not a clock: requests completed ÷ hey's wall time"),
        ],
    },
    RigDef {
        name: "net",
        version: 1,
        task: "bench:net",
        title: "Network isolation path",
        clock: &[
            (
                "rtt_ms",
                "1-byte TCP request sent → 1-byte reply read, one connection with TCP_NODELAY, client in the sandbox's network namespace (host namespace for the reference)",
            ),
            ("gbit_per_s", "not a clock: iperf3 single-stream received rate from the sandbox's namespace to the peer"),
            ("update_ms", "PUT /sandboxes/{id}/network with a 1000-address allowOut sent → response read"),
            ("attach_ms", "cubenet attach of a fresh network namespace called → returned (no gateway)"),
            ("detach_ms", "cubenet detach called → returned"),
        ],
    },
    RigDef {
        name: "egress",
        version: 2,
        task: "bench:egress",
        title: "Egress proxy and volume I/O",
        clock: &[
            (
                "new_conn_ms",
                "in the sandbox (python3 http.client): before connect → last byte of a 2-byte GET response from the netns peer, a new TCP (and TLS) connection per request, closed after it",
            ),
            (
                "keepalive_ms",
                "in the sandbox: request sent → last byte of the 2-byte response on one kept-alive connection (reopened, inside the clock, when the other end closed it)",
            ),
            ("get_ms", "in the sandbox: before connect → last byte of a large GET (params.big_mib MiB) from the peer"),
            ("get_mib_per_s", "not a clock: the large GET's bytes ÷ get_ms"),
            (
                "write_buffered_ms",
                "in the sandbox (python3): open → the last of params.disk_mib 1 MiB writes of incompressible data returned (page cache)",
            ),
            ("write_ms", "in the sandbox: the same open → last write → fsync"),
            ("write_synced_ms", "in the sandbox: the same open → last write → fsync → sync(2)"),
            (
                "read_ms",
                "in the sandbox: open → the file read back in 1 MiB reads to EOF, after the host's page cache was dropped",
            ),
            ("write_buffered_mib_per_s", "not a clock: params.disk_mib ÷ write_buffered_ms"),
            ("write_mib_per_s", "not a clock: params.disk_mib ÷ write_ms"),
            ("write_synced_mib_per_s", "not a clock: params.disk_mib ÷ write_synced_ms"),
            ("read_mib_per_s", "not a clock: params.disk_mib ÷ read_ms"),
        ],
    },
    RigDef {
        name: "pause-resume",
        version: 1,
        task: "bench:pause-resume",
        title: "Pause and resume",
        clock: &[
            ("pause_ms", "POST /sandboxes/{id}/pause sent → 204 read"),
            ("resume_ms", "POST /v2/sandboxes/{id}/connect sent → 201 read"),
            (
                "resume_to_health_ms",
                "resume request sent → the sandbox's envd GET /health answered through the gateway",
            ),
        ],
    },
    RigDef {
        name: "snapshot",
        version: 1,
        task: "bench:snapshot",
        title: "Filesystem snapshot",
        clock: &[
            (
                "snapshot_ms",
                "POST /sandboxes/{id}/snapshots sent → 201 read (files copied while the sandbox is frozen)",
            ),
            ("delete_ms", "DELETE /templates/{snapshot} sent → 204 read"),
        ],
    },
    RigDef {
        name: "snapshot-dirty",
        version: 1,
        task: "bench:snapshot-dirty",
        title: "Snapshot with dirty data",
        clock: &[
            (
                "snapshot_ms",
                "POST /sandboxes/{id}/snapshots sent → 201 read, with N MB written into the sandbox since boot",
            ),
            ("delete_ms", "DELETE /templates/{snapshot} sent → 204 read"),
        ],
    },
    RigDef {
        name: "from-snapshot",
        version: 1,
        task: "bench:from-snapshot",
        title: "Create from snapshot",
        clock: &[
            ("create_ms", "POST /v2/sandboxes with the snapshot as templateID sent → 201 read"),
            ("first_read_ms", "create response read → GET /files of a file from the snapshot read"),
            ("total_ms", "create_ms + first_read_ms"),
        ],
    },
    RigDef {
        name: "rollback",
        version: 1,
        task: "bench:rollback",
        title: "Rollback in place",
        clock: &[(
            "rollback_ms",
            "POST /copse/sandboxes/{id}/rollback sent → 200 read (files replaced, processes restarted)",
        )],
    },
    RigDef {
        name: "clone",
        version: 1,
        task: "bench:clone",
        title: "Clone a running sandbox",
        clock: &[
            (
                "wall_ms",
                "first POST /copse/sandboxes/{id}/clone of a round sent → last response read (all clones of the round)",
            ),
            ("per_sandbox_ms", "wall_ms ÷ clones per round"),
        ],
    },
    RigDef {
        name: "memory-snapshot",
        version: 1,
        task: "bench:memory-snapshot",
        title: "Memory snapshot and restore",
        clock: &[
            (
                "snapshot_ms",
                "POST /sandboxes/{id}/snapshots {memory: true} sent → 201 read (sandbox frozen, files copied, every process checkpointed by CRIU), with N MB held in the sandbox's /dev/shm",
            ),
            (
                "restore_ms",
                "POST /v2/sandboxes with that snapshot as templateID sent → 201 read (processes restored by CRIU into a new sandbox, host name set, network attached, agent handed its token)",
            ),
            (
                "first_read_ms",
                "create response read → GET /files of a file from the snapshot read (the restored agent answers)",
            ),
            (
                "handover_ms",
                "held-N-lazy/eager: POST /v2/sandboxes from a memory snapshot of a process holding N MB of random bytes in its own memory sent → 201 read (lazy: handed over once the process tree is back, its pages copied in on touch and in the background; eager: every page written back first)",
            ),
            (
                "touch_all_ms",
                "create response read → the restored process has hashed every byte it holds (a command asks it through a file and waits for the answer, checked against the source's digest)",
            ),
        ],
    },
    RigDef {
        name: "object-store",
        version: 1,
        task: "bench:object-store",
        title: "Snapshots through an S3 object store",
        clock: &[
            (
                "push_ms",
                "`copse snapshot push` started → exited: the export stream cut into content-defined chunks and hashed, a HEAD per chunk and a PUT per chunk the bucket lacks (all of them: each sample's bytes are new), then the manifest",
            ),
            ("repush_ms", "the same snapshot pushed again: every chunk is there, so HEADs and the manifest only"),
            (
                "pull_ms",
                "once the snapshot was deleted on the host, `copse snapshot pull` started → exited: manifest, every chunk fetched (4 at a time) and checked against its hash, the stream imported",
            ),
            ("create_ms", "POST /v2/sandboxes from the pulled snapshot sent → 201 read"),
            ("first_read_ms", "create response read → GET /files of a file from the snapshot read"),
        ],
    },
    RigDef {
        name: "cluster",
        version: 1,
        task: "bench:cluster",
        title: "Create to first exec through a cluster",
        clock: &[
            (
                "create_ms",
                "POST /v2/sandboxes sent → 201 read (forwarded: through node two's gateway to node one; bursts: through node one's gateway to the node placement picks)",
            ),
            ("exec_ms", "create response read → the end event of process.Process/Start of /bin/true read"),
            (
                "total_ms",
                "create sent → the first command's end event read (bursts: the same, per create, while the other clients' creates run)",
            ),
            (
                "server_ms",
                "the create's own time on node one (or the single gateway): its Server-Timing total, which a forwarding gateway passes back unchanged",
            ),
            (
                "path_ms",
                "total_ms − server_ms of the same sample: everything but the sandbox's making (the ways in, the forwarding, the first command), free of the boot's own spread",
            ),
            (
                "snapshot_ms",
                "cross-node restore: POST /sandboxes/{id}/snapshots {memory: false} on node one sent → 201 read (cross-node-memory: {memory: true})",
            ),
            (
                "upload_ms",
                "snapshot answered → its manifest in the bucket (node one exports it, cuts it into content-defined chunks, PUTs those the bucket lacks, then the manifest; polled every 20 ms)",
            ),
            (
                "restore_create_ms",
                "node one drained: POST /v2/sandboxes from the snapshot through node two's gateway sent → 201 read (manifest and chunks fetched 4 at a time and checked against their hashes, the stream imported, the sandbox booted)",
            ),
            ("first_read_ms", "create response read → GET /files of a file written before the snapshot read"),
            (
                "cached_create_ms",
                "a second create of the snapshot on node two, which holds the fetched files: sent → 201 read",
            ),
            (
                "handover_ms",
                "cross-node-memory, node one drained: POST /v2/sandboxes from a memory snapshot of a process holding N MiB through node two's gateway sent → 201 read (layers and the checkpoint's image served from the bucket as read; the restore lazy from 128 MiB of pages)",
            ),
            (
                "touch_all_ms",
                "create response read → the restored process has hashed every byte it holds (pages not copied yet fetched from the bucket as touched; checked against the source's digest)",
            ),
            (
                "whole_handover_ms",
                "the same create through node three's gateway (`--no-lazy-fetch`): the whole snapshot stream fetched and imported, then the restore",
            ),
            ("whole_touch_all_ms", "the holder's hash in that sandbox, as touch_all_ms"),
        ],
    },
];

pub fn find(name: &str) -> Option<&'static RigDef> {
    RIGS.iter().find(|r| r.name == name)
}

/// The `clock` object of a result file: only the metrics the run recorded.
pub fn clock_json<'a>(rig: &RigDef, metrics: impl IntoIterator<Item = &'a str>) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    for m in metrics {
        let def = rig.clock.iter().find(|(k, _)| *k == m).map(|(_, d)| *d).or_else(|| {
            if m.starts_with("server_boot_") {
                return Some(
                    "gateway's own account: one step of the substrate's boot (Server-Timing boot_<step>, steps listed in docs/lifecycle.md)",
                );
            }
            m.strip_prefix("server_").map(|_| "gateway's own account: a Server-Timing metric of the create response")
        });
        out.insert(m.to_string(), def.map_or(serde_json::Value::Null, |d| serde_json::Value::String(d.into())));
    }
    serde_json::Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_tasks_are_unique() {
        for (i, a) in RIGS.iter().enumerate() {
            for b in &RIGS[i + 1..] {
                assert_ne!(a.name, b.name);
                assert_ne!(a.task, b.task);
            }
        }
    }

    #[test]
    fn clock_covers_recorded_metrics_only() {
        let rig = find("create-latency").unwrap();
        let c = clock_json(rig, ["total_ms", "server_x_ms", "mystery_ms"]);
        assert!(c["total_ms"].as_str().unwrap().starts_with("client sends"));
        assert!(c["server_x_ms"].is_string());
        assert!(c["mystery_ms"].is_null());
        assert_eq!(c.as_object().unwrap().len(), 3);
    }
}
