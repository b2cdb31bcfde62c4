//! `copse-agent serve --socket PATH` runs the agent on the host (tests,
//! development); `copse-agent boot` is how a sandbox starts it;
//! `copse-agent guest` is how a bhyve guest's rc.d starts it.

use std::net::SocketAddr;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use copse_agent::AgentConfig;
use copse_agent::guest::GuestOptions;

#[derive(Parser)]
#[command(name = "copse-agent", about = "envd-compatible agent for copse sandboxes")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve on a unix socket (binds it, replacing a stale socket file).
    Serve {
        #[arg(long)]
        socket: PathBuf,
        #[command(flatten)]
        agent: AgentArgs,
    },
    /// Inside a bhyve guest: serve on TCP and apply the identity lines the
    /// host writes to the serial console after each restore.
    Guest {
        #[arg(long, default_value = "0.0.0.0:49983")]
        listen: SocketAddr,
        /// bhyve's `-l com1,…` is uart0, `/dev/ttyu0`, in a FreeBSD guest.
        #[arg(long, default_value = "/dev/ttyu0")]
        console: PathBuf,
        /// The NIC that takes the identity's MAC and address.
        #[arg(long, default_value = copse_agent::guest::net::DEFAULT_NIC)]
        nic: String,
        #[command(flatten)]
        agent: AgentArgs,
    },
    /// Inside a new sandbox: set it up and serve on the socket handed over
    /// by the substrate.
    Boot {
        /// The sandbox's init, re-executed from inside the sandbox.
        #[arg(long, hide = true)]
        init: bool,
    },
    /// CRIU's action script when the substrate restores a sandbox (the
    /// host side; CRIU runs it as host root).
    #[command(hide = true)]
    CriuAction,
}

/// Settings shared by the modes that start the agent themselves.
#[derive(Args)]
struct AgentArgs {
    #[arg(long, env = "COPSE_AGENT_ACCESS_TOKEN")]
    access_token: Option<String>,
    /// User for requests that name none.
    #[arg(long, default_value = "user")]
    default_user: String,
    /// Directory holding passwd and group.
    #[arg(long, default_value = "/etc")]
    etc_dir: PathBuf,
    /// Start processes without seccomp/capability confinement.
    #[arg(long)]
    no_confine: bool,
}

impl AgentArgs {
    fn config(self) -> AgentConfig {
        let Self { access_token, default_user, etc_dir, no_confine } = self;
        AgentConfig { access_token, default_user, etc_dir, confine: !no_confine, ..AgentConfig::default() }
    }
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Serve { socket, agent } => {
            let _ = std::fs::remove_file(&socket);
            let listener = UnixListener::bind(&socket)?;
            copse_agent::serve_blocking(listener, agent.config())
        }
        Command::Guest { listen, console, nic, agent } => {
            copse_agent::guest::run(GuestOptions { listen, console, nic }, agent.config())
        }
        Command::Boot { init } => boot(init),
        Command::CriuAction => copse_jailer::criu_action(),
    }
}

/// The substrate sets the sandbox up and hands over the agent's socket.
fn boot(init: bool) -> anyhow::Result<()> {
    let config = AgentConfig {
        loopback_port: Some(copse_protocol::headers::AGENT_PORT),
        kernels: true,
        ..AgentConfig::default()
    };
    let serve = |listener| copse_agent::serve_blocking(listener, config);
    if init { copse_jailer::init_agent(serve) } else { copse_jailer::boot_agent(serve) }
}
