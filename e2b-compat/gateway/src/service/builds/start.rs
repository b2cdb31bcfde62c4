//! What a sandbox of a built template gets once it is handed over: the
//! template's default user, then its start command (in the background, as
//! that user, in its working directory) and the wait for its ready
//! command, so `Sandbox.create` returns a sandbox whose server answers.

use std::time::{Duration, Instant};

use super::Sandboxes;
use super::run::Agent;
use crate::agent_link;
use crate::model::{Image, SandboxRecord, TemplateRecord};

/// How long a create waits for the ready command to succeed.
const READY_TIMEOUT: Duration = Duration::from_secs(120);
const READY_EVERY: Duration = Duration::from_millis(100);

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
    /// commands (not in a build's own sandbox).
    pub(in crate::service) async fn start_template(
        &self,
        record: &SandboxRecord,
        image: &Image,
        start: bool,
    ) -> anyhow::Result<()> {
        if let Some(user) = &image.user {
            let init = serde_json::json!({ "defaultUser": user });
            agent_link::post_json(&record.agent_socket, "/init", &init, Some(&record.access_token)).await?;
        }
        let Some(command) = image.start_cmd.as_deref().filter(|_| start) else { return Ok(()) };
        let agent = Agent { socket: &record.agent_socket, token: &record.access_token };
        let user = image.user.as_deref().unwrap_or("user");
        let workdir = image.workdir.as_deref();
        // Dropping the stream once the process started leaves it running.
        let mut stream = agent.start(command, user, workdir).await.map_err(anyhow::Error::msg)?;
        stream.next().await.map_err(|e| anyhow::anyhow!("the start command did not start: {e}"))?;
        drop(stream);
        let Some(ready) = image.ready_cmd.as_deref() else { return Ok(()) };
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            match agent.shell(ready, user, workdir, None).await {
                Ok(()) => return Ok(()),
                Err(why) if Instant::now() > deadline => {
                    anyhow::bail!("the ready command did not succeed within {READY_TIMEOUT:?}: {why}")
                }
                Err(_) => tokio::time::sleep(READY_EVERY).await,
            }
        }
    }
}
