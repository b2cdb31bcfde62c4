//! `copse-agent guest`: the agent inside a bhyve guest. The same API as on
//! a unix socket, but on TCP (the host relays the gateway's socket to the
//! guest's address, `bhyve/src/relay.rs`), plus a thread that applies the
//! identity lines the host writes to the guest's serial console after each
//! restore (`copse-identity-line`).

pub mod apply;
pub mod console;
pub mod net;

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;

use crate::AgentConfig;

/// What `copse-agent guest` needs besides the agent's own settings.
#[derive(Debug, Clone)]
pub struct GuestOptions {
    pub listen: SocketAddr,
    /// The serial port the host writes to (bhyve's `-l com1,…`: `/dev/ttyu0`
    /// in a FreeBSD guest).
    pub console: PathBuf,
    /// The NIC whose MAC and address the identity replaces.
    pub nic: String,
}

/// Serves until the process dies. The console thread starts once the
/// agent's state exists, so a line is never applied to settings that
/// `/init` does not see.
pub fn run(options: GuestOptions, config: AgentConfig) -> anyhow::Result<()> {
    let listener = TcpListener::bind(options.listen)?;
    crate::serve_blocking_with(listener, config, move |state| {
        let GuestOptions { console, nic, .. } = options;
        std::thread::spawn(move || console::follow(&console, &state, &mut apply::System { nic }));
    })
}
