//! Running a build: a real sandbox of the base, created as the caller's
//! like any other, each step executed in it through its agent (as the
//! step's user, in the build's working directory, with the build's
//! environment), every line of output appended to the build's log as it
//! comes, then a snapshot of the result: the template's image. After each
//! step the files are snapshotted into the build layer cache (`cache.rs`);
//! a rebuild starts on the deepest cached layer and logs the steps it
//! skipped as `CACHED`. A template with a start command, where the
//! substrate keeps memory, is snapshotted with the command started and
//! ready, so its sandboxes are restored with it running. A failing step (or
//! a ready command that never succeeds) ends the build in `error`, naming
//! the step and its last output lines. The build sandbox is removed however
//! the build ends.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use axum::body::Body;
use copse_protocol::client::AGENT_HOST;
use copse_protocol::headers::ACCESS_TOKEN;
use copse_protocol::{ProcessEvent, ProcessStream, StartProcess};
use copse_substrate::Support;
use hyper::Request;
use hyper::header::HeaderValue;

use super::cache;
use super::start::Launch;
use super::steps::{self, Step};
use super::{Base, Sandboxes};
use crate::agent_link;
use crate::model::{
    BuildFailure, BuildLayer, BuildLine, BuildStatus, Caller, Image, OciBase, SandboxRecord, TemplateRecord, now_ms,
    snapshot_key,
};
use crate::service::CreateRequest;
use crate::telemetry::KillReason;

/// A build sandbox lives at most this long (a gateway that dies mid-build
/// leaves it to expiry).
const BUILD_SANDBOX_TIMEOUT_S: i64 = 3600;
/// How many of a failing step's last output lines its error carries.
const FAILURE_TAIL_LINES: usize = 20;
/// The log is written to the store at most this often while a step runs.
const FLUSH_EVERY: Duration = Duration::from_millis(200);
/// How long a build waits for its ready command to succeed (each attempt
/// included: one that never exits fails the build too).
const BUILD_READY_TIMEOUT: Duration = Duration::from_secs(60);
/// The account build steps run as unless a step or `USER` says otherwise
/// (E2B's default user).
const DEFAULT_USER: &str = "user";

pub(super) struct Job {
    pub caller: Caller,
    pub record: TemplateRecord,
    pub base: Base,
    pub base_note: String,
    pub steps: Vec<Step>,
    /// The first step the cache may not serve (`skip_cache`): it and every
    /// step after it run.
    pub forced_from: usize,
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
}

/// Why a build stopped early: a step failed, or something around it did.
pub(super) struct Failed {
    pub message: String,
    pub step: Option<String>,
}

/// The build's log, kept in the template record and written to the store
/// in batches, so the SDK's polling sees lines while a step runs.
pub(super) struct Console<'a> {
    svc: &'a Sandboxes,
    record: TemplateRecord,
    flushed: Instant,
    /// The template was deleted meanwhile: stop building.
    gone: bool,
}

impl Console<'_> {
    pub(super) fn line(&mut self, level: &str, step: Option<&str>, message: impl Into<String>) {
        let line =
            BuildLine { at_ms: now_ms(), level: level.into(), message: message.into(), step: step.map(Into::into) };
        self.record.build.push(line);
        if self.flushed.elapsed() >= FLUSH_EVERY {
            self.flush();
        }
    }

    fn flush(&mut self) {
        self.flushed = Instant::now();
        // Another build of the name, or a delete, replaced this one.
        match self.svc.store.template(&self.record.id) {
            Ok(Some(current)) if current.build.id == self.record.build.id => {}
            Ok(_) => {
                self.gone = true;
                return;
            }
            Err(e) => tracing::warn!("reading template {}: {e:#}", self.record.id),
        }
        if let Err(e) = self.svc.store.put_template(&self.record) {
            tracing::warn!("writing the log of template {}: {e:#}", self.record.id);
        }
    }
}

/// The build's state as steps change it.
/// What a template runs at start, and how its build knows it is ready.
struct StartCommands {
    start: Option<String>,
    ready: Option<String>,
}

struct State {
    user: String,
    workdir: Option<String>,
    envs: Vec<(String, String)>,
}

impl Sandboxes {
    pub(super) async fn run_build(&self, job: Job) {
        let Job { caller, record, base, base_note, steps, forced_from, start_cmd, ready_cmd } = job;
        let mut console = Console { svc: self, record, flushed: Instant::now(), gone: false };
        console.line("info", Some("base"), format!("Building {} {base_note}", console.record.name));
        let mut opened = match self.open_base(&base, &mut console).await {
            Ok(opened) => opened,
            Err(failed) => return record_failure(&mut console, failed),
        };
        let oci = opened.oci.take();
        let keys = chain_keys(&caller.team, &self.base_identity(&base, &opened.template).await, &steps);
        let cached = self.cached_layers(&caller.team, &keys[..forced_from], &console.record.id).await;
        // A cached layer carries the settings its steps left.
        let mut state = match cached.last().map(cache::as_image) {
            Some(layer) => State {
                user: layer.user.unwrap_or_else(|| DEFAULT_USER.into()),
                workdir: layer.workdir,
                envs: layer.envs,
            },
            None => State {
                user: opened.user.unwrap_or_else(|| DEFAULT_USER.into()),
                workdir: opened.workdir,
                envs: opened.envs,
            },
        };
        let total = steps.len();
        for (index, step) in steps.iter().take(cached.len()).enumerate() {
            let number = (index + 1).to_string();
            console.line("info", Some(&number), format!("CACHED [{number}/{total}] {}", describe(step)));
        }
        if forced_from < total {
            console.line("info", Some("base"), format!("skip_cache: step {} and after run again", forced_from + 1));
        }
        let request = CreateRequest {
            template: opened.template,
            timeout_s: Some(BUILD_SANDBOX_TIMEOUT_S),
            metadata: HashMap::from([("copse.build".to_string(), console.record.build.id.clone())]),
            env_vars: state.envs.iter().cloned().collect(),
            for_build: true,
            build_layer: cached.last().map(cache::as_image),
            ..Default::default()
        };
        let outcome = match self.create(&caller, request).await {
            Ok((sandbox, _)) => {
                console.line("info", Some("base"), format!("Build sandbox {} is up", sandbox.id));
                if cached.is_empty()
                    && let Some(wanted) = &opened.image_user
                    && let Some(user) = self.settle_image_user(&sandbox, wanted, &mut console).await
                {
                    state.user = user;
                }
                let plan = Plan { steps: &steps, keys: &keys, first: cached.len(), team: &caller.team };
                let outcome = self.run_steps(&sandbox, plan, &mut state, &mut console).await;
                let outcome = match outcome {
                    Ok(()) => {
                        let start = StartCommands { start: start_cmd, ready: ready_cmd };
                        self.finalize(&sandbox, state, start, &base, oci, &mut console).await
                    }
                    Err(failed) => Err(failed),
                };
                if let Err(e) = self.end(&sandbox.id, KillReason::Request).await {
                    tracing::warn!(sandbox = %sandbox.id, "removing the build sandbox: {e}");
                }
                outcome
            }
            Err(e) => Err(Failed { message: format!("creating the build sandbox: {e}"), step: Some("base".into()) }),
        };
        match outcome {
            Ok(image) => {
                let old = console.record.image.replace(image);
                console.record.build.status = BuildStatus::Ready;
                console.line("info", Some("finalize"), "Build finished: template is ready");
                console.flush();
                if console.gone {
                    self.drop_image(console.record.image.take()).await;
                    self.collect_after_delete(&console.record).await;
                } else {
                    self.settle_replaced_image(&console.record, old).await;
                    // Into the cluster's object store, for the other nodes.
                    self.upload_soon();
                }
            }
            Err(failed) => {
                record_failure(&mut console, failed);
                if console.gone {
                    self.collect_after_delete(&console.record).await;
                }
            }
        }
    }

    /// A template deleted during its build: the layers the build recorded
    /// after the delete are collected too.
    async fn collect_after_delete(&self, record: &TemplateRecord) {
        // Gone can also mean another build of the same template replaced
        // this one: its layers are the template's still.
        if !matches!(self.store.template(&record.id), Ok(None)) {
            return;
        }
        if let Err(e) = self.collect_layers(&record.team, &record.id).await {
            tracing::warn!("collecting the build layers of deleted template {}: {e:#}", record.id);
        }
    }

    /// Snapshots the build sandbox's files after a step into the cache. A
    /// failure costs only a later cache hit, so it is logged, not fatal.
    async fn cache_step(
        &self,
        sandbox: &SandboxRecord,
        key: &str,
        team: &str,
        state: &State,
        console: &mut Console<'_>,
    ) {
        let snapshot = snapshot_key();
        let layer = match self.take_snapshot(sandbox, &snapshot, false).await {
            Ok(info) => BuildLayer {
                key: key.to_string(),
                team: team.to_string(),
                substrate_template: info.template,
                snapshot_key: snapshot,
                envs: state.envs.clone(),
                user: state.user.clone(),
                workdir: state.workdir.clone(),
                templates: vec![console.record.id.clone()],
                created_at_ms: 0,
                node: self.node().map(str::to_string),
                in_object_store: false,
            },
            Err(e) => {
                console.line("warn", None, format!("caching the step's files failed: {e}"));
                return;
            }
        };
        if let Err(e) = self.record_layer(layer).await {
            console.line("warn", None, format!("recording the step in the build cache failed: {e:#}"));
        }
    }

    /// The image a successful build replaced stays while a tag still
    /// points at its build; kept images the new build's tags moved away
    /// from go.
    async fn settle_replaced_image(&self, record: &TemplateRecord, old: Option<Image>) {
        let settled = self.change_labels(record, |labels| {
            let mut dropped = labels.take_untagged();
            if let Some(old) = old.clone() {
                match labels.image_build.clone() {
                    Some(build) => dropped.extend(labels.keep_if_tagged(&build, old)),
                    None => dropped.push(old),
                }
            }
            Ok(dropped)
        });
        match settled {
            Ok((_, dropped)) => self.drop_images(dropped).await,
            // Unrecorded, a kept image would be an orphan: delete none.
            Err(e) => tracing::warn!("recording the kept images of template {}: {e:#}", record.id),
        }
    }

    async fn drop_image(&self, image: Option<Image>) {
        if let Some(image) = image
            && let Err(e) = self.blocking(move |s| s.delete_snapshot(&image.snapshot_key)).await
        {
            tracing::warn!("deleting a replaced template image: {e}");
        }
    }

    async fn run_steps(
        &self,
        sandbox: &SandboxRecord,
        plan: Plan<'_>,
        state: &mut State,
        console: &mut Console<'_>,
    ) -> Result<(), Failed> {
        let agent = Agent { socket: &sandbox.agent_socket, token: &sandbox.access_token };
        let total = plan.steps.len();
        for (index, step) in plan.steps.iter().enumerate().skip(plan.first) {
            if console.gone {
                return Err(Failed { message: "the template was deleted during its build".into(), step: None });
            }
            let number = (index + 1).to_string();
            console.line("info", Some(&number), format!("[{number}/{total}] {}", describe(step)));
            let started = Instant::now();
            self.run_step(&agent, &sandbox.access_token, step, state, &number, console).await.map_err(|why| {
                Failed {
                    message: format!("step {number} ({}) failed: {why}", describe(step)),
                    step: Some(number.clone()),
                }
            })?;
            self.cache_step(sandbox, &plan.keys[index], plan.team, state, console).await;
            console.line("debug", Some(&number), format!("step {number} took {:.1?}", started.elapsed()));
        }
        Ok(())
    }

    async fn run_step(
        &self,
        agent: &Agent<'_>,
        token: &str,
        step: &Step,
        state: &mut State,
        number: &str,
        console: &mut Console<'_>,
    ) -> Result<(), String> {
        match step {
            Step::Run { command, user } => {
                let user = user.as_deref().unwrap_or(&state.user);
                agent.shell(command, user, state.workdir.as_deref(), Some((number, console))).await
            }
            Step::Env(pairs) => {
                state.envs.extend(pairs.iter().cloned());
                let envs: HashMap<&str, &str> = pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                let init = serde_json::json!({ "envVars": envs });
                agent_link::post_json(agent.socket, "/init", &init, Some(token)).await.map_err(|e| format!("{e:#}"))
            }
            Step::Workdir(dir) => {
                agent.shell(&steps::workdir_script(dir, &state.user), "root", None, None).await?;
                state.workdir = Some(dir.clone());
                Ok(())
            }
            Step::User(user) => {
                agent.shell(&steps::user_script(user), "root", None, Some((number, console))).await?;
                state.user = user.clone();
                Ok(())
            }
            Step::Copy { src, dest, owner, mode, hash } => {
                let archive = self.read_upload(&console.record.id, hash).map_err(|e| e.to_string())?;
                let owner = owner.clone().unwrap_or_else(|| state.user.clone());
                // Placed by the owner itself: root in a sandbox may not
                // write into another account's home.
                let user = owner.split(':').next().unwrap_or(&owner).to_string();
                agent.upload(&steps::copy_archive(hash), &user, archive).await?;
                let dest = match (dest.starts_with('/'), &state.workdir) {
                    (true, _) => dest.clone(),
                    (false, Some(dir)) => format!("{}/{dest}", dir.trim_end_matches('/')),
                    (false, None) => format!("/home/{}/{dest}", state.user),
                };
                let script = steps::copy_script(src, &dest, &owner, mode.as_deref(), hash);
                agent.shell(&script, &user, None, Some((number, console))).await
            }
        }
    }

    /// Snapshots the build sandbox: the template's new image. With a start
    /// command, where the substrate keeps memory, the command is started
    /// here and found ready first, and the snapshot holds it running.
    async fn finalize(
        &self,
        sandbox: &SandboxRecord,
        state: State,
        StartCommands { start: start_cmd, ready: ready_cmd }: StartCommands,
        base: &Base,
        oci: Option<OciBase>,
        console: &mut Console<'_>,
    ) -> Result<Image, Failed> {
        let memory = match &start_cmd {
            Some(command) => self.start_for_snapshot(sandbox, command, ready_cmd.as_deref(), &state, console).await?,
            None => false,
        };
        let what = if memory { "files and running processes" } else { "files" };
        console.line("info", Some("finalize"), format!("Saving the template's {what}"));
        let key = snapshot_key();
        let info = self.take_snapshot(sandbox, &key, memory).await.map_err(|e| Failed {
            message: format!("saving the template's {what} failed: {e}"),
            step: Some("finalize".into()),
        })?;
        let substrate_template = match base {
            Base::Built { image, .. } => image.substrate_template.clone(),
            Base::Substrate(_) | Base::Image { .. } => info.template,
        };
        Ok(Image {
            substrate_template,
            oci,
            snapshot_key: key,
            envs: state.envs,
            user: Some(state.user),
            workdir: state.workdir,
            start_cmd,
            ready_cmd,
            memory: info.memory,
            agent_token: info.memory.then(|| sandbox.access_token.clone()),
        })
    }

    /// Starts the start command in the build sandbox and waits for its
    /// ready command, if the snapshot can keep it running; `false` (and
    /// why, in the log) if it cannot, so each create starts it instead.
    async fn start_for_snapshot(
        &self,
        sandbox: &SandboxRecord,
        command: &str,
        ready: Option<&str>,
        state: &State,
        console: &mut Console<'_>,
    ) -> Result<bool, Failed> {
        let support = self.substrate.capabilities_for(&sandbox.template).memory_snapshots;
        if !support.is_yes() {
            let why = match support {
                Support::Missing(why) => format!(": {why}"),
                _ => format!(" (the {} substrate has no memory snapshots)", self.substrate.name()),
            };
            console.line(
                "info",
                Some("finalize"),
                format!("The start command runs when each sandbox is created: no memory snapshot here{why}"),
            );
            return Ok(false);
        }
        console.line("info", Some("finalize"), format!("Starting {command:?} and waiting until it is ready"));
        let agent = Agent { socket: &sandbox.agent_socket, token: &sandbox.access_token };
        let launch = Launch {
            command,
            ready,
            user: &state.user,
            workdir: state.workdir.as_deref(),
            timeout: BUILD_READY_TIMEOUT,
        };
        let started = Instant::now();
        launch.run(&agent).await.map_err(|why| Failed {
            message: format!("the start command was not ready: {why}"),
            step: Some("finalize".into()),
        })?;
        console.line("info", Some("finalize"), format!("The start command is ready after {:.1?}", started.elapsed()));
        Ok(true)
    }
}

/// The steps a build runs, their cache keys, and the first not cached.
struct Plan<'a> {
    steps: &'a [Step],
    keys: &'a [String],
    first: usize,
    team: &'a str,
}

/// Each step's cache key, chained from the base's.
fn chain_keys(team: &str, base_identity: &str, steps: &[Step]) -> Vec<String> {
    let mut parent = cache::base_key(team, base_identity);
    steps
        .iter()
        .map(|step| {
            parent = cache::step_key(team, &parent, step);
            parent.clone()
        })
        .collect()
}

fn record_failure(console: &mut Console<'_>, Failed { message, step }: Failed) {
    console.line("error", step.as_deref(), message.clone());
    console.record.build.status = BuildStatus::Error;
    console.record.build.failure = Some(BuildFailure { message, step });
    console.flush();
}

fn describe(step: &Step) -> String {
    match step {
        Step::Run { command, user: Some(user) } => format!("RUN {command} (as {user})"),
        Step::Run { command, user: None } => format!("RUN {command}"),
        Step::Env(pairs) => {
            format!("ENV {}", pairs.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>().join(" "))
        }
        Step::Workdir(dir) => format!("WORKDIR {dir}"),
        Step::User(user) => format!("USER {user}"),
        Step::Copy { src, dest, .. } => format!("COPY {src} {dest}"),
    }
}

/// A handed-over sandbox's agent: every call carries its access token.
pub(super) struct Agent<'a> {
    pub socket: &'a Path,
    pub token: &'a str,
}

impl Agent<'_> {
    fn authorized(&self, mut request: Request<Body>) -> Result<Request<Body>, String> {
        let token = HeaderValue::from_str(self.token).map_err(|e| e.to_string())?;
        request.headers_mut().insert(ACCESS_TOKEN, token);
        Ok(request)
    }

    /// Starts `script` under bash as `user`; the stream once it started.
    pub async fn start(
        &self,
        script: &str,
        user: &str,
        cwd: Option<&str>,
    ) -> Result<ProcessStream<hyper::body::Incoming>, String> {
        let mut start = StartProcess::shell("/bin/bash", script).user(user);
        if let Some(cwd) = cwd {
            start = start.cwd(cwd);
        }
        let request = start.request(AGENT_HOST).map_err(|e| e.to_string())?.map(Body::new);
        let response = agent_link::send(self.socket, self.authorized(request)?).await.map_err(|e| format!("{e:#}"))?;
        if !response.status().is_success() {
            return Err(format!("the agent answered {} to Process.Start", response.status()));
        }
        Ok(ProcessStream::new(response.into_body()))
    }

    /// Runs `script` to its end; its output goes to the build log (as
    /// `step`) when `log` is given. An error carries the exit code and the
    /// last lines printed.
    pub async fn shell(
        &self,
        script: &str,
        user: &str,
        cwd: Option<&str>,
        mut log: Option<(&str, &mut Console<'_>)>,
    ) -> Result<(), String> {
        let mut stream = self.start(script, user, cwd).await?;
        let mut tail: Vec<String> = Vec::new();
        let mut pending: Vec<u8> = Vec::new();
        let emit = |bytes: &[u8], tail: &mut Vec<String>, log: &mut Option<(&str, &mut Console<'_>)>| {
            let text = String::from_utf8_lossy(bytes).trim_end_matches('\r').to_string();
            if tail.len() == FAILURE_TAIL_LINES {
                tail.remove(0);
            }
            tail.push(text.clone());
            if let Some((step, console)) = log {
                console.line("info", Some(step), text);
            }
        };
        let exit = loop {
            let event = stream.next().await.map_err(|e| format!("reading its output: {e}"))?;
            match event {
                Some(ProcessEvent::Stdout(data) | ProcessEvent::Stderr(data) | ProcessEvent::Pty(data)) => {
                    pending.extend(data);
                    while let Some(at) = pending.iter().position(|b| *b == b'\n') {
                        let line: Vec<u8> = pending.drain(..=at).collect();
                        emit(&line[..line.len() - 1], &mut tail, &mut log);
                    }
                }
                Some(ProcessEvent::End { exit_code, error }) => break (exit_code, error),
                Some(_) => {}
                None => return Err("the agent ended the command's stream without its end".into()),
            }
        };
        if !pending.is_empty() {
            emit(&pending, &mut tail, &mut log);
        }
        match exit {
            (0, _) => Ok(()),
            (code, error) => {
                let why = error.map(|e| format!(" ({e})")).unwrap_or_default();
                Err(format!("exit code {code}{why}: {}", tail.join("\n")))
            }
        }
    }

    /// Writes `content` to `path` as `user`, through the agent's `/files`.
    pub async fn upload(&self, path: &str, user: &str, content: Vec<u8>) -> Result<(), String> {
        let request = Request::post(format!("/files?path={path}&username={user}"))
            .header(hyper::header::HOST, AGENT_HOST)
            .header(hyper::header::CONTENT_TYPE, "application/octet-stream")
            .body(Body::from(content))
            .map_err(|e| e.to_string())?;
        let response = agent_link::send(self.socket, self.authorized(request)?).await.map_err(|e| format!("{e:#}"))?;
        if !response.status().is_success() {
            return Err(format!(
                "uploading the files into the build sandbox: the agent answered {}",
                response.status()
            ));
        }
        Ok(())
    }
}
