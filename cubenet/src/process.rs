//! Running the host's network tools (both backends' executors).

use std::io::Write;
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

/// Runs `command` with `input` on its stdin and returns its stdout; fails
/// on a non-zero exit with its stderr. The tools this runs read all of
/// their input before they print anything sizeable, so writing it first
/// cannot stall on a full stdout pipe.
pub fn run(command: &mut Command, input: Option<&str>) -> anyhow::Result<String> {
    let stdin = if input.is_some() { Stdio::piped() } else { Stdio::null() };
    let mut child = command.stdin(stdin).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().context("spawning")?;
    if let Some(input) = input {
        // Dropped at the end of the statement, which closes the pipe.
        child.stdin.take().expect("piped").write_all(input.as_bytes())?;
    }
    let output = child.wait_with_output()?;
    if !output.status.success() {
        bail!("{}: {}", output.status, String::from_utf8_lossy(&output.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}
