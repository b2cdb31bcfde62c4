//! `copse keys` and `copse teams`: local commands on the data dir's
//! database, safe beside a running gateway (SQLite WAL).

use std::path::PathBuf;

use clap::Subcommand;
use copse_gateway::config;
use copse_gateway::model::{DEFAULTS_ROW, Quotas};
use copse_gateway::server;
use copse_gateway::store::Database;
use copse_gateway::tenancy::accounts;
use time::OffsetDateTime;

#[derive(clap::Args, Clone)]
pub struct DataDir {
    #[arg(long, env = "COPSE_DATA_DIR", default_value = config::DEFAULT_DATA_DIR)]
    data_dir: PathBuf,
    /// The state database as a PostgreSQL URL; default: SQLite in the
    /// data dir.
    #[arg(long, env = "COPSE_DATABASE")]
    database: Option<String>,
}

#[derive(Subcommand)]
pub enum KeysCommand {
    /// Make a key for TEAM (created if new) and print it, once.
    Create {
        #[arg(long)]
        team: String,
        /// A label to recognise the key by in `copse keys list`.
        #[arg(long, default_value = "")]
        name: String,
        /// The key sees and acts on every team's sandboxes and snapshots.
        #[arg(long)]
        admin: bool,
        #[command(flatten)]
        dir: DataDir,
    },
    /// Team, label, prefix, creation and last use of every key.
    List {
        #[command(flatten)]
        dir: DataDir,
    },
    /// Revoke the key starting with PREFIX (as `copse keys list` shows it).
    Revoke {
        prefix: String,
        #[command(flatten)]
        dir: DataDir,
    },
}

#[derive(clap::Args, Clone)]
pub struct Limits {
    /// Running sandboxes at once.
    #[arg(long)]
    max_sandboxes: Option<u64>,
    /// Paused sandboxes kept.
    #[arg(long)]
    max_paused: Option<u64>,
    #[arg(long)]
    max_snapshots: Option<u64>,
    /// Disk quotas of the team's sandboxes plus its snapshots, in GiB.
    #[arg(long)]
    max_disk_gb: Option<u64>,
    /// Longest sandbox lifetime a request may ask for, in seconds.
    #[arg(long)]
    max_sandbox_timeout: Option<u64>,
    /// Requests per second each of the team's keys may send.
    #[arg(long)]
    requests_per_second: Option<u64>,
    /// How long a sandbox may stay paused before it is deleted with its
    /// files: 90s, 15m, 12h, 7d.
    #[arg(long, value_parser = copse_gateway::model::parse_duration_s)]
    paused_retention: Option<u64>,
}

#[derive(Subcommand)]
pub enum TeamsCommand {
    /// Set a team's limits (those not given stay as they were); with
    /// --defaults instead of NAME, the limits of teams that set none.
    Set {
        #[arg(required_unless_present = "defaults", conflicts_with = "defaults")]
        name: Option<String>,
        #[arg(long)]
        defaults: bool,
        #[command(flatten)]
        limits: Limits,
        #[command(flatten)]
        dir: DataDir,
    },
    /// Every team and its limits.
    List {
        #[command(flatten)]
        dir: DataDir,
    },
}

fn open(dir: &DataDir) -> anyhow::Result<Box<dyn Database>> {
    let paths = super::Paths { data_dir: dir.data_dir.clone(), database: dir.database.clone(), agent: None };
    let config = super::local_config(paths)?;
    server::open_store(&config)
}

pub fn keys(command: KeysCommand) -> anyhow::Result<()> {
    match command {
        KeysCommand::Create { team, name, admin, dir } => {
            let key = accounts::create_key(&*open(&dir)?, &team, &name, admin)?;
            eprintln!("a new key for team {team}; it is shown only now:");
            println!("{key}");
        }
        KeysCommand::List { dir } => {
            println!("{:<16} {:<20} {:<14} {:<6} {:<20} LAST USED", "TEAM", "LABEL", "PREFIX", "ADMIN", "CREATED");
            for key in open(&dir)?.keys()? {
                let used = key.last_used_ms.map(date).unwrap_or_else(|| "never".into());
                let admin = if key.admin { "yes" } else { "" };
                let created = date(key.created_at_ms);
                println!("{:<16} {:<20} {:<14} {admin:<6} {created:<20} {used}", key.team, key.label, key.prefix);
            }
        }
        KeysCommand::Revoke { prefix, dir } => {
            let key = accounts::revoke_key(&*open(&dir)?, &prefix)?;
            println!("revoked key {} of team {}", key.prefix, key.team);
        }
    }
    Ok(())
}

pub fn teams(command: TeamsCommand) -> anyhow::Result<()> {
    match command {
        TeamsCommand::Set { name, defaults: _, limits, dir } => {
            let change = Quotas {
                max_sandboxes: limits.max_sandboxes,
                max_paused: limits.max_paused,
                max_snapshots: limits.max_snapshots,
                max_disk_gb: limits.max_disk_gb,
                max_sandbox_timeout_s: limits.max_sandbox_timeout,
                requests_per_second: limits.requests_per_second,
                paused_retention_s: limits.paused_retention,
            };
            let team = accounts::set_limits(&*open(&dir)?, name.as_deref(), change)?;
            println!("{}", describe(&team.name, &team.quotas));
        }
        TeamsCommand::List { dir } => {
            for team in open(&dir)?.teams()? {
                println!("{}", describe(&team.name, &team.quotas));
            }
        }
    }
    Ok(())
}

fn describe(name: &str, quotas: &Quotas) -> String {
    let name = if name == DEFAULTS_ROW { "(defaults)" } else { name };
    let limit = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_else(|| "-".into());
    format!(
        "{name:<16} sandboxes {} paused {} snapshots {} disk-gb {} timeout-s {} requests/s {} paused-retention-s {}",
        limit(quotas.max_sandboxes),
        limit(quotas.max_paused),
        limit(quotas.max_snapshots),
        limit(quotas.max_disk_gb),
        limit(quotas.max_sandbox_timeout_s),
        limit(quotas.requests_per_second),
        limit(quotas.paused_retention_s)
    )
}

fn date(ms: i64) -> String {
    let t = OffsetDateTime::from_unix_timestamp(ms / 1000).unwrap_or(OffsetDateTime::UNIX_EPOCH);
    format!("{:04}-{:02}-{:02} {:02}:{:02}:{:02}", t.year(), t.month() as u8, t.day(), t.hour(), t.minute(), t.second())
}
