//! What a sandbox of a built template gets once it is handed over: the
//! template's default user and working directory, then its start command
//! (in the background, as that user, in its working directory) and the
//! wait for its ready command — either once, at the end of its build, when
//! the image keeps the running process in a memory snapshot, or at each
//! create, when it does not — so `Sandbox.create` returns a sandbox whose
//! server answers either way.

use std::time::{Duration, Instant};

use copse_protocol::ProcessEvent;

use super::Sandboxes;
use super::run::Agent;
use crate::agent_link;
use crate::model::{Image, SandboxRecord, TemplateRecord};

/// How long a create waits for the ready command to succeed.
const READY_TIMEOUT: Duration = Duration::from_secs(120);
const READY_EVERY: Duration = Duration::from_millis(100);

/// How the start command runs: as whom, where, and how long its ready
/// command may take to succeed.
pub(super) struct Launch<'a> {
    pub command: &'a str,
    pub ready: Option<&'a str>,
    pub user: &'a str,
    pub workdir: Option<&'a str>,
    pub timeout: Duration,
}

impl Sandboxes {
    /// The built template `name` (maybe `name:tag`, or another team's
    /// public one by id), if it has an image to boot.
    pub(in crate::service) fn ready_template(
        &self,
        team: &str,
        name: &str,
    ) -> crate::model::Result<Option<TemplateRecord>> {
        self.creatable_template(team, name)
    }

    /// Runs after the hand-over; `start`: also the start and ready
    /// commands (not in a build's own sandbox, nor where the image's
    /// memory already holds them running).
    pub(in crate::service) async fn start_template(
        &self,
        record: &SandboxRecord,
        image: &Image,
        start: bool,
    ) -> anyhow::Result<()> {
        // envd's `/init` fields: a command run with no cwd starts in the
        // template's WORKDIR, as in E2B.
        let mut init = serde_json::Map::new();
        if let Some(user) = &image.user {
            init.insert("defaultUser".into(), user.as_str().into());
        }
        if let Some(workdir) = &image.workdir {
            init.insert("defaultWorkdir".into(), workdir.as_str().into());
        }
        if !init.is_empty() {
            let init = serde_json::Value::Object(init);
            agent_link::post_json(&record.agent_socket, "/init", &init, Some(&record.access_token)).await?;
        }
        let Some(command) = image.start_cmd.as_deref().filter(|_| start && !image.memory) else { return Ok(()) };
        let agent = Agent { socket: &record.agent_socket, token: &record.access_token };
        let launch = Launch {
            command,
            ready: image.ready_cmd.as_deref(),
            user: image.user.as_deref().unwrap_or("user"),
            workdir: image.workdir.as_deref(),
            timeout: READY_TIMEOUT,
        };
        launch.run(&agent).await.map_err(anyhow::Error::msg)
    }
}

impl Launch<'_> {
    /// Starts the command in the background and waits until the ready
    /// command succeeds, for at most `timeout` in all: a ready command that
    /// never exits is abandoned like one that keeps failing. The error
    /// carries the last attempt's output.
    pub async fn run(&self, agent: &Agent<'_>) -> Result<(), String> {
        let deadline = Instant::now() + self.timeout;
        let mut stream = agent.start(self.command, self.user, self.workdir).await?;
        match stream.next().await {
            Ok(Some(ProcessEvent::End { exit_code, error })) => {
                let why = error.map(|e| format!(" ({e})")).unwrap_or_default();
                return Err(format!("the start command ended at once with exit code {exit_code}{why}"));
            }
            Ok(Some(_)) => {}
            Ok(None) => return Err("the start command did not start".into()),
            Err(e) => return Err(format!("the start command did not start: {e}")),
        }
        // Dropping the stream once the process started leaves it running.
        drop(stream);
        let Some(ready) = self.ready else { return Ok(()) };
        // The last attempt that ended: one the deadline cut short says less.
        let mut failed = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, agent.shell(ready, self.user, self.workdir, None)).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(why)) => failed = Some(why),
                Err(_) => {}
            }
            if Instant::now() >= deadline {
                let why = failed.unwrap_or_else(|| "it never exited".into());
                return Err(format!("the ready command did not succeed within {:?}: {why}", self.timeout));
            }
            tokio::time::sleep(READY_EVERY).await;
        }
    }
}
