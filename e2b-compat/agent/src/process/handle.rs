//! A running process: its input side, and the fan-out of its output to every
//! attached stream. A process outlives the stream that started it; output
//! produced while nobody is attached is dropped (as envd does), output for
//! attached streams is never dropped — a slow reader slows the process.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::ChildStdin;
use tokio::sync::{mpsc, watch};

use super::pty::PtyMaster;
use super::status::EndInfo;

/// How long output pipes may stay silent after the process exited before we
/// stop waiting for them: a background grandchild (`cmd &`) can hold them
/// open forever, and the stream must still end.
const DRAIN_GRACE: Duration = Duration::from_millis(300);
/// Chunk sizes envd uses for pipes and terminals.
const PIPE_CHUNK: usize = 32 << 10;
const PTY_CHUNK: usize = 16 << 10;
/// Events buffered per attached stream before the producer waits.
const SUBSCRIBER_BUFFER: usize = 64;

#[derive(Debug, Clone)]
pub enum Output {
    Stdout(Bytes),
    Stderr(Bytes),
    Pty(Bytes),
}

#[derive(Debug, Clone)]
pub enum Event {
    Data(Output),
    End(EndInfo),
}

/// What the process was started with, reported by `List`.
#[derive(Debug, Clone, Default)]
pub struct ProcessConfig {
    pub cmd: String,
    pub args: Vec<String>,
    pub envs: HashMap<String, String>,
    pub cwd: Option<String>,
}

enum Input {
    Pipe(tokio::sync::Mutex<Option<ChildStdin>>),
    Pty(PtyMaster),
}

#[derive(Default)]
struct Fanout {
    subscribers: Vec<mpsc::Sender<Event>>,
    end: Option<EndInfo>,
}

pub struct Process {
    pub pid: u32,
    pub tag: Option<String>,
    pub config: ProcessConfig,
    input: Input,
    fanout: Mutex<Fanout>,
}

#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("stdin not enabled or closed")]
    StdinClosed,
    #[error("cannot close stdin of a terminal process — send Ctrl+D (0x04) instead")]
    IsTerminal,
    #[error("tty not assigned to process")]
    NoTerminal,
    #[error("error writing input to process: {0}")]
    Io(#[from] std::io::Error),
}

impl Process {
    pub fn with_pipe(pid: u32, tag: Option<String>, config: ProcessConfig, stdin: Option<ChildStdin>) -> Self {
        Self::new(pid, tag, config, Input::Pipe(tokio::sync::Mutex::new(stdin)))
    }

    pub fn with_pty(pid: u32, tag: Option<String>, config: ProcessConfig, master: PtyMaster) -> Self {
        Self::new(pid, tag, config, Input::Pty(master))
    }

    fn new(pid: u32, tag: Option<String>, config: ProcessConfig, input: Input) -> Self {
        Self { pid, tag, config, input, fanout: Mutex::new(Fanout::default()) }
    }

    fn fanout(&self) -> std::sync::MutexGuard<'_, Fanout> {
        self.fanout.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Attaches a new stream: it receives output from now on, then the end.
    pub fn subscribe(&self) -> mpsc::Receiver<Event> {
        let (tx, rx) = mpsc::channel(SUBSCRIBER_BUFFER);
        let mut f = self.fanout();
        match &f.end {
            // Already over: the stream gets just the end event.
            Some(end) => {
                let _ = tx.try_send(Event::End(end.clone()));
            }
            None => f.subscribers.push(tx),
        }
        rx
    }

    /// Delivers output to every attached stream, waiting for slow ones.
    async fn publish(&self, output: Output) {
        let subscribers = self.fanout().subscribers.clone();
        let mut gone = Vec::new();
        for s in subscribers {
            if s.send(Event::Data(output.clone())).await.is_err() {
                gone.push(s);
            }
        }
        if !gone.is_empty() {
            self.fanout().subscribers.retain(|s| !gone.iter().any(|g| g.same_channel(s)));
        }
    }

    /// Records the end and hands it to every attached stream.
    pub async fn finish(&self, end: EndInfo) {
        let subscribers = {
            let mut f = self.fanout();
            f.end = Some(end.clone());
            std::mem::take(&mut f.subscribers)
        };
        for s in subscribers {
            let _ = s.send(Event::End(end.clone())).await;
        }
    }

    pub fn has_pty(&self) -> bool {
        matches!(self.input, Input::Pty(_))
    }

    pub async fn write_stdin(&self, data: &[u8]) -> Result<(), InputError> {
        match &self.input {
            Input::Pty(m) => Ok(m.write_all(data).await?),
            Input::Pipe(stdin) => {
                let mut guard = stdin.lock().await;
                let pipe = guard.as_mut().ok_or(InputError::StdinClosed)?;
                pipe.write_all(data).await?;
                pipe.flush().await?;
                Ok(())
            }
        }
    }

    pub async fn write_pty(&self, data: &[u8]) -> Result<(), InputError> {
        match &self.input {
            Input::Pty(m) => Ok(m.write_all(data).await?),
            Input::Pipe(_) => Err(InputError::NoTerminal),
        }
    }

    /// Closes stdin so the process reads EOF; closing twice is fine.
    pub async fn close_stdin(&self) -> Result<(), InputError> {
        match &self.input {
            Input::Pty(_) => Err(InputError::IsTerminal),
            Input::Pipe(stdin) => {
                if let Some(mut pipe) = stdin.lock().await.take() {
                    let _ = pipe.shutdown().await;
                }
                Ok(())
            }
        }
    }

    pub fn resize(&self, cols: u16, rows: u16) -> Result<(), InputError> {
        match &self.input {
            Input::Pty(m) => Ok(m.resize(cols, rows)?),
            Input::Pipe(_) => Err(InputError::NoTerminal),
        }
    }

    /// Forwards one output pipe until EOF, or until it has been silent for
    /// [`DRAIN_GRACE`] after the process exited.
    pub async fn pump_pipe<R: AsyncRead + Unpin>(
        &self,
        mut reader: R,
        wrap: fn(Bytes) -> Output,
        exited: watch::Receiver<bool>,
    ) {
        let mut buf = vec![0u8; PIPE_CHUNK];
        loop {
            match read_until_drained(reader.read(&mut buf), exited.clone()).await {
                Some(Ok(n)) if n > 0 => self.publish(wrap(Bytes::copy_from_slice(&buf[..n]))).await,
                _ => return,
            }
        }
    }

    /// Same as [`Self::pump_pipe`] for the terminal of a pty process.
    pub async fn pump_pty(&self, exited: watch::Receiver<bool>) {
        let Input::Pty(master) = &self.input else { return };
        let mut buf = vec![0u8; PTY_CHUNK];
        loop {
            match read_until_drained(master.read(&mut buf), exited.clone()).await {
                Some(Ok(n)) if n > 0 => self.publish(Output::Pty(Bytes::copy_from_slice(&buf[..n]))).await,
                _ => return,
            }
        }
    }
}

/// Runs one read; once the process has exited the read gets only
/// [`DRAIN_GRACE`] to produce something. `None` means "stop reading".
async fn read_until_drained<F, T>(read: F, mut exited: watch::Receiver<bool>) -> Option<T>
where
    F: std::future::Future<Output = T>,
{
    tokio::pin!(read);
    if !*exited.borrow() {
        tokio::select! {
            r = &mut read => return Some(r),
            // Exited (or the supervisor is gone): fall through to the grace.
            _ = exited.wait_for(|e| *e) => {}
        }
    }
    tokio::time::timeout(DRAIN_GRACE, read).await.ok()
}
