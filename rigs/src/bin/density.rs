//! `copse-rig-density`: how many idle sandboxes one host keeps alive and what
//! each costs in host memory. Sandboxes are created in batches up to each
//! target (default 100, 300, 500, 1000) for `base` and for
//! `code-interpreter-v1` (each runs `1+1` first, so its kernel is up);
//! before every batch the rig checks that the batch fits above a memory
//! reserve and stops early when it does not. Memory per sandbox comes from
//! two sources: the drop of `MemAvailable` since the gateway started idle,
//! and the sandboxes' own memory cgroups.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use copse_rigs::density::{MIB, cgroup_memory, mem_available, next_target, sandbox_cgroup};
use copse_rigs::facts::random_hex;
use copse_rigs::{Conn, Created, Gateway, LEAN_CLIENT, RigArgs, Run, Scenario, ms, round3};
use serde_json::json;

const RIG: &str = "density";

#[derive(Parser, Debug)]
#[command(version, about = "Idle sandboxes per host and host memory per sandbox")]
struct Args {
    /// Alive-sandbox counts to reach, in order.
    #[arg(long, value_delimiter = ',', default_values_t = [100usize, 300, 500, 1000])]
    targets: Vec<usize>,
    /// Templates to fill the host with, one after the other.
    #[arg(long, value_delimiter = ',', default_values_t = ["base".to_string(), "code-interpreter-v1".to_string()])]
    templates: Vec<String>,
    /// MemAvailable that must remain after a batch, in MiB; default: the larger of 8 GiB and 35 % of MemTotal
    /// (the host is shared).
    #[arg(long)]
    reserve_mib: Option<u64>,
    /// Simultaneous creates while filling.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    #[command(flatten)]
    common: RigArgs,
}

fn meminfo_available() -> u64 {
    mem_available(&std::fs::read_to_string("/proc/meminfo").unwrap_or_default()).unwrap_or(0)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Linux figures only: on a host without them the rig writes nothing.
    anyhow::ensure!(
        mem_available(&std::fs::read_to_string("/proc/meminfo").unwrap_or_default()).is_some(),
        "bench:density needs Linux's /proc/meminfo (MemAvailable) and memory cgroups; this host has neither, nothing \
         written"
    );
    let run = Run::begin(RIG);
    let bins = &args.common.bins;
    bins.check()?;
    bins.build_template(None)?;
    let key = random_hex(16)?;
    let total = run.host["memory_bytes"].as_u64().unwrap_or(0);
    let reserve = args.reserve_mib.map_or((8u64 << 30).max(total / 100 * 35), |m| m << 20);
    let mut notes = Vec::new();
    let mut scenarios = Vec::new();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let roots: Vec<PathBuf> = ["/sys/fs/cgroup/memory", "/sys/fs/cgroup"].iter().map(PathBuf::from).collect();
    for template in &args.templates {
        // No pool: pooled spares would count as memory of nobody.
        let pools = vec![format!("{template}=0"), "base=0".to_string()];
        let gw = Gateway::start(bins, &key, &pools, "copse-rig-density")?;
        eprintln!("== {template}: gateway on {} (log {})", gw.addr, gw.log.display());
        std::thread::sleep(Duration::from_secs(2));
        let baseline = meminfo_available();
        let body: &'static str = Box::leak(
            json!({"templateID": template, "timeout": 3600, "metadata": {}, "envVars": {}})
                .to_string()
                .into_boxed_str(),
        );
        let kernel = template.contains("code-interpreter");
        let mut alive: Vec<Created> = Vec::new();
        let mut create_ms = Vec::new();
        let mut errors = Vec::new();
        let mut points: BTreeMap<&str, Vec<Option<f64>>> = BTreeMap::new();
        let mut wall = 0.0;
        let mut per_sandbox = if kernel { 96.0 * MIB } else { 16.0 * MIB };
        for &goal in &args.targets {
            let available = meminfo_available();
            let Some(target) = next_target(goal, alive.len(), available, reserve, per_sandbox) else {
                notes.push(format!(
                    "{template}: stopped at {} sandboxes before the {goal} batch: MemAvailable {:.0} MiB, reserve {:.0} \
                     MiB, {:.1} MiB per sandbox measured so far (×1.5 margin)",
                    alive.len(),
                    available as f64 / MIB,
                    reserve as f64 / MIB,
                    per_sandbox / MIB
                ));
                break;
            };
            if target < goal {
                notes.push(format!(
                    "{template}: the {goal} batch was cut to {target} sandboxes to keep the memory reserve"
                ));
            }
            eprintln!("-- {template}: {} → {target} sandboxes", alive.len());
            let t0 = Instant::now();
            let (made, times, errs) =
                rt.block_on(fill(gw.addr, &key, body, kernel, target - alive.len(), args.concurrency));
            wall += ms(t0.elapsed());
            alive.extend(made);
            create_ms.extend(times.into_iter().map(Some));
            let failed = !errs.is_empty();
            errors.extend(errs);
            std::thread::sleep(Duration::from_secs(3));
            let now = meminfo_available();
            let n = alive.len().max(1) as f64;
            per_sandbox = (baseline.saturating_sub(now) as f64 / n).max(1.0);
            let cg: Vec<(u64, u64)> =
                alive.iter().filter_map(|c| sandbox_cgroup(&roots, &c.id).and_then(|d| cgroup_memory(&d))).collect();
            let mean = |f: &dyn Fn(&(u64, u64)) -> u64| {
                (!cg.is_empty()).then(|| round3(cg.iter().map(f).sum::<u64>() as f64 / cg.len() as f64 / MIB))
            };
            points.entry("sandboxes").or_default().push(Some(alive.len() as f64));
            points.entry("mem_available_mib").or_default().push(Some(round3(now as f64 / MIB)));
            points.entry("avail_per_sandbox_mib").or_default().push(Some(round3(per_sandbox / MIB)));
            points.entry("cgroup_per_sandbox_mib").or_default().push(mean(&|c| c.0));
            points.entry("cgroup_rss_per_sandbox_mib").or_default().push(mean(&|c| c.1));
            points.entry("cgroups_read").or_default().push(Some(cg.len() as f64));
            if failed {
                notes.push(format!("{template}: creates failed in the batch towards {goal}; later batches skipped"));
                break;
            }
        }
        let reached = alive.len();
        eprintln!("-- {template}: deleting {reached} sandboxes");
        let del_errors = rt.block_on(delete_all(gw.addr, &key, alive, args.concurrency));
        if del_errors > 0 {
            notes.push(format!("{template}: {del_errors} deletes failed at the end"));
        }
        gw.stop(&mut notes);
        let mut memory = Scenario {
            name: format!("{template}-memory"),
            client: "rig: /proc/meminfo and the sandboxes' memory cgroups after each batch".into(),
            concurrency: args.concurrency,
            pool: Some(0),
            series: points.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
            ..Scenario::default()
        };
        memory.counters.insert("baseline_mem_available_mib".into(), json!((baseline as f64 / MIB).round() as u64));
        memory.counters.insert("sandboxes_reached".into(), json!(reached));
        let mut creates = Scenario {
            name: format!("{template}-create"),
            client: "lean-rust".into(),
            concurrency: args.concurrency,
            pool: Some(0),
            wall_ms: Some(wall),
            errors,
            ..Scenario::default()
        };
        creates.counters.insert("ok".into(), json!(create_ms.len()));
        creates.series.insert("create_ms".into(), create_ms);
        scenarios.push(memory);
        scenarios.push(creates);
    }
    notes.extend(standing_notes(reserve));
    let params = json!({
        "targets": args.targets,
        "templates": args.templates,
        "reserve_mib": reserve >> 20,
        "concurrency": args.concurrency,
        "create_timeout_s": 3600,
        "kernel_started_with": "run_code(\"1+1\") right after create (code-interpreter templates)",
        "lean_client": format!("copse-rig-density: {LEAN_CLIENT}"),
    });
    let (out, _) = run.write(&args.common.out_dir, params, bins, &scenarios, json!({}), json!([]), notes)?;
    for s in scenarios.iter().filter(|s| s.name.ends_with("-memory")) {
        let last = |m: &str| s.series.get(m).and_then(|v| v.last().copied().flatten());
        println!(
            "{}: {:?} sandboxes, {:?} MiB each (MemAvailable), {:?} MiB each (cgroup)",
            s.name,
            last("sandboxes"),
            last("avail_per_sandbox_mib"),
            last("cgroup_per_sandbox_mib")
        );
    }
    println!("wrote {}", out.display());
    Ok(())
}

/// Creates `n` sandboxes with `cc` workers; returns them, the create times and errors.
async fn fill(
    addr: std::net::SocketAddr,
    key: &str,
    body: &'static str,
    kernel: bool,
    n: usize,
    cc: usize,
) -> (Vec<Created>, Vec<f64>, Vec<String>) {
    let next = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..cc)
        .map(|_| {
            let (next, key) = (next.clone(), key.to_string());
            tokio::spawn(async move {
                let mut out = Vec::new();
                let mut conn = match Conn::open(addr).await {
                    Ok(c) => c,
                    Err(e) => return vec![Err(format!("connect: {e:#}"))],
                };
                while next.fetch_add(1, Ordering::SeqCst) < n {
                    let t0 = Instant::now();
                    let r = async {
                        let c = conn.create_sandbox(&key, body).await?;
                        if kernel {
                            let text = conn.run_code(&c.id, &c.token, "1+1").await?;
                            anyhow::ensure!(text == "2", "1+1 gave {text:?}");
                        }
                        Ok::<_, anyhow::Error>((c, ms(t0.elapsed())))
                    }
                    .await;
                    let failed = r.is_err();
                    out.push(r.map_err(|e| format!("{e:#}")));
                    if failed {
                        break;
                    }
                }
                out
            })
        })
        .collect();
    let (mut made, mut times, mut errors) = (Vec::new(), Vec::new(), Vec::new());
    for t in tasks {
        for r in t.await.unwrap_or_else(|e| vec![Err(format!("worker: {e}"))]) {
            match r {
                Ok((c, t)) => {
                    made.push(c);
                    times.push(t);
                }
                Err(e) => errors.push(e),
            }
        }
    }
    (made, times, errors)
}

async fn delete_all(addr: std::net::SocketAddr, key: &str, alive: Vec<Created>, cc: usize) -> usize {
    let ids = Arc::new(std::sync::Mutex::new(alive.into_iter().map(|c| c.id).collect::<Vec<_>>()));
    let tasks: Vec<_> = (0..cc)
        .map(|_| {
            let (ids, key) = (ids.clone(), key.to_string());
            tokio::spawn(async move {
                let mut failed = 0;
                let Ok(mut conn) = Conn::open(addr).await else { return usize::MAX };
                while let Some(id) = ids.lock().map(|mut v| v.pop()).ok().flatten() {
                    if conn.delete_sandbox(&key, &id).await.is_err() {
                        failed += 1;
                    }
                }
                failed
            })
        })
        .collect();
    let mut failed = 0usize;
    for t in tasks {
        failed = failed.saturating_add(t.await.unwrap_or(usize::MAX));
    }
    failed
}

fn standing_notes(reserve: u64) -> Vec<String> {
    [
        format!(
            "Before each batch the rig estimates its cost (MiB per sandbox so far ×1.5) and cuts or skips the batch so \
             that MemAvailable stays above the reserve ({} MiB); the host is shared, so the ceiling here is the \
             reserve, not copse.",
            reserve >> 20
        ),
        "avail_per_sandbox_mib = (MemAvailable with the idle gateway − MemAvailable 3 s after the batch) ÷ sandboxes \
         alive; it includes page cache and kernel memory the sandboxes cause, and anything else on the shared host \
         that grew or shrank meanwhile."
            .into(),
        "cgroup_per_sandbox_mib = mean memory.usage_in_bytes (v1; memory.current on v2) over the sandboxes' own \
         memory cgroups (it counts page cache charged to them); cgroup_rss_per_sandbox_mib = mean `rss` (v1) / \
         `anon` (v2) of memory.stat. cgroups_read says how many sandboxes' cgroups were found."
            .into(),
        "<template>-create.create_ms: create request sent → response read; for code-interpreter templates → first \
         run_code(\"1+1\") result (so the kernel is running). wall_ms is the sum of the batches' fill times."
            .into(),
    ]
    .into()
}
