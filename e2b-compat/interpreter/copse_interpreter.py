#!/usr/bin/env python3
"""copse code interpreter: E2B's code-interpreter HTTP API, served inside a sandbox.

Run as the sandbox's unprivileged user:

    python3 /opt/copse/copse_interpreter.py --port 49999 [--host 127.0.0.1]

It speaks the wire protocol of E2B's in-sandbox server (the one the official
``e2b-code-interpreter`` SDK talks to on port 49999):

* ``GET /health``: 200 once the default Python kernel is ready, 503 before.
* ``POST /execute``: runs code and streams one JSON object per line
  (``stdout``, ``stderr``, ``result``, ``error``, ``number_of_executions``,
  ``keepalive``) as they are produced, always ending with ``end_of_execution``.
* ``POST /contexts``, ``GET /contexts``, ``POST /contexts/{id}/restart``,
  ``DELETE /contexts/{id}``.

Design
------
Server model: ``http.server.ThreadingHTTPServer``, one thread per connection,
speaking HTTP/1.1 with keep-alive, ``Content-Length`` bodies for plain replies
and chunked transfer encoding for the ``/execute`` stream (one chunk per
line, written straight to the socket, so each line leaves as it is made).
Blocking threads fit the work: an execution is a loop that waits on the
kernel and writes to one socket, executions in one context are serialised by
a per-context lock anyway, and a sandbox sees a handful of concurrent calls
at most. It needs nothing beyond the standard library, and it keeps every
blocking call off any event loop (jupyter_client 7.4, Debian bookworm's,
implements its "blocking" API by running asyncio loops per call through
nest_asyncio, which does not mix well with threads).

Python contexts are real ipykernel processes. ``jupyter_client``'s
``KernelManager`` starts, interrupts and kills them; every call into a
KernelManager runs on one dedicated thread, so its internal event loop is
always the same one. The messaging itself (execute requests, iopub output)
goes over plain synchronous pyzmq sockets signed by ``jupyter_client.session
.Session``; the execution loop polls the iopub socket with a short timeout,
which also lets it notice a client that went away, a kernel that died, and
when a keepalive line is due.

Bash contexts need no Jupyter kernel (Debian ships none): each is one
persistent interactive ``bash`` (``--norc --noprofile --noediting -i``, fed
on a pipe, prompts emptied). A cell is written to a private file and run
with ``source FILE </dev/null``, followed on the next line by a command that
prints a random sentinel plus ``$?`` on stdout and the sentinel on stderr;
reader threads stream both pipes until both sentinels are seen. Interactive
mode matters for interrupts: SIGINT to the shell's process group kills the
running command and makes bash abandon the rest of the sourced cell (a
non-interactive shell would exit), while variables, functions and the
working directory survive. A non-zero exit status becomes an ``error`` line
``{"name": "", "value": "<status>"}``, as E2B's bash kernel reports it.
Unlike E2B's pty-based bash kernel, stdout and stderr stay separate streams.

JavaScript and TypeScript contexts are one Node.js process each, running
copse_js_kernel.mjs (beside this file): Node's own REPL evaluator, so
declarations persist, the last expression is the result and top-level
``await`` works; TypeScript is transpiled by the ``typescript`` module first.
The process is driven like bash: a JSON command per line on stdin, sentinels
on both output streams, the cell's result or error in a file. The default
JavaScript context starts in the background at the server's first request
other than ``/health``, not at its start: a Node.js process keeps random state
that cannot be reseeded (V8's ``Math.random``, and the OpenSSL generator behind
``crypto``), and a server started in a template's memory snapshot is restored
into every sandbox of that template, which would then share it. They are offered when ``node`` is installed (the code-interpreter template installs
it). R and Java (which need kernels from outside the package registries) get
a 400 "language not supported".

Timeouts and disconnects: the SDK enforces ``timeout`` by closing the
connection. While a cell runs, the server peeks the client socket a few times
a second (and writes a ``keepalive`` line after a few idle seconds); when the
client is gone it interrupts the kernel (SIGINT), drains the cell's remaining
output, and leaves the context usable. If the kernel ignores the interrupt
for ``--interrupt-grace`` seconds it is restarted. If a kernel dies during a
cell the stream ends with an ``error`` named ``UnexpectedEndOfExecution``, and
the kernel is restarted on the context's next call.

Environment: per-call ``env_vars`` are set in the kernel (``os.environ`` for
Python, ``export`` for bash) before the cell and put back as they were after
it. As E2B's server does, each context also applies the sandbox-wide
variables from the agent's ``GET /envs`` once, on its first execution (the
sandbox may have been started from a pool before it got them); the agent is
reached at ``--envd-url``, whose loopback listener answers ``/envs`` without
a token: this server never sees the caller's token (the agent strips it).

Authorisation: ``/execute`` needs the caller to have presented the
sandbox's access token (the SDKs send it there only; the other routes run no
code, and a sandbox that does not allow public traffic guards them all with
its traffic token at the gateway). The agent checks it and strips it
before relaying here, and marks the request with
``X-Copse-Caller-Authenticated: 1`` (removing any such header a caller sent);
others get 401. ``--no-auth`` turns this off, for running the server outside
a sandbox.

Logs go to stderr. Bad input never takes the server down: it gets a 400 JSON
``{"error": ...}`` instead.
"""

import argparse
import codecs
import datetime
import http.client
import http.server
import json
import logging
import os
import pwd
import queue
import re
import select
import shlex
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import traceback
import urllib.parse
import uuid

log = logging.getLogger("copse-interpreter")

DEFAULT_CWD = "/home/user"
SUPPORTED_LANGUAGES = ("python", "bash") + (("javascript", "typescript") if shutil.which("node") else ())
JS_KERNEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "copse_js_kernel.mjs")
# How often an execution loop wakes up to check the client, the kernel and
# whether a keepalive is due.
POLL_SECONDS = 0.2
KEEPALIVE_SECONDS = 5.0
INTERRUPT_GRACE_SECONDS = 10.0
KERNEL_START_TIMEOUT = 60.0
MAX_BODY_BYTES = 64 * 1024 * 1024
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Set from the command line in main().
CONFIG = argparse.Namespace(
    keepalive=KEEPALIVE_SECONDS,
    interrupt_grace=INTERRUPT_GRACE_SECONDS,
    envd_url="http://127.0.0.1:49983",
    require_caller=True,
    default_cwd=DEFAULT_CWD,
    # "agent": kernels are started by the agent as the sandbox's user;
    # "local": by this server, as itself.
    kernels="agent",
)


class BadRequest(Exception):
    """Rejected input; becomes a 4xx JSON reply."""

    def __init__(self, message, status=400):
        super().__init__(message)
        self.status = status


class ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


def now_iso():
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def normalize_language(language):
    """E2B's normalisation: lowercase, trimmed, js/ts aliases, python default."""
    if language is None:
        return "python"
    if not isinstance(language, str):
        raise BadRequest("language must be a string")
    language = language.strip().lower()
    if not language:
        return "python"
    return {"js": "javascript", "ts": "typescript"}.get(language, language)


def check_language(language):
    if language not in SUPPORTED_LANGUAGES:
        raise BadRequest(
            f"language {language!r} is not supported in this sandbox "
            f"(supported: {', '.join(SUPPORTED_LANGUAGES)})"
        )


def check_env_vars(env_vars, language):
    if env_vars is None:
        return {}
    if not isinstance(env_vars, dict):
        raise BadRequest("env_vars must be an object of string values")
    for key, value in env_vars.items():
        if not isinstance(value, str):
            raise BadRequest(f"env_vars[{key!r}] must be a string")
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise BadRequest(f"invalid environment variable name {key!r}")
        if language == "bash" and not ENV_NAME.match(key):
            raise BadRequest(f"invalid environment variable name for bash: {key!r}")
    return dict(env_vars)


# Set by the sandbox's agent when the caller presented the access token.
CALLER_AUTHENTICATED = "X-Copse-Caller-Authenticated"


def fetch_sandbox_envs():
    """The sandbox-wide environment from the agent (envd's GET /envs), or {}.
    The agent answers it on the sandbox's loopback without a token: this
    server never holds the caller's."""
    url = CONFIG.envd_url
    if not url:
        return {}
    headers = {}
    try:
        if url.startswith("unix:"):
            conn = UnixHTTPConnection(url[len("unix:"):], timeout=2)
            path = "/envs"
        else:
            parsed = urllib.parse.urlsplit(url)
            conn = http.client.HTTPConnection(parsed.hostname, parsed.port or 80, timeout=2)
            path = (parsed.path.rstrip("/") or "") + "/envs"
        try:
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            log.warning("GET %s/envs answered %s; no sandbox-wide variables applied", url, resp.status)
            return {}
        data = json.loads(body)
        if not isinstance(data, dict):
            return {}
        return {str(k): str(v) for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}
    except (OSError, ValueError, http.client.HTTPException) as e:
        log.info("no sandbox-wide variables from %s: %s", url, e)
        return {}


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path, timeout):
        super().__init__("localhost", timeout=timeout)
        self._unix_path = path

    def connect(self):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._unix_path)
        self.sock = sock


# ---------------------------------------------------------------------------
# Output sink: the /execute response stream


class Sink:
    """Writes NDJSON lines as HTTP chunks, and tells when the client left."""

    def __init__(self, handler):
        self.handler = handler
        self.sock = handler.connection
        self.gone = False
        self.last_write = time.monotonic()

    def emit(self, obj):
        if self.gone:
            raise ClientGone()
        data = (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")
        try:
            self.handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        except (OSError, ValueError) as e:
            self.gone = True
            raise ClientGone() from e
        self.last_write = time.monotonic()

    def try_emit(self, obj):
        """emit(), but a gone client is only remembered."""
        try:
            self.emit(obj)
        except ClientGone:
            pass

    def keepalive_if_due(self):
        if not self.gone and time.monotonic() - self.last_write >= CONFIG.keepalive:
            self.try_emit({"type": "keepalive"})

    def client_gone(self):
        """Peeks the socket: the client has sent its whole request and waits,
        so the socket turns readable only when it closes (EOF) or resets."""
        if self.gone:
            return True
        try:
            poller = select.poll()
            poller.register(self.sock, select.POLLIN | select.POLLHUP | select.POLLERR)
            events = poller.poll(0)
            if events:
                if events[0][1] & (select.POLLHUP | select.POLLERR):
                    self.gone = True
                elif self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    self.gone = True
        except BlockingIOError:
            pass
        except (OSError, ValueError):
            self.gone = True
        return self.gone


def unexpected_end_error(value="Connection to the execution was closed before the execution was finished"):
    return {"type": "error", "name": "UnexpectedEndOfExecution", "value": value, "traceback": ""}


# ---------------------------------------------------------------------------
# Contexts


class Context:
    language = ""

    def __init__(self, cwd):
        self.id = str(uuid.uuid4())
        self.cwd = cwd
        self.lock = threading.Lock()
        self.envs_applied = False
        self.closed = False

    def describe(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def acquire(self, sink):
        """Takes the context lock; while waiting, keeps the stream alive and
        gives up if the client leaves. Returns False if it gave up."""
        while not self.lock.acquire(timeout=POLL_SECONDS):
            if sink.client_gone():
                return False
            sink.keepalive_if_due()
        return True

    def reseed(self):
        """Gives the language's own random generator fresh entropy (bash's
        $RANDOM reseeds per process; V8's Math.random cannot be reseeded)."""

    def execute(self, code, env_vars, sink):
        """Runs one cell and streams its output; the caller holds the lock."""
        if self.closed:
            sink.try_emit(unexpected_end_error("The context was removed"))
            return
        if self.needs_restart():
            log.info("context %s: restarting its dead %s process", self.id, self.language)
            try:
                self.restart_locked()
            except Exception as e:
                log.exception("context %s: restart failed", self.id)
                sink.try_emit(unexpected_end_error(f"The context could not be restarted: {e}"))
                return
        if not self.envs_applied:
            self.envs_applied = True
            # The kernel may be a restore of one warm snapshot shared by many
            # sandboxes: its random state would be theirs too.
            self.reseed()
            envs = fetch_sandbox_envs()
            if envs:
                self.set_envs_permanently(envs)
        restore = False
        if env_vars:
            self.set_call_envs(env_vars)
            restore = True
        if self.needs_restart():
            sink.try_emit(unexpected_end_error())
            return
        try:
            self.run_cell(code, sink)
        finally:
            if restore and not self.needs_restart():
                try:
                    self.restore_call_envs(env_vars)
                except Exception:
                    log.exception("context %s: restoring env vars failed", self.id)

    def force_stop(self):
        """Kills the running process without the lock, so a stuck execution
        ends (it reports UnexpectedEndOfExecution)."""
        raise NotImplementedError

    def restart(self):
        if not self.lock.acquire(timeout=0.5):
            log.info("context %s busy: killing it to restart", self.id)
            self.force_stop()
            self.lock.acquire()
        try:
            self.restart_locked()
        finally:
            self.lock.release()

    def close(self):
        if not self.lock.acquire(timeout=0.5):
            self.force_stop()
            self.lock.acquire()
        try:
            self.closed = True
            self.shutdown()
        finally:
            self.lock.release()

    # Implemented by languages: start(), needs_restart(), restart_locked(),
    # shutdown(), run_cell(), set_envs_permanently(), set_call_envs(),
    # restore_call_envs().


# ---------------------------------------------------------------------------
# Kernel processes


# Where the agent serves kernel requests (copse_protocol::kernels).
# /health's header saying when the default kernel became ready.
READY_AT_HEADER = "X-Copse-Ready-At"
AGENT_KERNEL_SOCKET = "\0copse-agent-kernels" if sys.platform.startswith("linux") else "/var/run/copse-agent-kernels.sock"
PYTHON_KERNEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "copse_python_kernel.py")


class LocalKernelProcess:
    """A kernel this server started itself (``--kernels local``: outside a
    sandbox). The interface every context uses: ``stdin``/``stdout``/
    ``stderr`` (pipes or None), ``poll()``, ``wait()``, ``signal()`` (to the
    kernel's process group), ``kill()``, ``close()``."""

    def __init__(self, argv, cwd, env, pipes):
        self.popen = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipes else None,
            stderr=subprocess.PIPE if pipes else None,
            cwd=cwd,
            env=dict(os.environ, **env),
            start_new_session=True,
            bufsize=0,
        )
        self.stdin, self.stdout, self.stderr = self.popen.stdin, self.popen.stdout, self.popen.stderr

    def poll(self):
        return self.popen.poll()

    def wait(self, timeout=None):
        return self.popen.wait(timeout)

    def signal(self, signum):
        try:
            os.killpg(self.popen.pid, signum)
        except OSError as e:
            log.debug("signal %d to kernel %d: %s", signum, self.popen.pid, e)

    def kill(self):
        self.signal(signal.SIGKILL)

    def close(self):
        pass


class AgentKernelProcess:
    """A kernel the agent started as the sandbox's user. This server runs
    under an account of its own and cannot switch users, so it asks the
    agent on its kernel socket, which serves only this account (by the
    connection's peer credentials). One connection is one kernel: a JSON
    request carrying the kernel's stdin, stdout and stderr as descriptors,
    then ``{"signal": N}`` lines from here, and the kernel's end from there.
    Closing the connection kills the kernel."""

    def __init__(self, argv, cwd, env, pipes):
        self.returncode = None
        self._ended = threading.Event()
        self._send_lock = threading.Lock()
        self.stdin = self.stdout = self.stderr = None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        child = []
        try:
            sock.settimeout(KERNEL_START_TIMEOUT)
            sock.connect(AGENT_KERNEL_SOCKET)
            check_agent_peer(sock)
            if pipes:
                r0, w0 = os.pipe()
                r1, w1 = os.pipe()
                r2, w2 = os.pipe()
                child = [r0, w1, w2]
                self.stdin = os.fdopen(w0, "wb", buffering=0)
                self.stdout = os.fdopen(r1, "rb", buffering=0)
                self.stderr = os.fdopen(r2, "rb", buffering=0)
                fds = child
            else:
                # Its output goes where this server's log goes.
                child = [os.open(os.devnull, os.O_RDONLY)]
                fds = [child[0], 2, 2]
            payload = (json.dumps({"argv": argv, "cwd": cwd, "env": env}) + "\n").encode("utf-8")
            sent = socket.send_fds(sock, [payload], fds)
            if sent < len(payload):
                sock.sendall(payload[sent:])
        except BaseException:
            sock.close()
            self._close_pipes()
            raise
        finally:
            for fd in child:
                os.close(fd)
        self.sock = sock
        self.replies = sock.makefile("rb")
        try:
            reply = json.loads(self.replies.readline() or b"{}")
        except (OSError, ValueError) as e:
            reply = {"error": f"no answer from the agent: {e}"}
        if "pid" not in reply:
            self.close()
            raise BadRequest(f"the kernel did not start: {reply.get('error', 'no answer from the agent')}")
        self.pid = reply["pid"]
        sock.settimeout(None)
        threading.Thread(target=self._watch, daemon=True, name=f"kernel-{self.pid}").start()

    def _watch(self):
        """Waits for the agent's word that the kernel ended (or for the
        connection to drop, which means the same)."""
        code = -signal.SIGKILL
        try:
            line = self.replies.readline()
            if line:
                end = json.loads(line)
                code = end["exit"] if "exit" in end else -int(end.get("signal", signal.SIGKILL))
        except (OSError, ValueError):
            pass
        self.returncode = code
        self._ended.set()

    def poll(self):
        return self.returncode if self._ended.is_set() else None

    def wait(self, timeout=None):
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"kernel {self.pid}", timeout)
        return self.returncode

    def signal(self, signum):
        line = (json.dumps({"signal": int(signum)}) + "\n").encode()
        try:
            with self._send_lock:
                self.sock.sendall(line)
        except OSError as e:
            log.debug("signal %d to kernel %d: %s", signum, self.pid, e)

    def kill(self):
        self.signal(signal.SIGKILL)

    def close(self):
        """Drops the connection (the agent kills the kernel if it still
        runs) and this side's pipe ends."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except (OSError, AttributeError):
            pass
        for f in (getattr(self, "replies", None), getattr(self, "sock", None)):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        self._close_pipes()

    def _close_pipes(self):
        for pipe in (self.stdin, self.stdout, self.stderr):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass


def check_agent_peer(sock):
    """The kernel socket must be the agent's (root in the sandbox): nothing
    else may hear what this server sends there."""
    if not hasattr(socket, "SO_PEERCRED"):
        return  # a path in a root-owned directory (not run on FreeBSD)
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
    _, uid, _ = struct.unpack("iII", creds)
    if uid != 0:
        raise RuntimeError(f"the kernel socket's owner is uid {uid}, not the agent")


def spawn_kernel(argv, cwd, env, pipes):
    """Starts a kernel process as the sandbox's user, in a session of its
    own. ``env`` is what the kernel needs beyond the user's environment."""
    cls = AgentKernelProcess if CONFIG.kernels == "agent" else LocalKernelProcess
    return cls(argv, cwd, env, pipes)


def kernel_env():
    env = {}
    # matplotlib figures come back as PNG display_data without any setup.
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    # Quiets debugpy's frozen-modules warning under Python 3.11.
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    env.setdefault("PAGER", "cat")
    return env


def kernel_connection():
    """Addresses and signing key for a new Python kernel. On Linux the
    sockets are abstract unix names (no files, nothing for anyone to
    replace, no TCP port for the port relay to expose); elsewhere TCP on
    the loopback (not run on FreeBSD). Either way messages are signed with a
    fresh key."""
    if sys.platform.startswith("linux"):
        transport, ip = "ipc", f"@copse-kernel-{uuid.uuid4().hex}"
        ports = [1, 2, 3, 4, 5]
    else:
        transport, ip = "tcp", "127.0.0.1"
        ports = []
        for _ in range(5):
            with socket.socket() as probe:
                probe.bind((ip, 0))
                ports.append(probe.getsockname()[1])
    names = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
    info = dict(zip(names, ports))
    info.update(transport=transport, ip=ip, key=uuid.uuid4().hex + uuid.uuid4().hex,
                signature_scheme="hmac-sha256")
    return info


# Run silently in each new kernel: turns off ANSI colours (tracebacks are
# plain text, as with E2B's NoColor config).
KERNEL_SETUP = """\
try:
    get_ipython().colors = 'NoColor'
    get_ipython().InteractiveTB.set_colors('NoColor')
except Exception:
    pass
"""


class PythonContext(Context):
    language = "python"

    def __init__(self, cwd):
        super().__init__(cwd)
        self.proc = None
        self.session = None
        self.zctx = None
        self.shell = None
        self.iopub = None
        self.dead = False

    # -- lifecycle ---------------------------------------------------------

    def start(self):
        import zmq
        from jupyter_client.session import Session

        t0 = time.monotonic()
        info = kernel_connection()
        env = kernel_env()
        env["COPSE_KERNEL_CONNECTION"] = json.dumps(info)
        self.proc = spawn_kernel(
            [sys.executable, PYTHON_KERNEL, "--InteractiveShell.colors=NoColor", "--HistoryManager.enabled=False"],
            self.cwd, env, pipes=False,
        )
        self.dead = False
        try:
            self.session = Session(key=info["key"].encode(), signature_scheme=info["signature_scheme"],
                                   username="copse")
            self.zctx = zmq.Context()

            def url(port):
                if info["transport"] == "tcp":
                    return f"tcp://{info['ip']}:{port}"
                return f"{info['transport']}://{info['ip']}-{port}"

            self.shell = self.zctx.socket(zmq.DEALER)
            self.shell.linger = 0
            self.shell.connect(url(info["shell_port"]))
            self.iopub = self.zctx.socket(zmq.SUB)
            self.iopub.linger = 0
            self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
            # Unbounded: a PUB socket drops what a full subscriber cannot
            # take, and a dropped "idle" status would hang the execution.
            self.iopub.setsockopt(zmq.RCVHWM, 0)
            self.iopub.connect(url(info["iopub_port"]))
            self._wait_ready()
            self._run_silent(KERNEL_SETUP)
        except Exception:
            self.shutdown()
            raise
        log.info("context %s: python kernel ready in %.0f ms (cwd %s)", self.id, (time.monotonic() - t0) * 1000, self.cwd)

    def _wait_ready(self):
        """Sends kernel_info_request until the reply and an iopub status for
        it have arrived (iopub is a PUB socket: until the subscription is
        through, its messages are lost)."""
        import zmq

        deadline = time.monotonic() + KERNEL_START_TIMEOUT
        sent = set()
        shell_ok = iopub_ok = False
        next_send = 0.0
        poller = zmq.Poller()
        poller.register(self.shell, zmq.POLLIN)
        poller.register(self.iopub, zmq.POLLIN)
        while not (shell_ok and iopub_ok):
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError("the python kernel did not become ready in time")
            if not self._alive():
                raise RuntimeError("the python kernel exited while starting")
            if now >= next_send:
                msg = self.session.send(self.shell, "kernel_info_request", {})
                sent.add(msg["header"]["msg_id"])
                next_send = now + 0.1
            for sock, _ in poller.poll(20):
                _, msg = self.session.recv(sock, mode=zmq.NOBLOCK)
                if msg is None:
                    continue
                if msg["parent_header"].get("msg_id") in sent:
                    if sock is self.shell:
                        shell_ok = True
                    else:
                        iopub_ok = True

    def _alive(self):
        return self.proc is not None and self.proc.poll() is None

    def needs_restart(self):
        return self.dead or self.proc is None

    def shutdown(self):
        for sock in (self.shell, self.iopub):
            if sock is not None:
                try:
                    sock.close(linger=0)
                except Exception:
                    pass
        self.shell = self.iopub = None
        if self.zctx is not None:
            try:
                self.zctx.term()
            except Exception:
                pass
            self.zctx = None
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.warning("context %s: kernel did not exit after SIGKILL", self.id)
            proc.close()

    def restart_locked(self):
        self.shutdown()
        self.envs_applied = False
        self.start()

    def force_stop(self):
        proc = self.proc
        if proc is not None:
            proc.kill()

    def interrupt(self):
        proc = self.proc
        if proc is not None:
            proc.signal(signal.SIGINT)

    # -- executions ----------------------------------------------------------

    def _drain_shell(self):
        import zmq

        while True:
            try:
                self.shell.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _recv_iopub(self, timeout):
        import zmq

        if not self.iopub.poll(int(timeout * 1000)):
            return None
        _, msg = self.session.recv(self.iopub, mode=zmq.NOBLOCK)
        return msg

    def _run_silent(self, code, timeout=15.0):
        """Runs bookkeeping code without history or output; logs errors."""
        msg = self.session.send(
            self.shell,
            "execute_request",
            {"code": code, "silent": True, "store_history": False, "user_expressions": {},
             "allow_stdin": False, "stop_on_error": False},
        )
        msg_id = msg["header"]["msg_id"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reply = self._recv_iopub(POLL_SECONDS)
            if reply is None:
                if not self._alive():
                    self.dead = True
                    return
                continue
            if reply["parent_header"].get("msg_id") != msg_id:
                continue
            if reply["msg_type"] == "error":
                log.warning("context %s: setup code failed: %s: %s", self.id,
                            reply["content"].get("ename"), reply["content"].get("evalue"))
            elif reply["msg_type"] == "status" and reply["content"].get("execution_state") == "idle":
                self._drain_shell()
                return
        log.warning("context %s: setup code did not finish in %ss", self.id, timeout)

    def reseed(self):
        self._run_silent("import random as _copse_random_\n_copse_random_.seed()\ndel _copse_random_\n")

    def set_envs_permanently(self, envs):
        self._run_silent(f"import os as _copse_os_\n_copse_os_.environ.update({envs!r})\ndel _copse_os_\n")

    def set_call_envs(self, env_vars):
        self._run_silent(
            "import os as _copse_os_\n"
            f"_copse_os_._copse_saved_env = [(_k, _copse_os_.environ.get(_k)) for _k in {list(env_vars)!r}]\n"
            f"_copse_os_.environ.update({env_vars!r})\n"
            "del _copse_os_\n"
        )

    def restore_call_envs(self, env_vars):
        self._run_silent(
            "def _copse_restore_env_():\n"
            "    import os\n"
            "    for k, v in getattr(os, '_copse_saved_env', []):\n"
            "        if v is None:\n"
            "            os.environ.pop(k, None)\n"
            "        else:\n"
            "            os.environ[k] = v\n"
            "    os._copse_saved_env = []\n"
            "_copse_restore_env_()\n"
            "del _copse_restore_env_\n"
        )

    def run_cell(self, code, sink):
        # stop_on_error=False: the broker sends one cell at a time, so there
        # is no queue to stop; with True, ipykernel aborts (empty reply, no
        # error) whatever request reaches it before it leaves the aborting
        # state an error or interrupt put it in, which is the next cell a
        # client sends right after a timeout.
        msg = self.session.send(
            self.shell,
            "execute_request",
            {"code": code, "silent": False, "store_history": True, "user_expressions": {},
             "allow_stdin": False, "stop_on_error": False},
        )
        msg_id = msg["header"]["msg_id"]
        interrupted_at = None
        errored = False
        last_check = time.monotonic()
        while True:
            reply = self._recv_iopub(POLL_SECONDS)
            if reply is not None and reply["parent_header"].get("msg_id") == msg_id:
                kind = reply["msg_type"]
                content = reply["content"]
                if kind == "status":
                    if content.get("execution_state") == "idle":
                        break
                    continue
                out = None
                if kind == "stream":
                    name = content.get("name")
                    if name in ("stdout", "stderr"):
                        out = {"type": name, "text": content.get("text", ""),
                               "timestamp": header_time(reply)}
                elif kind == "execute_input":
                    out = {"type": "number_of_executions", "execution_count": content.get("execution_count")}
                elif kind in ("execute_result", "display_data"):
                    out = mime_bundle_to_result(content.get("data") or {}, kind == "execute_result")
                elif kind == "error":
                    if not errored:
                        errored = True
                        out = {"type": "error", "name": content.get("ename", ""),
                               "value": content.get("evalue", ""),
                               "traceback": "\n".join(content.get("traceback") or [])}
                if out is not None:
                    sink.try_emit(out)
            now = time.monotonic()
            if reply is not None and now - last_check < POLL_SECONDS:
                continue
            last_check = now
            if not self._alive():
                log.warning("context %s: kernel died during an execution", self.id)
                self.dead = True
                sink.try_emit(unexpected_end_error())
                return
            if interrupted_at is None:
                if sink.client_gone():
                    log.info("context %s: client went away; interrupting the kernel", self.id)
                    interrupted_at = now
                    self.interrupt()
                else:
                    sink.keepalive_if_due()
            elif now - interrupted_at > CONFIG.interrupt_grace:
                log.warning("context %s: kernel ignored the interrupt; restarting it", self.id)
                self.dead = True
                self.force_stop()
                return
        self._drain_shell()


def header_time(msg):
    date = msg.get("header", {}).get("date")
    if isinstance(date, datetime.datetime):
        if date.tzinfo is None:
            date = date.replace(tzinfo=datetime.timezone.utc)
        return date.isoformat()
    if isinstance(date, str) and date:
        return date
    return now_iso()


# Jupyter MIME type -> E2B result key.
MIME_KEYS = (
    ("text/html", "html"),
    ("text/markdown", "markdown"),
    ("image/svg+xml", "svg"),
    ("image/png", "png"),
    ("image/jpeg", "jpeg"),
    ("application/pdf", "pdf"),
    ("text/latex", "latex"),
    ("application/json", "json"),
    ("application/javascript", "javascript"),
    ("e2b/data", "data"),
    ("e2b/chart", "chart"),
)


def mime_bundle_to_result(data, is_main_result):
    data = dict(data)
    out = {"type": "result"}
    text = data.pop("text/plain", None)
    if isinstance(text, str):
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
            text = text[1:-1]
        out["text"] = text
    for mime, key in MIME_KEYS:
        value = data.pop(mime, None)
        if value is not None:
            out[key] = value
    out["extra"] = data
    out["is_main_result"] = is_main_result
    return out


class BashContext(Context):
    language = "bash"

    def __init__(self, cwd):
        super().__init__(cwd)
        self.proc = None
        self.queue = None
        self.token = None
        # What the kernel put after the status in its last stdout sentinel.
        self.payload = ""
        self.count = 0
        self.dead = False

    def start(self):
        bash = shutil.which("bash") or "/bin/bash"
        self.token = f"__COPSE_{uuid.uuid4().hex}__"
        env = {"PS1": "", "PS2": "", "PS0": "", "PAGER": "cat"}
        self._spawn([bash, "--norc", "--noprofile", "--noediting", "-i"], env)
        setup = "set +H +o history; unset HISTFILE PROMPT_COMMAND; PS1=''; PS2=''; PS0=''"
        try:
            self._send(setup + "\n" + self._sentinel_line("0"))
            self._collect(None, grace=10.0)
        except Exception:
            self.shutdown()
            raise
        if self.dead:
            self.shutdown()
            raise RuntimeError("bash exited while starting")
        log.info("context %s: bash ready (cwd %s)", self.id, self.cwd)

    def _spawn(self, argv, env):
        """Starts the context's process in a session of its own (interrupts
        go to its group), with a reader thread per output pipe."""
        self.proc = spawn_kernel(argv, self.cwd, env, pipes=True)
        self.queue = queue.Queue()
        self.dead = False
        for name, pipe in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr)):
            threading.Thread(target=self._reader, args=(name, pipe, self.queue), daemon=True,
                             name=f"{self.language}-{name}").start()

    @staticmethod
    def _reader(name, pipe, q):
        fd = pipe.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                q.put((name, None))
                return
            q.put((name, chunk))

    def _sentinel_line(self, status):
        tok = self.token
        return f"printf '%s%s\\n' '{tok}' \"{status}\"; printf '%s' '{tok}' >&2\n"

    def _send(self, text):
        try:
            self.proc.stdin.write(text.encode("utf-8"))
            self.proc.stdin.flush()
        except (OSError, ValueError):
            self.dead = True

    def _collect(self, sink, grace=None):
        """Streams output until both sentinels arrive. Returns the exit status
        (int) or None if bash died or was killed. With sink None, output is
        dropped and `grace` bounds the wait."""
        tok = self.token
        decoders = {n: codecs.getincrementaldecoder("utf-8")("replace") for n in ("stdout", "stderr")}
        pending = {"stdout": "", "stderr": ""}
        done = {"stdout": False, "stderr": False}
        status = None
        interrupted_at = time.monotonic() if grace is not None else None
        last_check = time.monotonic()

        def emit(name, text):
            if text and sink is not None:
                sink.try_emit({"type": name, "text": text, "timestamp": now_iso()})

        while not (done["stdout"] and done["stderr"]):
            try:
                name, chunk = self.queue.get(timeout=POLL_SECONDS)
            except queue.Empty:
                name = chunk = None
            if name is not None:
                if chunk is None:
                    self.dead = True
                    emit(name, pending[name] + decoders[name].decode(b"", final=True))
                    pending[name] = ""
                    if sink is not None:
                        sink.try_emit(unexpected_end_error())
                    return None
                if not done[name]:
                    buf = pending[name] + decoders[name].decode(chunk)
                    idx = buf.find(tok)
                    if idx >= 0:
                        if name == "stdout":
                            end = buf.find("\n", idx)
                            if end < 0:
                                pending[name] = buf  # the status has not arrived yet
                                continue
                            status_text, _, self.payload = buf[idx + len(tok):end].partition(" ")
                            try:
                                status = int(status_text.strip() or "0")
                            except ValueError:
                                status = 1
                        emit(name, buf[:idx])
                        pending[name] = ""
                        done[name] = True
                    else:
                        keep = partial_suffix(buf, tok)
                        emit(name, buf[: len(buf) - keep])
                        pending[name] = buf[len(buf) - keep:]
            now = time.monotonic()
            if name is not None and now - last_check < POLL_SECONDS:
                continue
            last_check = now
            if self.proc.poll() is not None:
                self.dead = True
                if sink is not None:
                    sink.try_emit(unexpected_end_error())
                return None
            if interrupted_at is None:
                if sink is not None and sink.client_gone():
                    log.info("context %s: client went away; interrupting bash", self.id)
                    interrupted_at = now
                    self.interrupt()
                elif sink is not None:
                    sink.keepalive_if_due()
            elif now - interrupted_at > (grace if grace is not None else CONFIG.interrupt_grace):
                log.warning("context %s: bash did not finish after an interrupt; killing it", self.id)
                self.dead = True
                self.force_stop()
                return None
        return status

    def interrupt(self):
        self.proc.signal(signal.SIGINT)

    def force_stop(self):
        proc = self.proc
        if proc is not None:
            proc.kill()

    def needs_restart(self):
        return self.dead or self.proc is None or self.proc.poll() is not None

    def shutdown(self):
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    pipe.close()
                except Exception:
                    pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            proc.close()

    def restart_locked(self):
        self.shutdown()
        self.envs_applied = False
        self.count = 0
        self.start()

    def _run_quiet(self, script):
        self._send(script + "\n" + self._sentinel_line("$?"))
        self._collect(None, grace=10.0)

    def set_envs_permanently(self, envs):
        parts = [f"export {k}={shlex.quote(v)}" for k, v in envs.items() if ENV_NAME.match(k)]
        if parts:
            self._run_quiet("; ".join(parts))

    def set_call_envs(self, env_vars):
        parts = []
        for i, (k, v) in enumerate(env_vars.items()):
            parts.append(f"__copse_isset_{i}=${{{k}+x}}; __copse_saved_{i}=${{{k}-}}; export {k}={shlex.quote(v)}")
        self._run_quiet("; ".join(parts))

    def restore_call_envs(self, env_vars):
        parts = []
        for i, k in enumerate(env_vars):
            parts.append(
                f"if [ -n \"$__copse_isset_{i}\" ]; then export {k}=\"$__copse_saved_{i}\"; else unset {k}; fi; "
                f"unset __copse_isset_{i} __copse_saved_{i}"
            )
        self._run_quiet("; ".join(parts))

    def _begin_cell(self, sink):
        """Drops output left over from background jobs or timers (it belongs
        to no execution) and numbers the cell; False if the process died."""
        while True:
            try:
                _, chunk = self.queue.get_nowait()
            except queue.Empty:
                break
            if chunk is None:
                self.dead = True
                sink.try_emit(unexpected_end_error())
                return False
        self.count += 1
        sink.try_emit({"type": "number_of_executions", "execution_count": self.count})
        return True

    def run_cell(self, code, sink):
        if not self._begin_cell(sink):
            return
        # The cell travels on bash's stdin as a quoted here-document (no file:
        # this server's files are not the user's to read, nor the reverse),
        # which `source` reads whole before it runs any of it, so the cell's
        # commands find their stdin at its end, as with </dev/null.
        delimiter = f"__COPSE_CELL_{uuid.uuid4().hex}__"
        if not code.endswith("\n"):
            code += "\n"
        # Two commands: an interrupt abandons the first, never the second.
        self._send(f"source /dev/stdin <<'{delimiter}'\n{code}{delimiter}\n" + self._sentinel_line("$?"))
        status = self._collect(sink)
        if status:
            sink.try_emit({"type": "error", "name": "", "value": str(status), "traceback": ""})


def partial_suffix(buf, token):
    """Length of the longest suffix of buf that is a proper prefix of token."""
    for k in range(min(len(buf), len(token) - 1), 0, -1):
        if buf.endswith(token[:k]):
            return k
    return 0


class JavaScriptContext(BashContext):
    """A Node.js process running copse_js_kernel.mjs; it speaks the bash
    context's sentinel protocol, with JSON commands instead of shell lines."""

    language = "javascript"
    kernel_args = ()

    def start(self):
        self.token = f"__COPSE_{uuid.uuid4().hex}__"
        env = {"COPSE_KERNEL_TOKEN": self.token, "PAGER": "cat"}
        # V8 guards WebAssembly code with a memory protection key where the
        # CPU has them; a kernel restored from a memory snapshot no longer
        # owns that key (CRIU does not restore pkey allocations), so its
        # first wasm compile - `import()` of a CommonJS package parses it
        # with wasm - aborted the kernel as "out of memory".
        node = [shutil.which("node") or "node", "--no-wasm-memory-protection-keys"]
        self._spawn([*node, JS_KERNEL, *self.kernel_args], env)
        try:
            self._command({"op": "env", "envs": {}})
        except Exception:
            self.shutdown()
            raise
        if self.dead:
            self.shutdown()
            raise RuntimeError(f"the {self.language} kernel exited while starting")
        log.info("context %s: %s ready (cwd %s)", self.id, self.language, self.cwd)

    def _command(self, command, sink=None):
        self._send(json.dumps(command) + "\n")
        return self._collect(sink) if sink is not None else self._collect(None, grace=10.0)

    def set_envs_permanently(self, envs):
        self._command({"op": "env", "envs": envs})

    def set_call_envs(self, env_vars):
        self._command({"op": "push_env", "envs": env_vars})

    def restore_call_envs(self, env_vars):
        self._command({"op": "pop_env"})

    def run_cell(self, code, sink):
        if not self._begin_cell(sink):
            return
        self.payload = ""
        if self._command({"op": "run", "code": code}, sink) is None:
            return  # the kernel died or was killed; already reported
        try:
            outcome = json.loads(self.payload)
            if not isinstance(outcome, dict):
                raise ValueError("not an object")
        except ValueError:
            sink.try_emit(unexpected_end_error("The kernel left no result"))
            return
        if "error" in outcome:
            error = outcome["error"]
            sink.try_emit({"type": "error", "name": error.get("name", "Error"), "value": error.get("value", ""),
                           "traceback": error.get("traceback", "")})
        elif "result" in outcome:
            sink.try_emit(mime_bundle_to_result(outcome["result"], True))


class TypeScriptContext(JavaScriptContext):
    language = "typescript"
    kernel_args = ("--typescript",)


CONTEXT_CLASSES = {"python": PythonContext, "bash": BashContext, "javascript": JavaScriptContext,
                   "typescript": TypeScriptContext}


def check_cwd(cwd):
    """Refuses a cwd that is surely not a directory. One this server may not
    look into (a private directory of the user's) is left to the kernel's
    start, which runs as that user."""
    try:
        if not stat.S_ISDIR(os.stat(cwd).st_mode):
            raise BadRequest(f"cwd {cwd!r} is not a directory")
    except (FileNotFoundError, NotADirectoryError):
        raise BadRequest(f"cwd {cwd!r} is not a directory")
    except PermissionError:
        if CONFIG.kernels == "local":
            raise BadRequest(f"cwd {cwd!r} is not accessible")


class Registry:
    def __init__(self):
        self.lock = threading.Lock()
        self.contexts = {}
        self.defaults = {}
        self.default_locks = {lang: threading.Lock() for lang in SUPPORTED_LANGUAGES}
        self.ready = threading.Event()
        self.ready_at = None

    def create(self, language, cwd):
        check_language(language)
        # Relative to the default directory, as it was to this server's own
        # when it ran in the user's home.
        cwd = os.path.join(CONFIG.default_cwd, cwd)
        check_cwd(cwd)
        ctx = CONTEXT_CLASSES[language](cwd)
        ctx.start()
        with self.lock:
            self.contexts[ctx.id] = ctx
        return ctx

    def get(self, context_id):
        with self.lock:
            ctx = self.contexts.get(context_id)
        if ctx is None:
            raise BadRequest(f"Context {context_id} not found", 404)
        return ctx

    def default(self, language):
        check_language(language)
        with self.default_locks[language]:
            with self.lock:
                ctx = self.contexts.get(self.defaults.get(language))
            if ctx is None:
                ctx = self.create(language, CONFIG.default_cwd)
                with self.lock:
                    self.defaults[language] = ctx.id
            return ctx

    def list(self):
        with self.lock:
            return [c.describe() for c in self.contexts.values()]

    def remove(self, context_id):
        with self.lock:
            ctx = self.contexts.pop(context_id, None)
            if ctx is not None:
                for lang, cid in list(self.defaults.items()):
                    if cid == context_id:
                        del self.defaults[lang]
        if ctx is None:
            raise BadRequest(f"Context {context_id} not found", 404)
        ctx.close()

    def shutdown_all(self):
        with self.lock:
            contexts = list(self.contexts.values())
        # Only kills the processes: executions may still hold the sockets.
        for ctx in contexts:
            try:
                ctx.force_stop()
            except Exception:
                pass


REGISTRY = Registry()


# ---------------------------------------------------------------------------
# HTTP


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "copse-interpreter"

    def version_string(self):
        return self.server_version

    def setup(self):
        super().setup()
        try:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass

    def log_message(self, fmt, *args):
        log.debug("%s %s", self.address_string(), fmt % args)

    # -- plumbing ----------------------------------------------------------

    def _headers_common(self):
        self.send_header("Access-Control-Allow-Origin", "*")

    def send_json(self, status, obj, headers=None):
        body = json.dumps(obj).encode("utf-8")
        self.send_response(status)
        self._headers_common()
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def read_body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks, total = [], 0
            while True:
                line = self.rfile.readline(1024)
                try:
                    size = int(line.split(b";")[0].strip(), 16)
                except ValueError:
                    raise BadRequest("malformed chunked body")
                if size == 0:
                    while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                total += size
                if total > MAX_BODY_BYTES:
                    self.close_connection = True
                    raise BadRequest("request body too large", 413)
                chunks.append(self.rfile.read(size))
                self.rfile.readline(1024)
            return b"".join(chunks)
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            raise BadRequest("invalid Content-Length")
        if length < 0 or length > MAX_BODY_BYTES:
            self.close_connection = True
            raise BadRequest("request body too large", 413)
        return self.rfile.read(length) if length else b""

    def read_json(self, allow_empty):
        body = self.read_body()
        if not body.strip():
            if allow_empty:
                return {}
            raise BadRequest("request body is required")
        try:
            data = json.loads(body)
        except ValueError as e:
            raise BadRequest(f"invalid JSON body: {e}")
        if not isinstance(data, dict):
            raise BadRequest("request body must be a JSON object")
        return data

    def dispatch(self, method):
        path = urllib.parse.urlsplit(self.path).path.rstrip("/") or "/"
        try:
            route = self.route(method, path)
            if route is not None and not self.authorised(method, path):
                self.read_body()
                self.send_json(401, {"code": 401, "message": "unauthorized access, please provide a valid access token"})
                return
            if path != "/health":
                # The first request after a restore (or a boot) comes from
                # the sandbox's own user; warming on it never delays a
                # sandbox, and a Node.js start is most of a first
                # JavaScript call.
                warm_after_restore()
            if route is None:
                # Drain any body so the connection stays usable.
                self.read_body()
                self.send_json(404, {"error": f"no route for {method} {path}"})
                return
            route()
        except BadRequest as e:
            self.send_json(e.status, {"error": str(e)})
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:
            log.exception("%s %s failed", method, path)
            self.close_connection = True
            try:
                self.send_json(500, {"error": f"internal error: {e}"})
            except OSError:
                pass

    def authorised(self, method, path):
        """Whether the caller may use this route. The agent relays requests
        here without the access token; it tells whether the caller presented
        one (dropping any such header the caller sent itself). Only running
        code needs it: the official SDKs send the token on ``/execute`` and
        nowhere else, as E2B's server checks it there alone."""
        if not (method == "POST" and path == "/execute"):
            return True
        return not CONFIG.require_caller or self.headers.get(CALLER_AUTHENTICATED) == "1"

    def route(self, method, path):
        parts = [p for p in path.split("/") if p]
        if method == "GET" and parts == ["health"]:
            return self.get_health
        if method == "POST" and parts == ["execute"]:
            return self.post_execute
        if parts[:1] == ["contexts"]:
            if len(parts) == 1 and method == "GET":
                return self.get_contexts
            if len(parts) == 1 and method == "POST":
                return self.post_contexts
            if len(parts) == 2 and method == "DELETE":
                return lambda: self.delete_context(parts[1])
            if len(parts) == 3 and parts[2] == "restart" and method == "POST":
                return lambda: self.restart_context(parts[1])
        return None

    def do_GET(self):
        self.dispatch("GET")

    def do_POST(self):
        self.dispatch("POST")

    def do_DELETE(self):
        self.dispatch("DELETE")

    def do_PUT(self):
        self.dispatch("PUT")

    def do_PATCH(self):
        self.dispatch("PATCH")

    def do_OPTIONS(self):
        self.read_body()
        self.send_response(204)
        self._headers_common()
        self.send_header("Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "*")
        self.send_header("Content-Length", "0")
        self.end_headers()

    # -- routes --------------------------------------------------------------

    def get_health(self):
        if REGISTRY.ready.is_set():
            # When the default kernel became ready: a sandbox restored from
            # a memory snapshot reports a time before its own creation.
            self.send_json(200, "OK", headers={READY_AT_HEADER: f"{REGISTRY.ready_at:.6f}"})
        else:
            self.send_json(503, {"error": "the default python kernel is starting"})

    def get_contexts(self):
        self.send_json(200, REGISTRY.list())

    def post_contexts(self):
        data = self.read_json(allow_empty=True)
        language = normalize_language(data.get("language"))
        check_language(language)
        cwd = data.get("cwd") or CONFIG.default_cwd
        if not isinstance(cwd, str):
            raise BadRequest("cwd must be a string")
        ctx = REGISTRY.create(language, cwd)
        self.send_json(200, ctx.describe())

    def restart_context(self, context_id):
        self.read_body()
        ctx = REGISTRY.get(context_id)
        ctx.restart()
        self.send_json(200, None)

    def delete_context(self, context_id):
        self.read_body()
        REGISTRY.remove(context_id)
        self.send_json(200, None)

    def post_execute(self):
        data = self.read_json(allow_empty=False)
        code = data.get("code")
        if not isinstance(code, str):
            raise BadRequest("code must be a string")
        context_id = data.get("context_id")
        language = data.get("language")
        if context_id is not None and not isinstance(context_id, str):
            raise BadRequest("context_id must be a string")
        if context_id and language:
            raise BadRequest("Only one of context_id or language can be provided")
        if context_id:
            ctx = REGISTRY.get(context_id)
        else:
            ctx = REGISTRY.default(normalize_language(language))
        env_vars = check_env_vars(data.get("env_vars"), ctx.language)

        self.send_response(200)
        self._headers_common()
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        sink = Sink(self)
        t0 = time.monotonic()
        if not ctx.acquire(sink):
            log.info("context %s: client left while waiting for the context", ctx.id)
            self.close_connection = True
            return
        try:
            ctx.execute(code, env_vars, sink)
        except Exception as e:
            log.exception("context %s: execution failed", ctx.id)
            sink.try_emit({"type": "error", "name": type(e).__name__, "value": str(e),
                           "traceback": traceback.format_exc()})
        finally:
            ctx.lock.release()
        sink.try_emit({"type": "end_of_execution"})
        if not sink.gone:
            try:
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                sink.gone = True
        if sink.gone:
            self.close_connection = True
        log.debug("context %s: execution took %.1f ms", ctx.id, (time.monotonic() - t0) * 1000)


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def handle_error(self, request, client_address):
        log.debug("connection from %s ended with an error", client_address, exc_info=True)


def resolve_default_cwd(cwd):
    if os.path.isdir(cwd):
        return cwd
    fallback = os.environ.get("HOME") or os.getcwd()
    log.warning("default cwd %s does not exist; using %s", cwd, fallback)
    return fallback


def warm_default(language):
    try:
        REGISTRY.default(language)
    except Exception:
        log.exception("warming the default %s context failed; it starts on first use", language)


_warm_after_restore = threading.Lock()
_warmed_after_restore = False


def warm_after_restore():
    """Starts, once, what must not be in a memory snapshot: the default
    JavaScript context (see the module's docstring)."""
    global _warmed_after_restore
    with _warm_after_restore:
        if _warmed_after_restore:
            return
        _warmed_after_restore = True
    if "javascript" in SUPPORTED_LANGUAGES:
        threading.Thread(target=warm_default, args=("javascript",), daemon=True, name="warm-js").start()


def main(argv=None):
    parser = argparse.ArgumentParser(description="E2B-compatible code interpreter server (runs inside a sandbox)")
    parser.add_argument("--port", type=int, default=49999)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--default-cwd", default=DEFAULT_CWD, help="working directory of default contexts")
    parser.add_argument("--envd-url", default=CONFIG.envd_url,
                        help="agent base URL (http://HOST:PORT or unix:/PATH) for the sandbox-wide "
                             "variables; empty to skip")
    parser.add_argument("--no-auth", action="store_true",
                        help="serve callers the agent did not vouch for (outside a sandbox only)")
    parser.add_argument("--kernels", choices=("agent", "local"), default="agent",
                        help="who starts kernels: the sandbox's agent, as the sandbox's user, or this "
                             "server, as itself (outside a sandbox only)")
    parser.add_argument("--keepalive", type=float, default=KEEPALIVE_SECONDS,
                        help="seconds of silence before a keepalive line")
    parser.add_argument("--interrupt-grace", type=float, default=INTERRUPT_GRACE_SECONDS,
                        help="seconds an interrupted cell may take before its kernel is restarted")
    parser.add_argument("--log-level", default=os.environ.get("COPSE_INTERPRETER_LOG", "INFO"))
    args = parser.parse_args(argv)

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    CONFIG.keepalive = args.keepalive
    CONFIG.interrupt_grace = args.interrupt_grace
    CONFIG.envd_url = args.envd_url
    CONFIG.require_caller = not args.no_auth
    CONFIG.kernels = args.kernels
    CONFIG.default_cwd = resolve_default_cwd(args.default_cwd)
    # debugpy (imported by ipykernel) warns about frozen modules otherwise.
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    if "HOME" not in os.environ:
        try:
            os.environ["HOME"] = pwd.getpwuid(os.getuid()).pw_dir
        except KeyError:
            pass

    server = Server((args.host, args.port), Handler)
    log.info("listening on %s:%d", args.host, args.port)
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()

    def stop(signum, frame):
        log.info("signal %d: shutting down", signum)
        try:
            server.socket.close()
        except OSError:
            pass
        REGISTRY.shutdown_all()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    # The default Python kernel starts before /health turns 200, so a pooled
    # sandbox is handed out with a warm kernel.
    for attempt in range(1, 4):
        try:
            REGISTRY.default("python")
            break
        except Exception:
            log.exception("starting the default python kernel failed (attempt %d of 3)", attempt)
            time.sleep(1)
    else:
        log.error("no python kernel; exiting")
        os._exit(1)
    REGISTRY.ready_at = time.time()
    REGISTRY.ready.set()
    log.info("ready")
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
