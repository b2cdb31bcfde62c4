//! The agent as the gateway sees it: HTTP/1.1 over a unix socket, speaking
//! Connect-JSON and `/files`. Each test boots its own agent with a scratch
//! passwd in which "user" is the current uid, with its home in a temp dir.

use std::path::PathBuf;
use std::time::Duration;

use base64::Engine;
use bytes::Bytes;
use copse_agent::AgentConfig;
use copse_protocol::envelope::{EnvelopeDecoder, FLAG_END_STREAM, encode_envelope};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(10);
const TOKEN: &str = "secret-token";

struct Agent {
    _dir: tempfile::TempDir,
    sock: PathBuf,
    home: PathBuf,
    token: Option<&'static str>,
}

async fn start_agent(token: Option<&'static str>) -> Agent {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    let etc = dir.path().join("etc");
    std::fs::create_dir_all(&home).unwrap();
    std::fs::create_dir_all(&etc).unwrap();
    let (uid, gid) = (nix::unistd::getuid(), nix::unistd::getgid());
    let passwd =
        format!("user:x:{uid}:{gid}::{home}:/bin/sh\nother:x:4242:4242::{home}:/bin/sh\n", home = home.display());
    std::fs::write(etc.join("passwd"), passwd).unwrap();
    std::fs::write(etc.join("group"), format!("user:x:{gid}:\n")).unwrap();
    let sock = dir.path().join("agent.sock");
    let listener = tokio::net::UnixListener::bind(&sock).unwrap();
    let config = AgentConfig { access_token: token.map(str::to_string), etc_dir: etc, ..AgentConfig::default() };
    tokio::spawn(copse_agent::serve(listener, config));
    Agent { _dir: dir, sock, home, token }
}

impl Agent {
    async fn send(&self, mut req: Request<Full<Bytes>>) -> Response<Incoming> {
        if let Some(t) = self.token
            && !req.headers().contains_key("x-access-token")
        {
            req.headers_mut().insert("x-access-token", t.parse().unwrap());
        }
        req.headers_mut().insert("host", "sandbox".parse().unwrap());
        let stream = tokio::net::UnixStream::connect(&self.sock).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
        tokio::spawn(conn);
        tokio::time::timeout(TIMEOUT, sender.send_request(req)).await.unwrap().unwrap()
    }

    /// A unary Connect call: (HTTP status, JSON body).
    async fn unary(&self, method: &str, msg: Value) -> (StatusCode, Value) {
        let req = Request::post(format!("/{method}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(msg.to_string())))
            .unwrap();
        let resp = self.send(req).await;
        let status = resp.status();
        (status, serde_json::from_slice(&body_bytes(resp).await).unwrap())
    }

    /// Opens a server stream; returns the response to read frames from.
    async fn open_stream(&self, method: &str, msg: Value, extra: &[(&str, &str)]) -> Response<Incoming> {
        let mut req = Request::post(format!("/{method}"))
            .header("content-type", "application/connect+json")
            .body(Full::new(encode_envelope(0, msg.to_string().as_bytes())))
            .unwrap();
        for (k, v) in extra {
            let name = hyper::header::HeaderName::from_bytes(k.as_bytes()).unwrap();
            req.headers_mut().insert(name, v.parse().unwrap());
        }
        let resp = self.send(req).await;
        assert_eq!(resp.status(), StatusCode::OK);
        resp
    }
}

async fn body_bytes(resp: Response<Incoming>) -> Bytes {
    tokio::time::timeout(TIMEOUT, resp.into_body().collect()).await.unwrap().unwrap().to_bytes()
}

/// Reads Connect frames off a streaming response, one at a time.
struct Frames {
    body: Incoming,
    decoder: EnvelopeDecoder,
}

impl Frames {
    fn new(resp: Response<Incoming>) -> Self {
        Self { body: resp.into_body(), decoder: EnvelopeDecoder::default() }
    }

    /// Next (flags, message); panics on timeout or a body that ends early.
    async fn next(&mut self) -> (u8, Value) {
        loop {
            if let Some(env) = self.decoder.next_envelope().unwrap() {
                return (env.flags, serde_json::from_slice(&env.payload).unwrap());
            }
            let frame = tokio::time::timeout(TIMEOUT, self.body.frame()).await.unwrap();
            let frame = frame.expect("stream ended without end-of-stream frame").unwrap();
            if let Ok(data) = frame.into_data() {
                self.decoder.push(&data);
            }
        }
    }

    /// Collects stdout/stderr until the `end` event; checks the trailer.
    async fn run_to_end(&mut self) -> (String, String, Value) {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        loop {
            let (flags, msg) = self.next().await;
            assert_eq!(flags, 0, "unexpected trailer {msg}");
            let ev = &msg["event"];
            if let Some(d) = ev.get("data") {
                let b64 = base64::engine::general_purpose::STANDARD;
                if let Some(s) = d.get("stdout") {
                    out.extend(b64.decode(s.as_str().unwrap()).unwrap());
                }
                if let Some(s) = d.get("stderr") {
                    err.extend(b64.decode(s.as_str().unwrap()).unwrap());
                }
            } else if let Some(end) = ev.get("end") {
                let end = end.clone();
                assert_eq!(self.next().await, (FLAG_END_STREAM, json!({})));
                return (String::from_utf8(out).unwrap(), String::from_utf8(err).unwrap(), end);
            }
        }
    }
}

fn shell(cmd: &str) -> Value {
    json!({ "process": { "cmd": "/bin/sh", "args": ["-c", cmd] }, "stdin": false })
}

async fn start(agent: &Agent, req: Value) -> (u32, Frames) {
    let mut frames = Frames::new(agent.open_stream("process.Process/Start", req, &[]).await);
    let (flags, first) = frames.next().await;
    assert_eq!(flags, 0, "start failed: {first}");
    let pid = first["event"]["start"]["pid"].as_u64().expect("first event is start") as u32;
    (pid, frames)
}

#[tokio::test]
async fn health_is_open_but_rpcs_need_the_token() {
    let agent = start_agent(Some(TOKEN)).await;
    let health = Request::get("/health").header("x-access-token", "wrong").body(Full::default()).unwrap();
    assert_eq!(agent.send(health).await.status(), StatusCode::NO_CONTENT);

    let req = Request::post("/process.Process/List")
        .header("content-type", "application/json")
        .header("x-access-token", "wrong")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let resp = agent.send(req).await;
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    let body: Value = serde_json::from_slice(&body_bytes(resp).await).unwrap();
    assert_eq!(body["code"], 401);

    let (status, body) = agent.unary("process.Process/List", json!({})).await;
    assert_eq!((status, body), (StatusCode::OK, json!({ "processes": [] })));
}

#[tokio::test]
async fn start_streams_output_then_the_exit_status() {
    let agent = start_agent(None).await;
    let (pid, mut frames) = start(&agent, shell("echo out; echo err >&2; pwd; echo $FOO; exit 3")).await;
    assert!(pid > 0);
    let (out, err, end) = frames.run_to_end().await;
    assert_eq!(out, format!("out\n{}\n\n", agent.home.display()));
    assert_eq!(err, "err\n");
    assert_eq!(end, json!({ "exitCode": 3, "exited": true, "status": "exit status 3", "error": "exit status 3" }));
}

#[tokio::test]
async fn request_env_and_cwd_are_applied() {
    let agent = start_agent(None).await;
    let req = json!({
        "process": { "cmd": "/bin/sh", "args": ["-c", "echo $FOO $HOME; pwd"], "envs": { "FOO": "bar" }, "cwd": "/tmp" },
    });
    let (_, mut frames) = start(&agent, req).await;
    let (out, _, end) = frames.run_to_end().await;
    assert_eq!(out, format!("bar {}\n/tmp\n", agent.home.display()));
    assert_eq!(end["status"], "exit status 0");
    assert!(end.get("error").is_none());
}

#[tokio::test]
async fn large_output_arrives_complete() {
    let agent = start_agent(None).await;
    let (_, mut frames) = start(&agent, shell("head -c 3000000 /dev/zero | tr '\\0' a")).await;
    let (out, _, end) = frames.run_to_end().await;
    assert_eq!(out.len(), 3_000_000);
    assert!(out.bytes().all(|b| b == b'a'));
    assert_eq!(end["exitCode"], 0);
}

#[tokio::test]
async fn stdin_reaches_the_process_until_closed() {
    let agent = start_agent(None).await;
    let req = json!({ "process": { "cmd": "cat" }, "stdin": true, "tag": "catter" });
    let (pid, mut frames) = start(&agent, req).await;
    let hi = base64::engine::general_purpose::STANDARD.encode("hi\n");
    let (s, _) =
        agent.unary("process.Process/SendInput", json!({ "process": { "pid": pid }, "input": { "stdin": hi } })).await;
    assert_eq!(s, StatusCode::OK);
    // Tags select processes too; pids may come as strings.
    let (s, _) = agent.unary("process.Process/CloseStdin", json!({ "process": { "tag": "catter" } })).await;
    assert_eq!(s, StatusCode::OK);
    let (out, _, end) = frames.run_to_end().await;
    assert_eq!(out, "hi\n");
    assert_eq!(end["exitCode"], 0);
    let (s, body) = agent.unary("process.Process/CloseStdin", json!({ "process": { "pid": pid.to_string() } })).await;
    assert_eq!((s, body["code"].as_str()), (StatusCode::NOT_FOUND, Some("not_found")));
}

#[tokio::test]
async fn kill_ends_the_stream_with_the_signal() {
    let agent = start_agent(None).await;
    let (pid, mut frames) = start(&agent, shell("sleep 30")).await;
    let (s, body) = agent.unary("process.Process/List", json!({})).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(body["processes"][0]["pid"], pid);
    assert_eq!(body["processes"][0]["config"]["cmd"], "/bin/sh");
    let (s, _) = agent
        .unary("process.Process/SendSignal", json!({ "process": { "pid": pid }, "signal": "SIGNAL_SIGKILL" }))
        .await;
    assert_eq!(s, StatusCode::OK);
    let (_, _, end) = frames.run_to_end().await;
    assert_eq!(end, json!({ "exitCode": -1, "exited": false, "status": "signal: killed", "error": "signal: killed" }));
}

#[tokio::test]
async fn connect_attaches_to_a_running_process() {
    let agent = start_agent(None).await;
    let (pid, first) = start(&agent, shell("sleep 0.5; echo late")).await;
    drop(first); // the starting client goes away; the process lives on
    let resp = agent.open_stream("process.Process/Connect", json!({ "process": { "pid": pid } }), &[]).await;
    let mut frames = Frames::new(resp);
    assert_eq!(frames.next().await.1, json!({ "event": { "start": { "pid": pid } } }));
    let (out, _, _) = frames.run_to_end().await;
    assert_eq!(out, "late\n");
}

#[tokio::test]
async fn stream_deadline_kills_the_command() {
    let agent = start_agent(None).await;
    let resp = agent.open_stream("process.Process/Start", shell("sleep 30"), &[("connect-timeout-ms", "300")]).await;
    let mut frames = Frames::new(resp);
    assert!(frames.next().await.1["event"]["start"].is_object());
    let (flags, msg) = frames.next().await;
    assert_eq!(flags, FLAG_END_STREAM);
    assert_eq!(msg["error"]["code"], "deadline_exceeded");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (_, body) = agent.unary("process.Process/List", json!({})).await;
    assert_eq!(body["processes"], json!([]));
}

#[tokio::test]
async fn start_errors_arrive_in_the_trailer() {
    let agent = start_agent(None).await;
    let req = json!({ "process": { "cmd": "/nonexistent/binary" } });
    let mut frames = Frames::new(agent.open_stream("process.Process/Start", req, &[]).await);
    let (flags, msg) = frames.next().await;
    assert_eq!(flags, FLAG_END_STREAM);
    assert_eq!(msg["error"]["code"], "invalid_argument");
    let req = json!({ "process": { "cmd": "/bin/true", "cwd": "/nonexistent" } });
    let mut frames = Frames::new(agent.open_stream("process.Process/Start", req, &[]).await);
    assert_eq!(frames.next().await.1["error"]["code"], "invalid_argument");
}

#[tokio::test]
async fn pty_processes_get_a_terminal_of_the_requested_size() {
    let agent = start_agent(None).await;
    let req = json!({ "process": { "cmd": "/bin/sh", "args": ["-c", "stty size; tty"] }, "pty": { "size": { "cols": 100, "rows": 30 } } });
    let (_, mut frames) = start(&agent, req).await;
    let mut out = Vec::new();
    loop {
        let (_, msg) = frames.next().await;
        if let Some(p) = msg["event"]["data"]["pty"].as_str() {
            out.extend(base64::engine::general_purpose::STANDARD.decode(p).unwrap());
        } else if msg["event"].get("end").is_some() {
            break;
        }
    }
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("30 100\r\n/dev/pts/"), "{text:?}");
}

#[tokio::test]
async fn background_children_do_not_hold_the_stream_open() {
    let agent = start_agent(None).await;
    let started = std::time::Instant::now();
    let (_, mut frames) = start(&agent, shell("sleep 5 & echo started")).await;
    let (out, _, end) = frames.run_to_end().await;
    assert_eq!((out.as_str(), end["exitCode"].as_i64()), ("started\n", Some(0)));
    assert!(started.elapsed() < Duration::from_secs(3));
}

#[tokio::test]
async fn uploads_belong_to_the_requesting_user() {
    use std::os::unix::fs::MetadataExt;
    if !nix::unistd::getuid().is_root() {
        return; // chown needs root
    }
    let agent = start_agent(None).await;
    give_home_to_other(&agent);
    let req = Request::post("/files?path=owned/f.txt&username=other")
        .header("content-type", "application/octet-stream")
        .body(Full::new(Bytes::from_static(b"mine")))
        .unwrap();
    assert_eq!(agent.send(req).await.status(), StatusCode::OK);
    let file = std::fs::metadata(agent.home.join("owned/f.txt")).unwrap();
    let dir = std::fs::metadata(agent.home.join("owned")).unwrap();
    assert_eq!((file.uid(), file.gid(), dir.uid()), (4242, 4242, 4242));
}

/// Makes the shared home "other"'s (uid 4242), reachable by it.
fn give_home_to_other(agent: &Agent) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(agent.home.parent().unwrap(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::chown(&agent.home, Some(4242), Some(4242)).unwrap();
}

#[tokio::test]
async fn files_for_a_user_reach_only_what_that_user_may() {
    use std::os::unix::fs::PermissionsExt;
    if !nix::unistd::getuid().is_root() {
        return; // switching file credentials needs root
    }
    let agent = start_agent(None).await;
    give_home_to_other(&agent);
    let secret = agent.home.parent().unwrap().join("secret");
    std::fs::write(&secret, b"root only").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::symlink(&secret, agent.home.join("planted")).unwrap();
    let get = |uri: &str| Request::get(uri).body(Full::default()).unwrap();
    let resp = agent.send(get("/files?path=planted&username=other")).await;
    assert_eq!(resp.status(), StatusCode::FORBIDDEN);
    let put = Request::post("/files?path=planted&username=other")
        .header("content-type", "application/octet-stream")
        .body(Full::new(Bytes::from_static(b"overwritten")))
        .unwrap();
    assert_eq!(agent.send(put).await.status(), StatusCode::FORBIDDEN);
    assert_eq!(std::fs::read(&secret).unwrap(), b"root only");
    // "user" is the current uid, root here: root keeps root's power.
    let resp = agent.send(get("/files?path=planted&username=user")).await;
    assert_eq!(resp.status(), StatusCode::OK);
}

#[tokio::test]
async fn downloads_refuse_fifos_at_once() {
    let agent = start_agent(None).await;
    nix::unistd::mkfifo(&agent.home.join("pipe"), nix::sys::stat::Mode::from_bits_truncate(0o666)).unwrap();
    let resp = agent.send(Request::get("/files?path=pipe").body(Full::default()).unwrap()).await;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    let put = Request::post("/files?path=pipe")
        .header("content-type", "application/octet-stream")
        .body(Full::new(Bytes::from_static(b"x")))
        .unwrap();
    assert_eq!(agent.send(put).await.status(), StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn filesystem_rpcs_use_the_users_home() {
    let agent = start_agent(None).await;
    std::fs::create_dir(agent.home.join("sub")).unwrap();
    std::fs::write(agent.home.join("a.txt"), b"hello").unwrap();
    let (s, body) = agent.unary("filesystem.Filesystem/ListDir", json!({ "path": "", "depth": 1 })).await;
    assert_eq!(s, StatusCode::OK);
    let names: Vec<_> = body["entries"].as_array().unwrap().iter().map(|e| e["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["sub", "a.txt"]);
    assert_eq!(body["entries"][1]["type"], "FILE_TYPE_FILE");
    assert_eq!(body["entries"][1]["owner"], "user");

    let (s, body) = agent.unary("filesystem.Filesystem/Stat", json!({ "path": "~/a.txt" })).await;
    assert_eq!((s, body["entry"]["size"].as_str()), (StatusCode::OK, Some("5")));
    let (s, body) = agent.unary("filesystem.Filesystem/Stat", json!({ "path": "nope" })).await;
    assert_eq!((s, body["code"].as_str()), (StatusCode::NOT_FOUND, Some("not_found")));

    let (s, _) = agent.unary("filesystem.Filesystem/MakeDir", json!({ "path": "new/deep" })).await;
    assert_eq!(s, StatusCode::OK);
    let (s, body) = agent.unary("filesystem.Filesystem/MakeDir", json!({ "path": "new/deep" })).await;
    assert_eq!((s, body["code"].as_str()), (StatusCode::CONFLICT, Some("already_exists")));

    let (s, body) =
        agent.unary("filesystem.Filesystem/Move", json!({ "source": "a.txt", "destination": "new/b.txt" })).await;
    assert_eq!(
        (s, body["entry"]["path"].as_str()),
        (StatusCode::OK, Some(agent.home.join("new/b.txt").to_str().unwrap()))
    );
    let (s, _) = agent.unary("filesystem.Filesystem/Remove", json!({ "path": "new" })).await;
    assert_eq!(s, StatusCode::OK);
    assert!(!agent.home.join("new").exists());
}

#[tokio::test]
async fn watch_dir_streams_changes() {
    let agent = start_agent(None).await;
    let resp =
        agent.open_stream("filesystem.Filesystem/WatchDir", json!({ "path": "", "include_entry": true }), &[]).await;
    let mut frames = Frames::new(resp);
    assert_eq!(frames.next().await, (0, json!({ "start": {} })));
    std::fs::write(agent.home.join("w.txt"), b"x").unwrap();
    let (flags, msg) = frames.next().await;
    assert_eq!(flags, 0, "{msg}");
    assert_eq!(msg["filesystem"]["name"], "w.txt", "{msg}");
    assert_eq!(msg["filesystem"]["type"], "EVENT_TYPE_CREATE");
    assert_eq!(msg["filesystem"]["entry"]["name"], "w.txt");
}

fn multipart(parts: &[(&str, &[u8])]) -> (String, Bytes) {
    let boundary = "XBOUNDARYX";
    let mut body = Vec::new();
    for (name, data) in parts {
        body.extend(format!("--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\nContent-Type: application/octet-stream\r\n\r\n").bytes());
        body.extend_from_slice(data);
        body.extend(b"\r\n");
    }
    body.extend(format!("--{boundary}--\r\n").bytes());
    (format!("multipart/form-data; boundary={boundary}"), Bytes::from(body))
}

#[tokio::test]
async fn uploads_and_downloads_stream_files() {
    let agent = start_agent(Some(TOKEN)).await;
    let (ct, body) = multipart(&[("dir/one.txt", b"one"), ("/tmp/copse-agent-test-two.txt", b"two")]);
    let req = Request::post("/files").header("content-type", ct).body(Full::new(body)).unwrap();
    let resp = agent.send(req).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let written: Value = serde_json::from_slice(&body_bytes(resp).await).unwrap();
    assert_eq!(written[0], json!({ "name": "one.txt", "type": "file", "path": agent.home.join("dir/one.txt") }));
    assert_eq!(std::fs::read(agent.home.join("dir/one.txt")).unwrap(), b"one");
    assert_eq!(std::fs::read("/tmp/copse-agent-test-two.txt").unwrap(), b"two");
    let _ = std::fs::remove_file("/tmp/copse-agent-test-two.txt");

    let big = vec![7u8; 4 << 20];
    let req = Request::post("/files?path=big.bin")
        .header("content-type", "application/octet-stream")
        .body(Full::new(Bytes::from(big.clone())))
        .unwrap();
    assert_eq!(agent.send(req).await.status(), StatusCode::OK);

    let resp = agent.send(Request::get("/files?path=big.bin").body(Full::default()).unwrap()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(body_bytes(resp).await.len(), big.len());

    let resp = agent.send(Request::get("/files?path=missing").body(Full::default()).unwrap()).await;
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let err: Value = serde_json::from_slice(&body_bytes(resp).await).unwrap();
    assert_eq!(err["code"], 404);
    assert!(err["message"].as_str().unwrap().contains("does not exist"));

    let resp = agent.send(Request::get("/files?path=dir").body(Full::default()).unwrap()).await;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn signed_urls_work_without_the_token_header() {
    let agent = start_agent(Some(TOKEN)).await;
    std::fs::write(agent.home.join("s.txt"), b"signed").unwrap();
    let sig = copse_protocol::signature::sign("s.txt", "read", "", TOKEN, None);
    let enc = sig.replace('+', "%2B").replace('/', "%2F");
    let get = |uri: String| Request::get(uri).header("x-access-token", "").body(Full::default()).unwrap();
    let resp = agent.send(get(format!("/files?path=s.txt&signature={enc}"))).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(&body_bytes(resp).await[..], b"signed");

    let unsigned = Request::get("/files?path=s.txt").body(Full::default()).unwrap();
    let mut unsigned = unsigned;
    unsigned.headers_mut().insert("x-access-token", "wrong".parse().unwrap());
    assert_eq!(agent.send(unsigned).await.status(), StatusCode::UNAUTHORIZED);

    let expired = copse_protocol::signature::sign("s.txt", "read", "", TOKEN, Some(1));
    let enc = expired.replace('+', "%2B").replace('/', "%2F");
    let resp = agent.send(get(format!("/files?path=s.txt&signature={enc}&signature_expiration=1"))).await;
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn init_hands_over_token_and_environment() {
    let agent = start_agent(None).await;
    let init = |token: Option<&str>, body: Value| {
        let mut r = Request::post("/init")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        if let Some(t) = token {
            r.headers_mut().insert("x-access-token", t.parse().unwrap());
        }
        r
    };
    let resp = agent.send(init(None, json!({ "envVars": { "GREETING": "hey" }, "accessToken": "t1" }))).await;
    assert_eq!(resp.status(), StatusCode::NO_CONTENT);
    // Now the token is set: a second init needs it.
    assert_eq!(agent.send(init(None, json!({}))).await.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(agent.send(init(Some("t1"), json!({ "accessToken": "t2" }))).await.status(), StatusCode::NO_CONTENT);

    let mut req = Request::post("/process.Process/Start")
        .header("content-type", "application/connect+json")
        .body(Full::new(encode_envelope(0, shell("echo $GREETING").to_string().as_bytes())))
        .unwrap();
    req.headers_mut().insert("x-access-token", "t2".parse().unwrap());
    let mut frames = Frames::new(agent.send(req).await);
    assert!(frames.next().await.1["event"]["start"].is_object());
    assert_eq!(frames.run_to_end().await.0, "hey\n");
}

#[tokio::test]
async fn unknown_users_are_unauthenticated() {
    let agent = start_agent(None).await;
    let req = Request::post("/filesystem.Filesystem/Stat")
        .header("content-type", "application/json")
        .header("authorization", "Basic bm9ib2R5Og==") // "nobody:"
        .body(Full::new(Bytes::from_static(b"{\"path\":\"/\"}")))
        .unwrap();
    let resp = agent.send(req).await;
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    let body: Value = serde_json::from_slice(&body_bytes(resp).await).unwrap();
    assert_eq!(body["code"], "unauthenticated");

    let resp = agent.send(Request::get("/files?path=x&username=nobody").body(Full::default()).unwrap()).await;
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn other_sandbox_ports_are_relayed_to_loopback() {
    let agent = start_agent(Some(TOKEN)).await;
    // A tiny HTTP server standing in for a service inside the sandbox.
    let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = server.local_addr().unwrap().port();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut conn, _) = server.accept().await.unwrap();
        let mut buf = [0u8; 1024];
        let n = conn.read(&mut buf).await.unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("GET /contexts "));
        conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n[]").await.unwrap();
    });
    // No access token: the relayed service decides for itself.
    let req = Request::get("/contexts")
        .header("e2b-sandbox-port", port.to_string())
        .header("x-access-token", "")
        .body(Full::default())
        .unwrap();
    let resp = agent.send(req).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(&body_bytes(resp).await[..], b"[]");

    // A closed port is a clear 502, not a hang.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let req = Request::get("/health").header("e2b-sandbox-port", closed.to_string()).body(Full::default()).unwrap();
    let resp = agent.send(req).await;
    assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
    let body: Value = serde_json::from_slice(&body_bytes(resp).await).unwrap();
    assert!(body["message"].as_str().unwrap().contains("port is not open"));
}

/// The head of one request a stand-in service on loopback receives.
async fn relayed_head(agent: &Agent, headers: &[(&str, &str)]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = server.local_addr().unwrap().port();
    let seen = tokio::spawn(async move {
        let (mut conn, _) = server.accept().await.unwrap();
        let mut buf = [0u8; 4096];
        let n = conn.read(&mut buf).await.unwrap();
        conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await.unwrap();
        String::from_utf8_lossy(&buf[..n]).to_ascii_lowercase()
    });
    let mut req = Request::get("/x").header("e2b-sandbox-port", port.to_string());
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    assert_eq!(agent.send(req.body(Full::default()).unwrap()).await.status(), StatusCode::OK);
    seen.await.unwrap()
}

#[tokio::test]
async fn relayed_requests_lose_the_tokens_and_carry_only_whether_the_caller_had_one() {
    let agent = start_agent(Some(TOKEN)).await;
    let head = relayed_head(
        &agent,
        &[("x-access-token", TOKEN), ("e2b-traffic-access-token", "traffic"), ("x-copse-caller-authenticated", "0")],
    )
    .await;
    assert!(!head.contains("x-access-token") && !head.contains(&TOKEN.to_ascii_lowercase()), "{head}");
    assert!(!head.contains("e2b-traffic-access-token") && !head.contains("traffic\r"), "{head}");
    assert!(head.contains("x-copse-caller-authenticated: 1\r\n"), "{head}");

    // A caller without the token cannot forge the mark.
    let head = relayed_head(&agent, &[("x-access-token", "wrong"), ("x-copse-caller-authenticated", "1")]).await;
    assert!(!head.contains("x-copse-caller-authenticated"), "{head}");
    assert!(!head.contains("wrong"), "{head}");
}

#[tokio::test]
async fn upgrades_to_other_ports_become_two_way_byte_streams() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let agent = start_agent(Some(TOKEN)).await;
    // A service that accepts any upgrade, then echoes bytes upper-cased.
    let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = server.local_addr().unwrap().port();
    tokio::spawn(async move {
        let (mut conn, _) = server.accept().await.unwrap();
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            head.push(conn.read_u8().await.unwrap());
        }
        assert!(String::from_utf8_lossy(&head).to_ascii_lowercase().contains("upgrade: echo"));
        conn.write_all(b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: echo\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 64];
        loop {
            let n = conn.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            conn.write_all(&buf[..n].to_ascii_uppercase()).await.unwrap();
        }
    });
    let req = Request::get("/ws")
        .header("e2b-sandbox-port", port.to_string())
        .header("connection", "upgrade")
        .header("upgrade", "echo")
        .header("host", "sandbox")
        .body(Full::<Bytes>::default())
        .unwrap();
    let stream = tokio::net::UnixStream::connect(&agent.sock).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn.with_upgrades());
    let resp = tokio::time::timeout(TIMEOUT, sender.send_request(req)).await.unwrap().unwrap();
    assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
    let mut upgraded = TokioIo::new(tokio::time::timeout(TIMEOUT, hyper::upgrade::on(resp)).await.unwrap().unwrap());
    for word in ["hello", "both ways"] {
        upgraded.write_all(word.as_bytes()).await.unwrap();
        let mut echoed = vec![0u8; word.len()];
        tokio::time::timeout(TIMEOUT, upgraded.read_exact(&mut echoed)).await.unwrap().unwrap();
        assert_eq!(echoed, word.to_ascii_uppercase().as_bytes());
    }
}
