//! Reading identity lines from the guest's serial console.
//!
//! The host writes one line per restore and nothing else, but the port is
//! also the guest's system console, so the reader stays up for the life of
//! the agent: a checkpoint freezes it mid-`read`, and every guest restored
//! from that checkpoint wakes up waiting for its own line.

use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Read};
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Duration;

use copse_identity_line::Identity;
use nix::errno::Errno;
use nix::sys::termios::{self, ControlFlags, SetArg, SpecialCharacterIndices};

use super::apply::{Effects, apply};
use crate::state::AgentState;

/// Far longer than any identity line; a longer one is noise.
const MAX_LINE: u64 = 16 * 1024;
/// Pause before reopening a console that ended or failed to open.
const RETRY: Duration = Duration::from_secs(1);

pub fn follow(path: &Path, state: &AgentState, effects: &mut dyn Effects) -> ! {
    loop {
        let ended =
            open(path).and_then(|console| read_lines(console, |line| log_outcome(handle(line, effects, state))));
        match ended {
            Ok(()) => tracing::warn!(console = %path.display(), "console closed; reopening"),
            Err(e) => tracing::warn!(console = %path.display(), "console: {e}; reopening"),
        }
        std::thread::sleep(RETRY);
    }
}

/// O_NOCTTY: the agent must not become the console's session owner, or a
/// hangup there would signal it.
pub fn open(path: &Path) -> io::Result<File> {
    let console = OpenOptions::new().read(true).custom_flags(libc::O_NOCTTY).open(path)?;
    make_raw(&console)?;
    Ok(console)
}

/// Raw input: no echo (the line carries the RNG seed, and an echo would send
/// it back to the host and to anything logging the console), no canonical
/// line limit, no signal characters; CLOCAL so carrier is never waited for.
/// Anything but a terminal (a pipe in tests) is left as it is.
pub fn make_raw(fd: impl AsFd) -> io::Result<()> {
    let mut t = match termios::tcgetattr(&fd) {
        Ok(t) => t,
        Err(Errno::ENOTTY) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    termios::cfmakeraw(&mut t);
    t.control_flags |= ControlFlags::CLOCAL | ControlFlags::CREAD;
    t.control_chars[SpecialCharacterIndices::VMIN as usize] = 1;
    t.control_chars[SpecialCharacterIndices::VTIME as usize] = 0;
    termios::tcsetattr(&fd, SetArg::TCSANOW, &t)?;
    Ok(())
}

/// Calls `on_line` with every non-blank line (trimmed, `\r\n` or `\n`)
/// until end of input; overlong lines are skipped whole.
pub fn read_lines(input: impl Read, mut on_line: impl FnMut(&str)) -> io::Result<()> {
    let mut input = BufReader::new(input);
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = (&mut input).take(MAX_LINE).read_until(b'\n', &mut line)?;
        if n == 0 {
            return Ok(());
        }
        if n as u64 == MAX_LINE && !line.ends_with(b"\n") {
            skip_line(&mut input)?;
            tracing::warn!("console: skipped a line over {MAX_LINE} bytes");
            continue;
        }
        let text = String::from_utf8_lossy(&line);
        if !text.trim().is_empty() {
            on_line(text.trim());
        }
    }
}

fn skip_line(input: &mut impl BufRead) -> io::Result<()> {
    let mut junk = Vec::new();
    loop {
        junk.clear();
        let n = input.take(MAX_LINE).read_until(b'\n', &mut junk)?;
        if n == 0 || junk.ends_with(b"\n") {
            return Ok(());
        }
    }
}

/// Parses and applies one line; returns the hostname it applied.
pub fn handle(line: &str, effects: &mut dyn Effects, state: &AgentState) -> anyhow::Result<String> {
    let identity = Identity::parse(line)?;
    apply(&identity, effects, state)?;
    Ok(identity.hostname)
}

/// The line itself is never logged: it carries the seed (and maybe a token).
fn log_outcome(outcome: anyhow::Result<String>) {
    match outcome {
        Ok(hostname) => tracing::info!(%hostname, "identity applied"),
        Err(e) => tracing::error!("identity line not applied: {e:#}"),
    }
}

#[cfg(test)]
mod tests;
