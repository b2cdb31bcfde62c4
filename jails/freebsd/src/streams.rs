//! Host commands wired to each other or to the caller's streams: `zfs send
//! | zfs recv` without a shell, a snapshot export into a writer, an import
//! from a reader. Plain `std::process`, nothing FreeBSD-specific, so the
//! tests below run on Linux as well.
//!
//! Each command is passed with the line that names it in errors.

use std::io::{Read, Write};
use std::process::{Child, ChildStderr, Command, Stdio};
use std::thread::JoinHandle;

use anyhow::{Context, bail};

pub type Named<'a> = (&'a mut Command, &'a str);

/// Reads a child's stderr to the end on a thread, so a full pipe can
/// never stall it while we are busy with its stdin or stdout.
fn drain(pipe: Option<ChildStderr>) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_string(&mut s);
        }
        s
    })
}

fn finish(name: &str, child: &mut Child, stderr: JoinHandle<String>) -> anyhow::Result<()> {
    let status = child.wait()?;
    let stderr = stderr.join().unwrap_or_default();
    if !status.success() {
        bail!("`{name}` failed ({status}): {}", stderr.trim());
    }
    Ok(())
}

/// `from | to`; fails if either fails, with that one's stderr.
pub fn pipe((from, from_name): Named<'_>, (to, to_name): Named<'_>) -> anyhow::Result<()> {
    let mut producer = from
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawn `{from_name}`"))?;
    let producer_err = drain(producer.stderr.take());
    let stdout = producer.stdout.take().expect("stdout is piped");
    let mut consumer = match to.stdin(Stdio::from(stdout)).stdout(Stdio::null()).stderr(Stdio::piped()).spawn() {
        Ok(c) => c,
        Err(e) => {
            let _ = producer.kill();
            let _ = producer.wait();
            return Err(e).with_context(|| format!("spawn `{to_name}`"));
        }
    };
    // `to` still holds the pipe's read end; while it is open a sender
    // whose receiver died blocks on a full pipe instead of getting EPIPE.
    to.stdin(Stdio::null());
    let consumer_err = drain(consumer.stderr.take());
    // The consumer's verdict first: if it failed, the producer dies of
    // SIGPIPE and its error would only hide the cause.
    let received = finish(to_name, &mut consumer, consumer_err);
    let sent = finish(from_name, &mut producer, producer_err);
    received.and(sent)
}

/// Runs the command with its stdout copied into `out`.
pub fn run_into((cmd, name): Named<'_>, out: &mut dyn Write) -> anyhow::Result<()> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawn `{name}`"))?;
    let stderr = drain(child.stderr.take());
    let copied = std::io::copy(&mut child.stdout.take().expect("stdout is piped"), out);
    if copied.is_err() {
        // Nobody reads the rest: stop the tool rather than wait for it.
        let _ = child.kill();
    }
    let finished = finish(name, &mut child, stderr);
    copied.with_context(|| format!("copying the output of `{name}`"))?;
    finished
}

/// Runs the command with `input` as its stdin.
pub fn run_from((cmd, name): Named<'_>, input: &mut dyn Read) -> anyhow::Result<()> {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawn `{name}`"))?;
    let stderr = drain(child.stderr.take());
    let mut stdin = child.stdin.take().expect("stdin is piped");
    let copied = std::io::copy(input, &mut stdin);
    // EOF tells the tool the stream is complete.
    drop(stdin);
    // A tool that quit early breaks the pipe; its own error says why.
    finish(name, &mut child, stderr)?;
    copied.with_context(|| format!("feeding `{name}`"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Command {
        let mut c = Command::new("/bin/sh");
        c.args(["-c", script]);
        c
    }

    #[test]
    fn a_pipe_carries_the_whole_stream() {
        let from = &mut sh("head -c 3000000 /dev/zero");
        let to = &mut sh("test \"$(wc -c)\" -eq 3000000");
        pipe((from, "send"), (to, "recv")).unwrap();
    }

    #[test]
    fn a_failing_receiver_is_reported_with_its_own_words() {
        let from = &mut sh("head -c 3000000 /dev/zero");
        let to = &mut sh("head -c 10 >/dev/null; echo 'bad stream' >&2; exit 3");
        let err = format!("{:#}", pipe((from, "send"), (to, "recv")).unwrap_err());
        assert!(err.contains("`recv` failed") && err.contains("bad stream"), "{err}");
    }

    #[test]
    fn a_failing_sender_fails_the_pipe() {
        let from = &mut sh("echo 'no such snapshot' >&2; exit 1");
        let to = &mut sh("cat >/dev/null");
        let err = format!("{:#}", pipe((from, "send"), (to, "recv")).unwrap_err());
        assert!(err.contains("`send` failed") && err.contains("no such snapshot"), "{err}");
    }

    #[test]
    fn output_is_copied_into_the_writer() {
        let mut out = Vec::new();
        run_into((&mut sh("head -c 2000000 /dev/zero; echo end >&2"), "send"), &mut out).unwrap();
        assert_eq!(out.len(), 2_000_000);
        let err = run_into((&mut sh("printf partial; exit 4"), "send"), &mut Vec::new()).unwrap_err();
        assert!(format!("{err:#}").contains("`send` failed"));
    }

    #[test]
    fn input_is_fed_to_the_end_and_an_early_quit_names_the_tool() {
        let mut input: &[u8] = &[7; 1_000_000];
        run_from((&mut sh("test \"$(wc -c)\" -eq 1000000"), "recv"), &mut input).unwrap();
        let mut input: &[u8] = &[7; 1_000_000];
        let err = run_from((&mut sh("echo 'invalid stream' >&2; exit 2"), "recv"), &mut input).unwrap_err();
        let err = format!("{err:#}");
        assert!(err.contains("`recv` failed") && err.contains("invalid stream"), "{err}");
    }
}
