//! `copse up`: open the state, make sure templates exist, re-adopt or clean
//! what a previous run left, then serve until SIGINT/SIGTERM.

use std::sync::Arc;

use anyhow::Context;
use copse_jails::Substrate;
use copse_jails::template::{PackageSystem, Recipe, builtin};

use crate::api::{self, Keys};
use crate::config::{self, Config};
use crate::progress::Reporter;
use crate::sandboxes::Sandboxes;
use crate::store::Store;

pub fn open_substrate(config: &Config) -> anyhow::Result<Arc<dyn Substrate>> {
    std::fs::create_dir_all(&config.data_dir).with_context(|| format!("creating {}", config.data_dir.display()))?;
    Ok(Arc::from(copse_jails::host_substrate(&config.data_dir, &config.agent_binary)?))
}

pub fn default_recipes() -> Vec<Recipe> {
    let os = if cfg!(target_os = "freebsd") { PackageSystem::FreeBsd } else { PackageSystem::Debian };
    builtin(os)
}

/// Builds each recipe that is missing, showing progress.
pub fn ensure_templates(substrate: &dyn Substrate, recipes: &[Recipe]) -> anyhow::Result<()> {
    for recipe in recipes {
        if substrate.templates()?.iter().any(|t| t.name == recipe.name) {
            continue;
        }
        let reporter = Reporter::new(&format!("building template {}", recipe.name));
        let result = substrate.ensure_template(recipe, &|line| reporter.line(line));
        reporter.finish();
        result?;
    }
    Ok(())
}

pub async fn run(config: Config) -> anyhow::Result<()> {
    let substrate = open_substrate(&config)?;
    let keys = config::api_keys(&config.data_dir, &config.listen)?;
    {
        let substrate = substrate.clone();
        tokio::task::spawn_blocking(move || ensure_templates(substrate.as_ref(), &default_recipes())).await??;
    }
    let store = Store::open(&config.database())?;
    let pool = (config.pool_size > 0).then(|| (config.pool_template.clone(), config.pool_size));
    let svc = Arc::new(Sandboxes::new(substrate.clone(), store, config.run_dir(), pool));
    let recovery = svc.recover().await?;
    if !recovery.adopted.is_empty() || !recovery.removed.is_empty() {
        tracing::info!(adopted = ?recovery.adopted, removed = ?recovery.removed, "recovered sandboxes from the previous run");
    }
    let reaper = svc.spawn_reaper();
    let pool = svc.spawn_pool();
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("listening on {}", config.listen))?;
    let addr = listener.local_addr()?;
    println!("copse {} serving the E2B API on http://{addr} ({})", env!("CARGO_PKG_VERSION"), substrate.name());
    println!("point the E2B SDK at it with:");
    println!("  export E2B_API_URL=http://{addr}");
    println!("  export E2B_SANDBOX_URL=http://{addr}");
    println!("  export E2B_API_KEY={}", keys[0]);
    let app = api::router(svc.clone(), Keys::new(keys));
    axum::serve(listener, app).with_graceful_shutdown(shutdown_signal()).await?;
    reaper.abort();
    if let Some(pool) = pool {
        pool.abort();
    }
    svc.drain_pool().await;
    if !config.keep_sandboxes {
        for record in svc.list(&Default::default())? {
            if let Err(e) = svc.kill(&record.id).await {
                tracing::error!("killing {} on shutdown: {e:#}", record.id);
            }
        }
    }
    println!("copse stopped");
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
