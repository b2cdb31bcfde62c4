"""Drive a real copse-agent with the official E2B Python SDK (e2b==2.63.0).

Not part of `cargo test` (needs Python and the SDK); run by hand:

    python -m venv /work/venv-agent && /work/venv-agent/bin/pip install e2b==2.63.0
    cargo build -p copse-agent
    sudo /work/venv-agent/bin/python tests/sdk/e2e.py target/debug/copse-agent

It starts the agent on a unix socket with a scratch passwd in which "user"
is uid 0 (so it runs on any host as root), a tiny control-plane mock for
`Sandbox.connect`, and a TCP→unix byte forwarder standing in for the gateway.
"""

import asyncio
import base64
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = "e2e-token"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class ControlPlane(BaseHTTPRequestHandler):
    def do_POST(self):
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        body = (
            '{"sandboxID":"sbx1","templateID":"base","clientID":"c",'
            '"envdVersion":"0.6.4","envdAccessToken":"%s"}' % TOKEN
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def forwarder(port, sock_path):
    async def handle(reader, writer):
        ur, uw = await asyncio.open_unix_connection(sock_path)

        async def pipe(r, w):
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except Exception:
                pass
            finally:
                try:
                    w.close()
                except Exception:
                    pass

        await asyncio.gather(pipe(reader, uw), pipe(ur, writer))

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok -", what)


def main():
    agent = sys.argv[1]
    tmp = tempfile.mkdtemp()
    home = os.path.join(tmp, "home")
    os.makedirs(home)
    etc = os.path.join(tmp, "etc")
    os.makedirs(etc)
    with open(os.path.join(etc, "passwd"), "w") as f:
        f.write(f"root:x:0:0:root:/root:/bin/bash\nuser:x:0:0::{home}:/bin/bash\n")
    with open(os.path.join(etc, "group"), "w") as f:
        f.write("root:x:0:\n")
    sock = os.path.join(tmp, "agent.sock")
    proc = subprocess.Popen(
        [agent, "serve", "--socket", sock, "--access-token", TOKEN, "--etc-dir", etc]
    )
    for _ in range(100):
        if os.path.exists(sock):
            break
        time.sleep(0.05)

    api_port, sbx_port = free_port(), free_port()
    api = ThreadingHTTPServer(("127.0.0.1", api_port), ControlPlane)
    threading.Thread(target=api.serve_forever, daemon=True).start()
    threading.Thread(target=forwarder, args=(sbx_port, sock), daemon=True).start()
    time.sleep(0.2)

    os.environ.update(
        E2B_API_KEY="k",
        E2B_API_URL=f"http://127.0.0.1:{api_port}",
        E2B_SANDBOX_URL=f"http://127.0.0.1:{sbx_port}",
        E2B_CONNECTION_RETRIES="0",
    )
    from e2b import Sandbox, CommandExitException
    from e2b.sandbox.commands.command_handle import PtySize

    try:
        sbx = Sandbox.connect("sbx1")
        check(sbx.is_running(), "health")

        r = sbx.commands.run("echo hello; echo err >&2; pwd; whoami")
        check(r.stdout == f"hello\n{home}\nroot\n" and r.stderr == "err\n", f"run: {r}")

        try:
            sbx.commands.run("exit 3")
            check(False, "exit 3 raises")
        except CommandExitException as e:
            check(e.exit_code == 3 and e.error == "exit status 3", f"exit code 3: {e.error}")

        r = sbx.commands.run("echo $FOO", envs={"FOO": "bar"}, cwd="/tmp")
        check(r.stdout == "bar\n", "envs")

        r = sbx.commands.run("head -c 3000000 /dev/zero | tr '\\0' a")
        check(len(r.stdout) == 3000000, "3 MB stdout")

        h = sbx.commands.run("cat", background=True, stdin=True)
        sbx.commands.send_stdin(h.pid, "piped\n")
        sbx.commands.close_stdin(h.pid)
        r = h.wait()
        check(r.stdout == "piped\n", "stdin + close_stdin")

        h = sbx.commands.run("sleep 30", background=True)
        check(any(p.pid == h.pid for p in sbx.commands.list()), "list")
        check(sbx.commands.kill(h.pid), "kill")
        try:
            h.wait()
            check(False, "killed command raises")
        except CommandExitException as e:
            check(e.error == "signal: killed", f"killed status: {e.error}")
        check(not sbx.commands.kill(h.pid), "kill of a gone process is False")

        h = sbx.commands.run("sleep 0.5; echo late", background=True)
        h2 = sbx.commands.connect(h.pid)
        check(h2.wait().stdout == "late\n", "connect")

        w = sbx.files.write("dir/a.txt", "content")
        check(w.path == f"{home}/dir/a.txt", f"write: {w}")
        check(sbx.files.read("dir/a.txt") == "content", "read")
        sbx.files.write_files([
            {"path": "/tmp/e2e-multi/1", "data": b"one"},
            {"path": "/tmp/e2e-multi/2", "data": b"two"},
        ])
        check(sbx.files.read("/tmp/e2e-multi/2") == "two", "write_files")
        import io
        sbx.files.write("big.bin", io.BytesIO(b"x" * 5_000_000))
        check(len(sbx.files.read("big.bin", format="bytes")) == 5_000_000, "octet-stream upload")
        entries = sbx.files.list("dir")
        check([e.name for e in entries] == ["a.txt"] and entries[0].size == 7, f"list: {entries}")
        info = sbx.files.get_info("dir/a.txt")
        check(info.permissions == "-rw-r--r--" and info.owner == "root", f"get_info: {info}")
        check(sbx.files.exists("dir/a.txt") and not sbx.files.exists("nope"), "exists")
        check(sbx.files.make_dir("newdir") and not sbx.files.make_dir("newdir"), "make_dir")
        sbx.files.rename("dir/a.txt", "dir/b.txt")
        check(sbx.files.exists("dir/b.txt"), "rename")
        sbx.files.remove("dir")
        check(not sbx.files.exists("dir"), "remove")
        try:
            sbx.files.read("missing.txt")
            check(False, "missing read raises")
        except Exception as e:
            check(type(e).__name__ == "FileNotFoundException", f"missing read: {type(e).__name__}")

        handle = sbx.files.watch_dir(home)
        sbx.files.write("watched.txt", "x")
        time.sleep(0.3)
        events = handle.get_new_events()
        handle.stop()
        check(any(e.name == "watched.txt" for e in events), f"watch_dir: {events}")

        w = sbx.files.write("/tmp/e2e-meta.txt", "m", metadata={"Color": "blue"})
        info = sbx.files.get_info("/tmp/e2e-meta.txt")
        check(info.metadata in ({"color": "blue"}, None), f"metadata: {info.metadata}")

        r = sbx.commands.run("whoami", user="root")
        check(r.stdout == "root\n", "user=root via Basic auth")

        url = sbx.download_url("watched.txt")
        check(urllib.request.urlopen(url).read() == b"x", "signed download_url")

        t = sbx.pty.create(PtySize(rows=24, cols=80))
        sbx.pty.resize(t.pid, PtySize(rows=30, cols=100))
        sbx.pty.send_stdin(t.pid, b"stty size; exit\n")
        data = bytearray()
        t.wait(on_pty=lambda d: data.extend(d))
        check(b"30 100" in data, f"pty: {bytes(data)[-200:]!r}")
    finally:
        proc.terminate()
        proc.wait()
    print("all SDK checks passed")


if __name__ == "__main__":
    main()
