//! Carrying out an identity's steps. The effects that need root and would
//! change the machine (RNG, hostname, files under `/etc`, the NIC) go
//! through [`Effects`], so tests apply lines to a recording double.

use std::io::{self, Write};
use std::path::Path;
use std::process::Command;

use anyhow::Context;
use copse_identity_line::{GuestNet, GuestStep, Identity};

use crate::state::AgentState;

pub trait Effects {
    /// Mix `seed` into the kernel RNG.
    fn reseed(&mut self, seed: &[u8]) -> io::Result<()>;
    fn set_hostname(&mut self, name: &str) -> io::Result<()>;
    fn write_file(&mut self, path: &Path, contents: &str) -> io::Result<()>;
    fn set_network(&mut self, net: &GuestNet) -> io::Result<()>;
}

/// Steps in [`Identity::steps`] order; stops at the first failure, which
/// leaves the guest off its new address (see `copse-identity-line`).
pub fn apply(identity: &Identity, effects: &mut dyn Effects, state: &AgentState) -> anyhow::Result<()> {
    for step in identity.steps() {
        match &step {
            GuestStep::ReseedRng(seed) => effects.reseed(seed).context("reseeding the RNG"),
            GuestStep::SetHostname(name) => effects.set_hostname(name).context("setting the hostname"),
            GuestStep::WriteFile { path, contents } => {
                effects.write_file(Path::new(path), contents).with_context(|| format!("writing {path}"))
            }
            GuestStep::RotateAgentToken(token) => {
                state.update_settings(|s| s.access_token = Some(token.clone()));
                Ok(())
            }
            GuestStep::SetNetwork(net) => effects.set_network(net).context("moving the NIC"),
        }?;
    }
    Ok(())
}

/// The real effects, for the guest's own kernel.
pub struct System {
    pub nic: String,
}

impl Effects for System {
    fn reseed(&mut self, seed: &[u8]) -> io::Result<()> {
        // random(4) and random(7): a write to /dev/random is mixed into the
        // pool (it does not credit entropy, which a restored pool has).
        std::fs::OpenOptions::new().write(true).open("/dev/random")?.write_all(seed)
    }

    fn set_hostname(&mut self, name: &str) -> io::Result<()> {
        nix::unistd::sethostname(name).map_err(io::Error::from)
    }

    fn write_file(&mut self, path: &Path, contents: &str) -> io::Result<()> {
        // Through a rename, so a reader never sees half an id.
        let tmp = path.with_extension("copse-new");
        std::fs::write(&tmp, contents)?;
        std::fs::rename(&tmp, path)
    }

    fn set_network(&mut self, net: &GuestNet) -> io::Result<()> {
        for cmd in super::net::commands(&self.nic, net) {
            let status = Command::new(&cmd.argv[0]).args(&cmd.argv[1..]).status()?;
            if !status.success() && !cmd.may_fail {
                return Err(io::Error::other(format!("`{}` failed: {status}", cmd.argv.join(" "))));
            }
        }
        Ok(())
    }
}
