//! The `copse` command: the server (`up`) and thin clients of it.

use std::io::{BufReader, BufWriter};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use copse_gateway::config::{self, Config};
use copse_gateway::telemetry::logging::{self, LogFormat};
use copse_gateway::{serve, server};

mod accounts_cli;
mod template_cli;

#[derive(Parser)]
#[command(name = "copse", version, about = "Self-hosted sandboxes behind the E2B API")]
struct Cli {
    /// `text` for people, `json` (one object per line) for a log pipeline.
    #[arg(long, global = true, env = "COPSE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Clone)]
struct Paths {
    /// Where sandboxes, templates and the state database live.
    #[arg(long, env = "COPSE_DATA_DIR", default_value = config::DEFAULT_DATA_DIR)]
    data_dir: PathBuf,
    /// The state database as a PostgreSQL URL (`postgres://…`); default:
    /// SQLite in the data dir.
    #[arg(long, env = "COPSE_DATABASE")]
    database: Option<String>,
    /// The in-sandbox agent binary (found next to copse by default).
    #[arg(long, env = "COPSE_AGENT")]
    agent: Option<PathBuf>,
}

#[derive(clap::Args, Clone)]
struct Remote {
    /// The gateway to talk to.
    #[arg(long, env = "E2B_API_URL", default_value = "http://127.0.0.1:3000")]
    api_url: String,
    /// API key (default: the one copse generated in the data dir).
    #[arg(long, env = "E2B_API_KEY")]
    api_key: Option<String>,
    #[arg(long, env = "COPSE_DATA_DIR", default_value = config::DEFAULT_DATA_DIR)]
    data_dir: PathBuf,
}

// Parsed once per process: the size of its largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Build missing default templates, then serve the E2B API.
    Up {
        #[arg(long, env = "COPSE_LISTEN", default_value = config::DEFAULT_LISTEN)]
        listen: SocketAddr,
        #[command(flatten)]
        paths: Paths,
        /// Leave sandboxes running on shutdown (a restart re-adopts them).
        #[arg(long)]
        keep_sandboxes: bool,
        /// Sandboxes kept booted ahead of demand: TEMPLATE=N (a bare N
        /// means base); repeat for several templates.
        #[arg(long = "pool", env = "COPSE_POOL", value_delimiter = ',', value_parser = copse_gateway::pool::parse_pool_arg,
              default_value = "code-interpreter-v1=1")]
        pools: Vec<(String, usize)>,
        /// Bridge the sandboxes' veths join (also names the nftables table).
        #[arg(long, env = "COPSE_BRIDGE", default_value = copse_cubenet::net::DEFAULT_BRIDGE)]
        bridge: String,
        /// Subnet sandbox addresses come from; the host takes the first.
        #[arg(long, env = "COPSE_SUBNET", default_value = copse_cubenet::net::DEFAULT_SUBNET)]
        subnet: String,
        /// Opens an address range of the host's neighbourhood (private,
        /// CGNAT, link-local and metadata ranges, blocked by default) to
        /// every sandbox, still subject to each sandbox's own policy. An
        /// IPv4 address or CIDR block; repeatable, or comma-separated in the
        /// environment variable.
        #[arg(long = "allow-egress-range", env = "COPSE_ALLOW_EGRESS_RANGE", value_delimiter = ',')]
        allow_egress_ranges: Vec<String>,
        /// A hosts(5) file of names the egress policies resolve before the
        /// host's resolver does: private names, and test hosts. Policies
        /// that name a host admit its address from here, and the egress
        /// proxy checks an allowed Host/SNI against it.
        #[arg(long, env = "COPSE_EGRESS_HOSTS_FILE")]
        egress_hosts_file: Option<PathBuf>,
        /// A PEM file of CA certificates the egress proxy trusts, besides
        /// the host's trust store, for the servers it sends intercepted
        /// HTTPS (to hosts with `network.rules`) on to.
        #[arg(long, env = "COPSE_EGRESS_UPSTREAM_CA")]
        egress_upstream_ca: Option<PathBuf>,
        /// Name sandbox ports `{port}-{sandboxID}.DOMAIN` (what the SDK's
        /// `get_host` returns) and route requests by that host name.
        #[arg(long, env = "COPSE_DOMAIN")]
        domain: Option<String>,
        /// Serve HTTPS with this PEM certificate chain (needs --domain and
        /// --tls-key); `copse tls init` mints one for a local domain.
        #[arg(long, requires_all = ["domain", "tls_key"])]
        tls_cert: Option<PathBuf>,
        /// The PEM private key of --tls-cert.
        #[arg(long, requires = "tls_cert")]
        tls_key: Option<PathBuf>,
        /// Each sandbox's disk quota in MiB: writes past it fail inside the
        /// sandbox (EDQUOT), uploads past it are refused.
        #[arg(long, env = "COPSE_DISK_MB", default_value_t = copse_substrate::Limits::default().disk_mb,
              value_parser = clap::value_parser!(u64).range(1..))]
        disk_mb: u64,
        #[command(flatten)]
        limits: ConnectionLimits,
        /// Serve Prometheus metrics at http://ADDR/metrics, a listener of
        /// its own for the operator (off by default; never on --listen).
        #[arg(long, env = "COPSE_METRICS_LISTEN")]
        metrics_listen: Option<SocketAddr>,
        /// With --database: the URL other gateways forward this node's
        /// sandboxes' calls to (default: https://CLUSTER_LISTEN with
        /// --cluster-tls, else http://LISTEN, on loopback only).
        #[arg(long, env = "COPSE_ADVERTISE")]
        advertise: Option<String>,
        /// With --database: this node's cluster TLS files (`copse tls
        /// node-cert`); other nodes then reach it over mutual TLS on
        /// --cluster-listen.
        #[arg(long, env = "COPSE_CLUSTER_TLS", requires_all = ["database", "cluster_listen"])]
        cluster_tls: Option<PathBuf>,
        /// The listener for other nodes' forwarded calls (mutual TLS).
        #[arg(long, env = "COPSE_CLUSTER_LISTEN", requires = "cluster_tls")]
        cluster_listen: Option<SocketAddr>,
        /// A worker node: serve other nodes only (--cluster-listen), with
        /// no E2B API of its own (--listen is not bound). The cluster's
        /// gateways place sandboxes on it and forward their calls.
        #[arg(long, env = "COPSE_NO_API", requires = "cluster_tls")]
        no_api: bool,
        /// An API front of a cluster: serve the E2B API and run no
        /// sandboxes, builds or volumes here (no substrate, no templates,
        /// no pools); they are placed on the cluster's nodes and their
        /// calls forwarded there.
        #[arg(long, env = "COPSE_NO_SANDBOXES", requires = "database", conflicts_with = "no_api")]
        no_sandboxes: bool,
        /// With --database: the object store the nodes move snapshots
        /// through (s3://BUCKET or http(s)://HOST:PORT/BUCKET; keys from
        /// AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY). Each node uploads
        /// the snapshots it takes; another node fetches one it is asked to
        /// start while the snapshot's own node is drained or lost.
        #[arg(long = "object-store", env = "COPSE_OBJECT_STORE", requires = "database")]
        object_store: Option<String>,
        /// Fetch every snapshot from the object store whole before starting
        /// it, instead of mounting its layers as they arrive.
        #[arg(long, env = "COPSE_NO_LAZY_FETCH", requires = "object_store")]
        no_lazy_fetch: bool,
        /// For the crash test only: abort at the step COPSE_FAULT names.
        #[arg(long, hide = true)]
        debug_faults: bool,
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// Serves a lazily fetched layer's image (started by the gateway, one
    /// per layer: `lazy_layers.rs`).
    #[command(hide = true)]
    LazyImage { dir: PathBuf },
    /// Local TLS: domain mode, and the mutual TLS between a cluster's nodes.
    Tls {
        #[command(subcommand)]
        command: TlsCommand,
    },
    /// The CA sandboxes with `network.rules` trust (the egress proxy
    /// intercepts their HTTPS to those hosts with it).
    EgressCa {
        #[command(subcommand)]
        command: EgressCaCommand,
    },
    /// Manage templates.
    Template {
        #[command(subcommand)]
        command: TemplateCommand,
    },
    /// Templates from OCI images.
    Image {
        #[command(subcommand)]
        command: ImageCommand,
    },
    /// API keys: each acts for a team (see README, "Teams, keys and quotas").
    Keys {
        #[command(subcommand)]
        command: accounts_cli::KeysCommand,
    },
    /// Teams' limits.
    Teams {
        #[command(subcommand)]
        command: accounts_cli::TeamsCommand,
    },
    /// Filesystem snapshots: list, and move them between hosts as files.
    Snapshot {
        #[command(subcommand)]
        command: SnapshotCommand,
    },
    /// Persistent volumes: list them, delete one no sandbox mounts, move
    /// one between hosts as a tar stream.
    Volume {
        #[command(subcommand)]
        command: VolumeCommand,
    },
    /// The nodes of a shared database (`copse up --database`).
    Node {
        #[command(subcommand)]
        command: NodeCommand,
    },
    /// List running sandboxes.
    Ls {
        #[command(flatten)]
        remote: Remote,
    },
    /// Secrets kept for the SDK's `Secret` API.
    Secrets {
        #[command(subcommand)]
        command: SecretsCommand,
    },
    /// Kill a sandbox.
    Kill {
        id: String,
        #[command(flatten)]
        remote: Remote,
    },
    /// Print the version and the substrate this build uses.
    Version,
    /// Developer tools (the crash test's fault points).
    #[command(hide = true)]
    Debug {
        #[command(subcommand)]
        command: DebugCommand,
    },
}

#[derive(Subcommand)]
enum DebugCommand {
    /// Every step `up --debug-faults` with COPSE_FAULT=POINT can abort at.
    FaultPoints,
}

/// What one client address may hold open; see `serve::Limits`.
#[derive(clap::Args, Clone)]
struct ConnectionLimits {
    /// Seconds a connection gets to send a whole request head, from
    /// connecting or from its last response (so also HTTP/1.1 keep-alive).
    #[arg(long, env = "COPSE_HEADER_TIMEOUT", default_value_t = serve::Limits::default().header_timeout.as_secs())]
    header_timeout: u64,
    /// Seconds a connection that has served requests may sit with none in
    /// flight (HTTP/2).
    #[arg(long, env = "COPSE_IDLE_TIMEOUT", default_value_t = serve::Limits::default().idle_timeout.as_secs())]
    idle_timeout: u64,
    /// Connections open at once from one client address (IPv6: one /64).
    #[arg(long, env = "COPSE_MAX_CONNECTIONS_PER_CLIENT", default_value_t = serve::Limits::default().per_client)]
    max_connections_per_client: usize,
}

impl ConnectionLimits {
    fn limits(&self) -> serve::Limits {
        serve::Limits {
            header_timeout: Duration::from_secs(self.header_timeout.max(1)),
            idle_timeout: Duration::from_secs(self.idle_timeout.max(1)),
            per_client: self.max_connections_per_client.max(1),
        }
    }
}

#[derive(Subcommand)]
enum EgressCaCommand {
    /// Replace the egress CA with a new one; a running gateway uses it
    /// from its next start.
    Rotate {
        #[arg(long, env = "COPSE_DATA_DIR", default_value = config::DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
    },
}

#[derive(Subcommand)]
enum TlsCommand {
    /// Mint a local CA and a certificate for DOMAIN and *.DOMAIN.
    Init {
        #[arg(long)]
        domain: String,
        /// Where to write ca.pem, cert.pem and key.pem (default:
        /// DATA_DIR/tls/DOMAIN).
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long, env = "COPSE_DATA_DIR", default_value = config::DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
    },
    /// Mint the CA of a cluster's mutual TLS (nodes on one database).
    ClusterCa {
        /// Where to write ca.pem and ca-key.pem (keep the key off the nodes).
        #[arg(long)]
        out: PathBuf,
    },
    /// Sign a node's certificate with the cluster CA, for `copse up
    /// --cluster-tls OUT`.
    NodeCert {
        /// The directory `copse tls cluster-ca` wrote.
        #[arg(long)]
        ca: PathBuf,
        /// A name or address other nodes reach this one by; repeatable.
        #[arg(long = "host", required = true)]
        hosts: Vec<String>,
        /// Where to write ca.pem, node.pem and node-key.pem.
        #[arg(long)]
        out: PathBuf,
    },
    /// Revoke node certificates: the CA's revocation list (crl.pem) gains
    /// them. With --database the list is published there and every node
    /// refuses them from its next heartbeat; without, copy it into each
    /// node's --cluster-tls directory (read at the next heartbeat too).
    Revoke {
        /// The directory `copse tls cluster-ca` wrote.
        #[arg(long)]
        ca: PathBuf,
        /// The cluster's database, to publish the list to its nodes.
        #[arg(long, env = "COPSE_DATABASE")]
        database: Option<String>,
        /// The node certificates (node.pem) to revoke.
        #[arg(required = true)]
        certs: Vec<PathBuf>,
    },
}

#[derive(Subcommand)]
enum TemplateCommand {
    /// Build templates: with -f or --from-json, a team's own template
    /// through the running gateway (as the SDK's `Template.build`);
    /// otherwise the built-in ones on this host (default: every one),
    /// skipping complete builds.
    Build {
        names: Vec<String>,
        /// A Dockerfile to build (FROM, RUN, COPY, ADD, ENV, ARG, WORKDIR,
        /// USER, CMD, ENTRYPOINT).
        #[arg(short = 'f', long = "file", requires = "name", conflicts_with_all = ["from_json", "names"])]
        dockerfile: Option<PathBuf>,
        /// A template as the SDK's `Template.to_json` writes it.
        #[arg(long, requires = "name", conflicts_with = "names")]
        from_json: Option<PathBuf>,
        /// The template's name (`name` or `name:tag`).
        #[arg(long)]
        name: Option<String>,
        /// More tags for the build; repeatable.
        #[arg(long = "tag")]
        tags: Vec<String>,
        /// The command a sandbox of the template starts with.
        #[arg(long)]
        start_cmd: Option<String>,
        /// The command that succeeds once the start command is ready.
        #[arg(long)]
        ready_cmd: Option<String>,
        #[arg(long)]
        cpu_count: Option<u32>,
        #[arg(long = "memory-mb")]
        memory_mb: Option<u32>,
        /// Where COPY sources are read from (default: the Dockerfile's or
        /// the JSON file's directory).
        #[arg(long)]
        context: Option<PathBuf>,
        /// The gateway to build on.
        #[arg(long, env = "E2B_API_URL", default_value = "http://127.0.0.1:3000")]
        api_url: String,
        /// API key (default: the one copse generated in the data dir).
        #[arg(long, env = "E2B_API_KEY")]
        api_key: Option<String>,
        /// Which kind of sandbox the templates boot: `jail` (the host's own
        /// isolation) or `bhyve` (microVMs; FreeBSD only).
        #[arg(long, default_value = "jail")]
        backend: copse_substrate::Backend,
        #[command(flatten)]
        paths: Paths,
    },
    /// List the templates built on this host (no gateway needed).
    List {
        #[command(flatten)]
        paths: Paths,
    },
    /// List the templates the gateway offers: shipped ones and the team's.
    Ls {
        #[command(flatten)]
        remote: Remote,
    },
    /// Delete one of the team's templates.
    Rm {
        name: String,
        #[command(flatten)]
        remote: Remote,
    },
    /// Show a template's tags; --add points tags at the build --from names,
    /// --remove drops them.
    Tags {
        name: String,
        #[arg(long, value_delimiter = ',')]
        add: Vec<String>,
        /// The tag whose build --add tags.
        #[arg(long, default_value = "default")]
        from: String,
        #[arg(long, value_delimiter = ',')]
        remove: Vec<String>,
        #[command(flatten)]
        remote: Remote,
    },
}

/// Where images are pulled from.
#[derive(clap::Args, Clone)]
struct RegistryArgs {
    /// Pull a registry's images from a mirror instead: REGISTRY=URL (e.g.
    /// docker.io=http://127.0.0.1:5000); repeatable, or comma-separated in
    /// the environment variable. Plain HTTP only for mirrors named here.
    #[arg(long = "registry-mirror", env = "COPSE_REGISTRY_MIRROR", value_delimiter = ',')]
    mirrors: Vec<String>,
    /// Registry credentials in Docker's `auths` JSON format (default:
    /// DATA_DIR/registry-auth.json when it exists).
    #[arg(long, env = "COPSE_REGISTRY_AUTH_FILE")]
    registry_auth_file: Option<PathBuf>,
}

impl RegistryArgs {
    fn registries(&self, data_dir: &std::path::Path) -> anyhow::Result<copse_images::Registries> {
        copse_gateway::images::registries(data_dir, &self.mirrors, self.registry_auth_file.as_deref())
    }
}

#[derive(Subcommand)]
enum ImageCommand {
    /// Pull an image (through --registry-mirror) and make it a template
    /// sandboxes can be created from: `Sandbox.create("NAME")`.
    Pull {
        /// An image reference, e.g. docker.io/library/debian:bookworm.
        reference: String,
        /// The template's name (default: the repository's last part and
        /// the tag, e.g. debian-bookworm). Pulling again replaces it.
        #[arg(long)]
        name: Option<String>,
        #[command(flatten)]
        registry: RegistryArgs,
        #[command(flatten)]
        paths: Paths,
    },
}

#[derive(Subcommand)]
enum SecretsCommand {
    /// Re-seal every stored secret value under a new key and drop the old
    /// one from DATA_DIR/secrets.keyring. Safe while the gateway runs.
    RotateKey {
        #[command(flatten)]
        paths: Paths,
    },
}

#[derive(Subcommand)]
enum VolumeCommand {
    /// Every team's volumes: id, team, name, bytes held, mounting sandboxes.
    Ls {
        #[command(flatten)]
        paths: Paths,
    },
    /// Delete a volume and its files (refused while a sandbox mounts it).
    Rm {
        /// Its id, or its name in --team.
        volume: String,
        #[arg(long, default_value = copse_gateway::model::DEFAULT_TEAM)]
        team: String,
        #[command(flatten)]
        paths: Paths,
    },
    /// Write a volume as a tar stream: copse-volume.json (name, team,
    /// created, quota; never its token), then its tree under data/. Links
    /// are stored as links; FIFOs, sockets and devices are skipped. Safe
    /// while the gateway runs; each file is copied as it is when opened
    /// (pause the sandboxes mounting it for a point-in-time copy).
    Export {
        /// Its id, or its name in --team.
        volume: String,
        #[arg(long, default_value = copse_gateway::model::DEFAULT_TEAM)]
        team: String,
        /// Where to write ("-": stdout, the default).
        #[arg(long, default_value = "-")]
        out: PathBuf,
        #[command(flatten)]
        paths: Paths,
    },
    /// Make a new volume from an export (a new id and token). Refuses
    /// absolute or `..` names, devices, FIFOs, links leading out of the
    /// volume and more bytes than the team's volume quota, leaving nothing.
    Import {
        /// The export ("-": stdin).
        file: PathBuf,
        /// Its name (default: the exported volume's).
        #[arg(long)]
        name: Option<String>,
        /// Its team (default: the exported volume's).
        #[arg(long)]
        team: Option<String>,
        #[command(flatten)]
        paths: Paths,
    },
}

/// An S3-compatible bucket; its keys come from the environment only.
#[derive(clap::Args)]
struct ObjectStoreArg {
    /// s3://BUCKET or http(s)://HOST:PORT/BUCKET; keys from
    /// AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, region from AWS_REGION.
    #[arg(long = "object-store", env = "COPSE_OBJECT_STORE")]
    url: String,
}

impl ObjectStoreArg {
    fn open(&self) -> anyhow::Result<copse_objects::Bucket> {
        copse_objects::Bucket::open(&copse_objects::BucketConfig::parse(&self.url, |name| std::env::var(name).ok())?)
    }
}

/// A team's snapshot in an object store, and the data dir it goes to or
/// comes from.
#[derive(clap::Args)]
struct StoredSnapshot {
    id: String,
    #[arg(long, default_value = copse_gateway::model::DEFAULT_TEAM)]
    team: String,
    #[command(flatten)]
    store: ObjectStoreArg,
    #[command(flatten)]
    paths: Paths,
}

#[derive(Subcommand)]
enum NodeCommand {
    /// Each node: heard from lately or lost, free memory, its sandboxes.
    Ls {
        #[arg(long, env = "COPSE_DATABASE")]
        database: String,
    },
    /// Place no new sandbox on node ID (its sandboxes keep running, unless
    /// --move-sandboxes).
    Drain {
        id: String,
        #[arg(long, env = "COPSE_DATABASE")]
        database: String,
        /// Also pause its sandboxes (with their memory where it can be
        /// checkpointed) into the object store, each to resume on whichever
        /// node takes it at its next connect. Sandboxes with volumes stay.
        #[arg(long)]
        move_sandboxes: bool,
    },
    /// Let node ID take new sandboxes again.
    Undrain {
        id: String,
        #[arg(long, env = "COPSE_DATABASE")]
        database: String,
    },
    /// Forget node ID: lost (stopped for good) and holding nothing that
    /// has not moved to the object store. An API front leaves on its own
    /// when it stops.
    Rm {
        id: String,
        #[arg(long, env = "COPSE_DATABASE")]
        database: String,
    },
}

#[derive(Subcommand)]
enum SnapshotCommand {
    List {
        #[command(flatten)]
        paths: Paths,
    },
    /// Write snapshot ID to FILE ("-" for stdout).
    Export {
        id: String,
        file: PathBuf,
        /// The team whose snapshot it is.
        #[arg(long, default_value = copse_gateway::model::DEFAULT_TEAM)]
        team: String,
        #[command(flatten)]
        paths: Paths,
    },
    /// Store snapshot ID in an object store, for `pull` on any host that
    /// reaches it: content-addressed chunks (only those the bucket lacks
    /// are sent), then its manifest, snapshots/TEAM/ID.
    Push {
        #[command(flatten)]
        snapshot: StoredSnapshot,
    },
    /// Import snapshot ID from an object store (as `import` does from a
    /// file), checking every chunk against its hash.
    Pull {
        #[command(flatten)]
        snapshot: StoredSnapshot,
        /// Its name here (default: ID).
        #[arg(long)]
        name: Option<String>,
    },
    /// Remove the chunks no manifest in the object store names any more
    /// (deleted snapshots', resumed sandboxes'), once none has been
    /// written for --min-age-hours. Safe beside nodes that push meanwhile
    /// while no push takes longer than the minimum age less 12 hours.
    Gc {
        #[command(flatten)]
        store: ObjectStoreArg,
        #[arg(long, default_value_t = copse_objects::DEFAULT_MIN_AGE.as_secs() / 3600)]
        min_age_hours: u64,
        /// Count what would go; remove nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Read a snapshot from FILE ("-" for stdin), keeping its name unless --name.
    Import {
        file: PathBuf,
        #[arg(long)]
        name: Option<String>,
        /// The team the snapshot will belong to.
        #[arg(long, default_value = copse_gateway::model::DEFAULT_TEAM)]
        team: String,
        /// For the crash test only: abort at the step COPSE_FAULT names.
        #[arg(long, hide = true)]
        debug_faults: bool,
        #[command(flatten)]
        paths: Paths,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    logging::init(cli.log_format);
    match cli.command {
        Command::Up {
            listen,
            paths,
            keep_sandboxes,
            pools,
            bridge,
            subnet,
            allow_egress_ranges,
            egress_hosts_file,
            egress_upstream_ca,
            domain,
            tls_cert,
            tls_key,
            disk_mb,
            limits,
            metrics_listen,
            advertise,
            cluster_tls,
            cluster_listen,
            no_api,
            no_sandboxes,
            object_store,
            no_lazy_fetch,
            debug_faults,
            registry,
        } => {
            if debug_faults {
                copse_gateway::fault::arm_from_env()?;
            }
            let registries = registry.registries(&paths.data_dir)?;
            let config = Config {
                listen,
                data_dir: paths.data_dir,
                database_url: paths.database,
                advertise,
                cluster_tls: cluster_tls.zip(cluster_listen).map(|(dir, listen)| config::ClusterTls { dir, listen }),
                api: !no_api,
                sandboxes: !no_sandboxes,
                lazy_fetch: !no_lazy_fetch,
                object_store: object_store
                    .map(|url| copse_objects::BucketConfig::parse(&url, |name| std::env::var(name).ok()))
                    .transpose()?,
                // An API front boots nothing: it needs no agent.
                agent_binary: match no_sandboxes {
                    true => config::find_agent(paths.agent).unwrap_or_default(),
                    false => config::find_agent(paths.agent)?,
                },
                keep_sandboxes,
                pools: if no_sandboxes { Vec::new() } else { pools },
                network: Some(
                    copse_substrate::NetConfig::new(&bridge, &subnet)?
                        .with_neighbourhood(
                            copse_cubenet::Neighbourhood::of_host(&allow_egress_ranges).map_err(anyhow::Error::msg)?,
                        )
                        .with_static_hosts(egress_hosts(egress_hosts_file.as_deref())?),
                ),
                domain,
                tls: tls_cert.zip(tls_key).map(|(cert, key)| config::TlsFiles { cert, key }),
                disk_mb,
                limits: limits.limits(),
                metrics_listen,
                registries,
                egress_upstream_ca,
            };
            tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(server::run(config))
        }
        Command::Debug { command: DebugCommand::FaultPoints } => {
            for point in copse_gateway::fault::POINTS {
                println!("{point}");
            }
            Ok(())
        }
        Command::EgressCa { command: EgressCaCommand::Rotate { data_dir } } => {
            let cert = copse_cubenet::EgressCa::rotate(&config::egress_ca_dir(&data_dir))?;
            println!(
                "wrote a new egress CA ({}); restart the gateway to use it. Sandboxes running now trust the \
                 old one until their rules are set again (update_network) or they are created anew.",
                cert.display()
            );
            Ok(())
        }
        Command::Tls { command: TlsCommand::Init { domain, out, data_dir } } => {
            let out = out.unwrap_or_else(|| data_dir.join("tls").join(domain.to_ascii_lowercase()));
            let minted = copse_gateway::tls::mint::init(&domain, &out)?;
            print!("{}", copse_gateway::tls::mint::instructions(&domain, &minted));
            Ok(())
        }
        Command::Tls { command: TlsCommand::ClusterCa { out } } => {
            let cert = copse_gateway::tls::cluster::init_ca(&out)?;
            println!(
                "wrote {} and its key; sign each node's certificate with `copse tls node-cert --ca {}`",
                cert.display(),
                out.display()
            );
            Ok(())
        }
        Command::Tls { command: TlsCommand::NodeCert { ca, hosts, out } } => {
            copse_gateway::tls::cluster::issue(&ca, &hosts, &out)?;
            println!(
                "wrote {out} for {hosts}; start the node with --database … --cluster-tls {out} --cluster-listen ADDR",
                out = out.display(),
                hosts = hosts.join(", ")
            );
            Ok(())
        }
        Command::Tls { command: TlsCommand::Revoke { ca, database, certs } } => {
            let crl = copse_gateway::tls::cluster::revoke(&ca, &certs)?;
            match database {
                Some(database) => {
                    let pem = std::fs::read_to_string(&crl)?;
                    use copse_gateway::model::NodeStore;
                    copse_gateway::store::PostgresStore::open(&database)?.publish_revocations(&pem)?;
                    println!(
                        "wrote {} and published it: nodes refuse the certificates from their next heartbeat",
                        crl.display()
                    );
                }
                None => println!(
                    "wrote {crl}; copy it into each node's --cluster-tls directory as {name}: nodes read it at their next heartbeat",
                    crl = crl.display(),
                    name = copse_gateway::tls::cluster::CRL
                ),
            }
            Ok(())
        }
        Command::Template {
            command:
                TemplateCommand::Build {
                    dockerfile,
                    from_json,
                    name: Some(name),
                    tags,
                    start_cmd,
                    ready_cmd,
                    cpu_count,
                    memory_mb,
                    context,
                    api_url,
                    api_key: key,
                    paths,
                    ..
                },
        } if dockerfile.is_some() || from_json.is_some() => {
            let source = dockerfile.as_deref().or(from_json.as_deref()).expect("checked");
            let context = context
                .or_else(|| source.parent().map(std::path::Path::to_path_buf))
                .unwrap_or_else(|| PathBuf::from("."));
            let args = template_cli::BuildArgs { name, tags, start_cmd, ready_cmd, cpu_count, memory_mb, context };
            let def = template_cli::definition(dockerfile.as_deref(), from_json.as_deref(), &args)?;
            let remote = Remote { api_url, api_key: key, data_dir: paths.data_dir };
            template_cli::build(&remote.api_url, &api_key(&remote)?, def, &args)
        }
        Command::Template { command: TemplateCommand::Ls { remote } } => {
            template_cli::ls(&remote.api_url, &api_key(&remote)?)
        }
        Command::Template { command: TemplateCommand::Rm { name, remote } } => {
            template_cli::rm(&remote.api_url, &api_key(&remote)?, &name)
        }
        Command::Template { command: TemplateCommand::Tags { name, add, from, remove, remote } } => {
            template_cli::tags(&remote.api_url, &api_key(&remote)?, &name, &add, &from, &remove)
        }
        Command::Template { command: TemplateCommand::Build { names, backend, paths, name, .. } } => {
            if name.is_some() {
                anyhow::bail!("--name builds a template through the gateway: give -f DOCKERFILE or --from-json FILE");
            }
            let substrate = server::open_substrate(&local_config(paths)?)?;
            let recipes: Vec<_> = server::default_recipes()
                .into_iter()
                .filter(|r| names.is_empty() || names.contains(&r.name))
                .map(|r| copse_substrate::Recipe { backend, ..r })
                .collect();
            if let Some(unknown) = names.iter().find(|n| !recipes.iter().any(|r| &&r.name == n)) {
                anyhow::bail!("no recipe named {unknown:?}; built-in templates: {}", recipe_names());
            }
            server::ensure_templates(substrate.as_ref(), &recipes)
        }
        Command::Template { command: TemplateCommand::List { paths } } => {
            let substrate = server::open_substrate(&local_config(paths)?)?;
            for t in substrate.templates()? {
                println!("{:<24} {:<6} {:>8} MiB  built {}", t.name, t.backend, t.size_bytes >> 20, t.built_at);
            }
            Ok(())
        }
        Command::Image { command: ImageCommand::Pull { reference, name, registry, paths } } => {
            let name = name.unwrap_or_else(|| copse_gateway::images::default_name(&reference));
            let registries = registry.registries(&paths.data_dir)?;
            let config = local_config(paths)?;
            let substrate = server::open_substrate(&config)?;
            let reporter = copse_gateway::progress::Reporter::new(&format!("pulling {reference} as template {name}"));
            let result = copse_gateway::images::pull_template(
                substrate.as_ref(),
                &config.data_dir,
                &registries,
                &reference,
                &name,
                &|line| reporter.line(line),
            );
            reporter.finish();
            let (info, pulled) = result?;
            println!(
                "template {} from {} ({}): {} MiB, {} blob(s) downloaded, {} from the cache",
                info.name,
                pulled.reference,
                pulled.digest,
                info.size_bytes >> 20,
                pulled.fetched,
                pulled.cached
            );
            Ok(())
        }
        Command::Snapshot { command } => snapshot(command),
        Command::Node { command } => node(command),
        Command::Volume { command } => volume(command),
        Command::Secrets { command: SecretsCommand::RotateKey { paths } } => {
            let config = local_config(paths)?;
            let store = server::open_store(&config)?;
            let resealed = copse_gateway::vault::Vault::open(&config.data_dir)?.rotate(&*store, &*store)?;
            println!(
                "rotated the secrets key in {}: {resealed} value(s) re-sealed",
                config.data_dir.join(copse_gateway::vault::KEYRING_FILE).display()
            );
            Ok(())
        }
        Command::Keys { command } => accounts_cli::keys(command),
        Command::Teams { command } => accounts_cli::teams(command),
        Command::Ls { remote } => client::ls(&remote.api_url, &api_key(&remote)?),
        Command::Kill { id, remote } => client::kill(&remote.api_url, &api_key(&remote)?, &id),
        Command::LazyImage { dir } => copse_gateway::lazy_layers::serve(&dir),
        Command::Version => {
            println!("copse {} (envd {})", env!("CARGO_PKG_VERSION"), copse_gateway::model::ENVD_VERSION);
            Ok(())
        }
    }
}

fn node(command: NodeCommand) -> anyhow::Result<()> {
    use copse_gateway::model::{NodeStore, Store};
    use copse_gateway::store::PostgresStore;
    match command {
        NodeCommand::Ls { database } => {
            let store = PostgresStore::open(&database)?;
            let sandboxes: Vec<(Option<String>, bool)> =
                store.all()?.into_iter().map(|r| (r.node, r.paused.is_some())).collect();
            print!("{}", copse_gateway::cluster::table(&store.nodes()?, &sandboxes));
            Ok(())
        }
        NodeCommand::Drain { id, database, move_sandboxes } => {
            copse_gateway::cluster::set_draining(&PostgresStore::open(&database)?, &id, true, move_sandboxes)?;
            match move_sandboxes {
                true => println!(
                    "node {id} takes no new sandboxes and pauses its own into the object store; each resumes on another node at its next connect"
                ),
                false => println!(
                    "node {id} takes no new sandboxes; its own keep running (`copse node undrain {id}` ends this)"
                ),
            }
            Ok(())
        }
        NodeCommand::Undrain { id, database } => {
            copse_gateway::cluster::set_draining(&PostgresStore::open(&database)?, &id, false, false)?;
            println!("node {id} takes new sandboxes again");
            Ok(())
        }
        NodeCommand::Rm { id, database } => {
            copse_gateway::cluster::remove_node(&PostgresStore::open(&database)?, &id)?;
            println!("node {id} is removed");
            Ok(())
        }
    }
}

fn snapshot(command: SnapshotCommand) -> anyhow::Result<()> {
    use copse_gateway::snapshot_file;
    let open = |paths: Paths| -> anyhow::Result<_> {
        let config = local_config(paths)?;
        Ok((server::open_store(&config)?, server::open_substrate(&config)?))
    };
    match command {
        SnapshotCommand::List { paths } => {
            let (store, _) = open(paths)?;
            for s in store.snapshots()? {
                println!("{:<32} {:<24} {:>8} KiB  from {}", s.id, s.template, s.size_bytes >> 10, s.source_sandbox);
            }
            Ok(())
        }
        SnapshotCommand::Export { id, file, team, paths } => {
            let (store, substrate) = open(paths)?;
            let mut out = writer_to(&file)?;
            snapshot_file::export(&*store, substrate.as_ref(), &team, &id, &mut out)?;
            eprintln!("exported snapshot {id}");
            Ok(())
        }
        SnapshotCommand::Push { snapshot: StoredSnapshot { id, team, store: bucket, paths } } => {
            let bucket = bucket.open()?;
            let (store, substrate) = open(paths)?;
            let sent = snapshot_file::push(&*store, substrate.as_ref(), &team, &id, &bucket)?;
            println!(
                "pushed snapshot {id}: {} chunks, {} KiB, {} KiB stored; sent {} new chunks, {} KiB, {} KiB over the wire",
                sent.chunks,
                sent.bytes >> 10,
                sent.stored_bytes >> 10,
                sent.new_chunks,
                sent.new_bytes >> 10,
                sent.new_stored_bytes >> 10
            );
            Ok(())
        }
        SnapshotCommand::Pull { snapshot: StoredSnapshot { id, team, store: bucket, paths }, name } => {
            let bucket = bucket.open()?;
            let (store, substrate) = open(paths)?;
            let (record, got) = snapshot_file::pull(&*store, substrate.as_ref(), &team, &id, name, &bucket)?;
            println!(
                "pulled snapshot {} (template {}): {} chunks, {} KiB",
                record.id,
                record.template,
                got.chunks,
                got.bytes >> 10
            );
            Ok(())
        }
        SnapshotCommand::Gc { store, min_age_hours, dry_run } => {
            let min_age = std::time::Duration::from_secs(min_age_hours * 3600);
            if min_age < copse_objects::DEFAULT_MIN_AGE {
                eprintln!(
                    "warning: --min-age-hours {min_age_hours} is under {}: a push running meanwhile may lose chunks it counted on",
                    copse_objects::DEFAULT_MIN_AGE.as_secs() / 3600
                );
            }
            let report = snapshot_file::collect_garbage(&store.open()?, min_age, dry_run)?;
            println!(
                "{} manifests name {} of {} chunks; {} {} unnamed chunks ({} KiB); {} unnamed chunks are younger than {min_age_hours} h",
                report.manifests,
                report.named_chunks,
                report.chunks,
                if dry_run { "would remove" } else { "removed" },
                report.removed,
                report.removed_bytes >> 10,
                report.young_unnamed
            );
            for key in &report.not_manifests {
                println!("not a manifest (left alone): {key}");
            }
            Ok(())
        }
        SnapshotCommand::Import { file, name, team, debug_faults, paths } => {
            if debug_faults {
                copse_gateway::fault::arm_from_env()?;
            }
            let (store, substrate) = open(paths)?;
            let mut input = reader_from(&file)?;
            let record = snapshot_file::import(&*store, substrate.as_ref(), &team, &mut input, name)?;
            println!("imported snapshot {} (template {})", record.id, record.template);
            Ok(())
        }
    }
}

fn volume(command: VolumeCommand) -> anyhow::Result<()> {
    use copse_gateway::model::Store;
    let open = |paths: Paths| -> anyhow::Result<_> {
        let config = local_config(paths)?;
        Ok((server::open_store(&config)?, server::open_substrate(&config)?))
    };
    let mounting = |store: &dyn Store, id: &str| -> anyhow::Result<Vec<String>> {
        Ok(store
            .all()?
            .into_iter()
            .filter(|r| r.volume_mounts.iter().any(|m| m.volume_id == id))
            .map(|r| r.id)
            .collect())
    };
    match command {
        VolumeCommand::Ls { paths } => {
            let (store, substrate) = open(paths)?;
            for v in store.volumes()? {
                let used =
                    substrate.volume_used(&v.id).map_or_else(|_| "-".to_string(), |b| format!("{} KiB", b >> 10));
                let users = mounting(&*store, &v.id)?.join(",");
                println!("{:<20} {:<16} {:<24} {:>12}  {}", v.id, v.team, v.name, used, users);
            }
            Ok(())
        }
        VolumeCommand::Rm { volume, team, paths } => {
            let (store, substrate) = open(paths)?;
            let record = match store.volume(&volume)? {
                Some(record) => record,
                None => store
                    .volume_named(&team, &volume)?
                    .with_context(|| format!("no volume {volume:?} (by id, or by name in team {team})"))?,
            };
            let users = mounting(&*store, &record.id)?;
            anyhow::ensure!(users.is_empty(), "volume {} is mounted by sandbox {}", record.name, users.join(", "));
            substrate.delete_volume(&record.id)?;
            store.remove_volume(&record.id)?;
            println!("deleted volume {} ({}, team {})", record.id, record.name, record.team);
            Ok(())
        }
        VolumeCommand::Export { volume, team, out, paths } => {
            let (store, substrate) = open(paths)?;
            let record = match store.volume(&volume)? {
                Some(record) => record,
                None => store
                    .volume_named(&team, &volume)?
                    .with_context(|| format!("no volume {volume:?} (by id, or by name in team {team})"))?,
            };
            let users = mounting(&*store, &record.id)?;
            if !users.is_empty() {
                eprintln!(
                    "note: sandbox {} mounts {}: files written during the export are copied as they were when \
                     opened (pause or kill them for a point-in-time copy)",
                    users.join(", "),
                    record.name
                );
            }
            let mut sink = writer_to(&out)?;
            let report = copse_gateway::volume_archive::export(&*store, substrate.as_ref(), &record, &mut sink)?;
            for (path, why) in &report.skipped {
                eprintln!("skipped {path}: {why}");
            }
            for path in &report.changed {
                eprintln!("changed while read (its tail is zeros): {path}");
            }
            eprintln!(
                "exported volume {} ({}, team {}): {} files, {} directories, {} links, {} bytes; {} skipped",
                record.id,
                record.name,
                record.team,
                report.files,
                report.directories,
                report.symlinks,
                report.bytes,
                report.skipped.len()
            );
            Ok(())
        }
        VolumeCommand::Import { file, name, team, paths } => {
            let data_dir = paths.data_dir.clone();
            let (store, substrate) = open(paths)?;
            let mut input = reader_from(&file)?;
            let done =
                copse_gateway::volume_archive::import(&data_dir, &*store, substrate.as_ref(), &mut input, name, team)?;
            println!(
                "imported volume {} ({}, team {}): {} files, {} bytes",
                done.record.id, done.record.name, done.record.team, done.files, done.bytes
            );
            Ok(())
        }
    }
}

fn local_config(paths: Paths) -> anyhow::Result<Config> {
    Ok(Config {
        listen: config::DEFAULT_LISTEN.parse()?,
        data_dir: paths.data_dir,
        database_url: paths.database,
        advertise: None,
        cluster_tls: None,
        api: true,
        sandboxes: true,
        object_store: None,
        lazy_fetch: false,
        // Template and snapshot commands boot no sandbox: without an agent
        // they still work (a template can build while the agent compiles).
        agent_binary: config::find_agent(paths.agent).unwrap_or_else(|_| "copse-agent".into()),
        keep_sandboxes: true,
        pools: Vec::new(),
        network: None,
        domain: None,
        tls: None,
        disk_mb: copse_substrate::Limits::default().disk_mb,
        limits: Default::default(),
        metrics_listen: None,
        egress_upstream_ca: None,
        registries: Default::default(),
    })
}

fn recipe_names() -> String {
    server::default_recipes().into_iter().map(|r| r.name).collect::<Vec<_>>().join(", ")
}

/// The gateway keeps only hashes of its keys: without one given, the CLI
/// can use the key copse generated, if its file is still there.
fn api_key(remote: &Remote) -> anyhow::Result<String> {
    match &remote.api_key {
        Some(key) => Ok(key.clone()),
        None => copse_gateway::keys::generated_key(&remote.data_dir),
    }
}

mod client {
    //! `copse ls` and `copse kill` speak the same E2B API as the SDKs.

    use serde_json::Value;

    use crate::template_cli::http::{Api, path};

    pub fn ls(api: &str, key: &str) -> anyhow::Result<()> {
        let sandboxes = Api::new(api, key)?.json("GET", "/v2/sandboxes", None, &[200])?;
        println!("{:<22} {:<24} {:<10} ENDS AT", "SANDBOX", "TEMPLATE", "STATE");
        for s in sandboxes.as_array().into_iter().flatten() {
            let field = |k: &str| s.get(k).and_then(Value::as_str).unwrap_or("").to_string();
            println!(
                "{:<22} {:<24} {:<10} {}",
                field("sandboxID"),
                field("templateID"),
                field("state"),
                field("endAt")
            );
        }
        Ok(())
    }

    pub fn kill(api: &str, key: &str, id: &str) -> anyhow::Result<()> {
        Api::new(api, key)?.json("DELETE", &format!("/sandboxes/{}", path(id)), None, &[204])?;
        println!("killed {id}");
        Ok(())
    }
}

/// The operator's pinned names (`--egress-hosts-file`), none without one.
fn egress_hosts(path: Option<&std::path::Path>) -> anyhow::Result<Vec<(String, std::net::Ipv4Addr)>> {
    let Some(path) = path else { return Ok(Vec::new()) };
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    copse_cubenet::dns::parse_hosts(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// `path` for writing, buffered; "-" is stdout.
fn writer_to(path: &Path) -> anyhow::Result<Box<dyn std::io::Write>> {
    if path.as_os_str() == "-" {
        return Ok(Box::new(BufWriter::new(std::io::stdout().lock())));
    }
    let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    Ok(Box::new(BufWriter::new(file)))
}

/// `path` for reading, buffered; "-" is stdin.
fn reader_from(path: &Path) -> anyhow::Result<Box<dyn std::io::BufRead>> {
    if path.as_os_str() == "-" {
        return Ok(Box::new(BufReader::new(std::io::stdin().lock())));
    }
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    Ok(Box::new(BufReader::new(file)))
}
