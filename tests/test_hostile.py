"""Attacks a sandbox's root can make on the host, each answered without
the host following what the sandbox wrote. Every feature that lets a
sandbox write something the host later reads adds its attack here."""

import base64
import contextlib
import hashlib
import http.client
import json
import os
import pathlib
import select
import socket
import secrets
import shutil
import ssl
import stat
import subprocess
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import API_KEY, COPSE, DATA_DIR, create_refused, free_port, none_created
from e2b import (
    CommandExitException, InvalidArgumentException, RateLimitException, Sandbox, SandboxException, Secret, Volume,
)


class HostSocket:
    """A unix socket on the host that a sandbox must never reach: it
    records every connection it is offered."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="copse-hostile-")
        self.path = os.path.join(self.dir, "host.sock")
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.path)
        self.server.listen(8)
        self.server.settimeout(0.2)
        self.connections = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while not self.stopped.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self):
        self.stopped.set()
        self.thread.join(timeout=5)
        self.server.close()
        os.unlink(self.path)
        os.rmdir(self.dir)


@pytest.fixture
def host_socket():
    target = HostSocket()
    yield target
    target.close()


def test_root_in_a_sandbox_cannot_steer_the_gateway_to_a_host_socket(gateway, host_socket):
    """Sandbox root replaces its agent's socket with a symlink to a host
    socket; requests for the sandbox (envd and any port) are refused with
    a 502 and the host socket is never connected to."""
    sbx = Sandbox.create(timeout=60)
    try:
        result = sbx.commands.run(
            f"ln -s {host_socket.path} /.copse/run/planted && mv -T /.copse/run/planted /.copse/run/agent.sock"
            " && readlink /.copse/run/agent.sock",
            user="root",
        )
        assert result.stdout.strip() == host_socket.path

        # A sandbox port by host name, and envd through the SDK.
        response = httpx.get(f"{gateway.url}/", headers={"host": f"8000-{sbx.sandbox_id}.copse.test"}, timeout=10)
        assert response.status_code == 502, response.text
        with pytest.raises(Exception):
            sbx.commands.run("true", timeout=10)
        time.sleep(0.5)  # one accept poll: a connection would be counted by now
        assert host_socket.connections == 0
    finally:
        sbx.kill()


# --- Disk: every sandbox's writable layer is limited to its disk quota ---

MIB = 1024 * 1024


def test_filling_the_disk_with_dd_stops_at_the_quota_and_neighbours_still_write(gateway):
    """Root and `user` in one sandbox write until the disk refuses: the
    kernel stops them near the quota (EDQUOT), and another sandbox can
    still write, as can the filler once it deletes what it wrote."""
    from conftest import DISK_MB

    filler = Sandbox.create(timeout=120)
    neighbour = Sandbox.create(timeout=120)
    try:
        over = DISK_MB + 64
        for user, path in (("user", "/home/user/fill"), ("root", "/root/fill")):
            result = filler.commands.run(
                f"dd if=/dev/zero of={path} bs=1M count={over} conv=fsync 2>&1; echo rc=$?; stat -c size=%s {path}",
                user=user,
                timeout=120,
            )
            out = result.stdout
            assert "rc=0" not in out, f"{user} wrote {over} MiB into a {DISK_MB} MiB disk: {out}"
            assert "Disk quota exceeded" in out or "No space left" in out, out
            size = int(out.rsplit("size=", 1)[1])
            assert size <= DISK_MB * MIB, f"{size} bytes written past a {DISK_MB} MiB quota"
            assert size >= DISK_MB * MIB // 2, f"the disk refused long before its quota: {size} bytes"

            # The filler is full; its neighbour is not.
            result = neighbour.commands.run(f"dd if=/dev/zero of=/home/user/{user} bs=1M count=32 conv=fsync && echo ok")
            assert result.stdout.strip().endswith("ok")
            # Deleting frees the space again.
            filler.commands.run(f"rm {path}", user=user)

        result = filler.commands.run("dd if=/dev/zero of=/root/again bs=1M count=32 conv=fsync && echo ok", user="root")
        assert result.stdout.strip().endswith("ok")
    finally:
        filler.kill()
        neighbour.kill()


def test_an_upload_past_the_quota_fails_cleanly(gateway):
    """A caller uploads more than the sandbox's disk holds: the upload is
    refused with E2B's 507 (the SDK's NotEnoughSpaceException), no partial
    file is left filling the disk, and the agent keeps serving."""
    from conftest import DISK_MB
    from e2b import NotEnoughSpaceException

    sbx = Sandbox.create(timeout=120)
    try:
        with pytest.raises(NotEnoughSpaceException):
            sbx.files.write("/home/user/big.bin", b"\0" * ((DISK_MB + 32) * MIB), request_timeout=120)
        assert not sbx.files.exists("/home/user/big.bin")
        sbx.files.write("/home/user/small.txt", "still works")
        assert sbx.files.read("/home/user/small.txt") == "still works"
        result = sbx.commands.run("dd if=/dev/zero of=/home/user/f bs=1M count=32 conv=fsync && echo ok")
        assert result.stdout.strip().endswith("ok")
    finally:
        sbx.kill()


def test_metrics_report_the_quota_as_disk_total(gateway):
    """disk_total is the quota the kernel enforces; disk_used is what the
    sandbox wrote, as the quota counts it."""
    from conftest import DISK_MB

    sbx = Sandbox.create(timeout=120)
    try:
        sbx.commands.run("dd if=/dev/zero of=/home/user/ballast bs=1M count=48 conv=fsync")
        written = time.time()
        from conftest import first_metrics

        m = first_metrics(sbx, after=written)[-1]
        assert m.disk_total == DISK_MB * MIB
        assert 48 * MIB <= m.disk_used <= m.disk_total
    finally:
        sbx.kill()


def test_no_btrfs_subvolume_can_be_made_from_inside_a_sandbox(gateway):
    """A btrfs subvolume has its own, unlimited, quota group: a sandbox that
    could make one where its files live would escape its quota. Neither its
    root nor its socket directory passes the ioctl to btrfs."""
    sbx = Sandbox.create(timeout=60)
    try:
        script = (
            "import fcntl, os, struct\n"
            "SUBVOL_CREATE = 0x5000940E\n"
            "for d in ['/', '/home/user', '/tmp', '/.copse/run']:\n"
            "    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)\n"
            "    args = bytearray(struct.pack('q4088s', 0, b'escape'))\n"
            "    try:\n"
            "        fcntl.ioctl(fd, SUBVOL_CREATE, args, True)\n"
            "        print('made', d)\n"
            "    except OSError as e:\n"
            "        print('refused', d, e.errno)\n"
        )
        sbx.files.write("/root/subvol.py", script, user="root")
        out = sbx.commands.run("python3 /root/subvol.py", user="root").stdout
        assert "made" not in out, out
        assert out.count("refused") == 4, out
    finally:
        sbx.kill()


# --- A caller with bad input, and a local host user ---------------------------------
# The gateway itself: what anyone who can reach its port (or read the host's
# files) can try without a key, or with a wrong one.

# The gateway's defaults (serve::Limits); the suite's gateway runs with them.
HEADER_TIMEOUT_S = 10
MAX_CONNECTIONS_PER_CLIENT = 256


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the peer closes `sock` (EOF or reset) within `seconds`;
    whatever it sends before that is read and ignored."""
    sock.settimeout(seconds)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            if not sock.recv(4096):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    return False


def _list_sandboxes() -> list:
    """What `Sandbox.list()` returns, first page: a real API call."""
    return Sandbox.list().next_items()


def _connect(gateway) -> socket.socket:
    return socket.create_connection((gateway.host, gateway.port), timeout=5)


def test_slowloris_half_sent_requests_are_closed_after_the_header_timeout(gateway):
    """A client opens many connections and sends half a request head (or
    nothing, or half of HTTP/2's preface) on each: every one is closed once
    the header timeout passes, and the API keeps answering meanwhile."""
    partial = [
        b"GET /sandboxes HTTP/1.1\r\nHost: api\r\nX-Slow: ",
        b"",
        b"PRI * HTTP/2.0\r\n",
    ]
    socks = []
    try:
        for i in range(120):
            sock = _connect(gateway)
            sock.sendall(partial[i % len(partial)])
            socks.append(sock)
        started = time.monotonic()
        # Held connections do not stop others from being served.
        assert isinstance(_list_sandboxes(), list)

        def closed(sock):
            return _closed_within(sock, HEADER_TIMEOUT_S + 15)

        with ThreadPoolExecutor(max_workers=32) as pool:
            outcomes = list(pool.map(closed, socks))
        assert all(outcomes), f"{outcomes.count(False)} of {len(socks)} half-sent connections still open"
        assert time.monotonic() - started < HEADER_TIMEOUT_S + 15
    finally:
        for sock in socks:
            sock.close()
    assert isinstance(_list_sandboxes(), list)


def test_one_address_cannot_hold_more_than_its_share_of_connections(gateway):
    """Connections from one address past the cap are answered 429 (E2B's
    JSON error) and closed at once; freed places are given back."""
    extra = 40
    socks = []
    try:
        opened = time.monotonic()
        for _ in range(MAX_CONNECTIONS_PER_CLIENT + extra):
            socks.append(_connect(gateway))

        # Refused connections are closed at once; admitted ones stay open
        # (silent, they would be closed only after the header timeout).
        time.sleep(3)
        readable, _, _ = select.select(socks, [], [], 0)
        assert time.monotonic() - opened < HEADER_TIMEOUT_S - 1, "too slow to tell refused from timed out"
        refused = []
        for sock in readable:
            sock.settimeout(1)
            data = b""
            try:
                while chunk := sock.recv(4096):
                    data += chunk
            except ConnectionResetError:
                pass
            refused.append(data)
        # The SDK's own pooled connections share the address, so at least `extra`.
        assert len(refused) >= extra, f"only {len(refused)} of {len(socks)} connections refused"
        assert len(refused) < extra + 20, f"{len(refused)} refused: the cap is below {MAX_CONNECTIONS_PER_CLIENT}"
        answered = [a for a in refused if a]
        assert answered, "no refusal carried a response"
        head, _, body = answered[0].partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 429"), head
        assert json.loads(body) == {"code": 429, "message": "too many connections from this address"}
    finally:
        for sock in socks:
            sock.close()
    # The places are free again.
    deadline = time.monotonic() + 10
    while True:
        try:
            assert isinstance(_list_sandboxes(), list)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _bogus_signature(i: int) -> str:
    """Shaped like a real signature, signed by no sandbox's token."""
    return "v1_" + base64.b64encode(hashlib.sha256(str(i).encode()).digest()).decode().rstrip("=")


def test_a_flood_of_bogus_signed_links_is_refused_while_the_api_keeps_answering(gateway):
    """Signed /files links name no sandbox, so each one could cost a look
    at every sandbox: thousands of forged, malformed, expired or revoked
    links get 401 with E2B's JSON error, `Sandbox.list()` keeps answering
    within a generous bound all along, and a real link still works."""
    sbx = Sandbox.create(timeout=120)
    gone = Sandbox.create(timeout=120)
    try:
        sbx.files.write("/home/user/real.txt", "real")
        real = sbx.download_url("/home/user/real.txt")
        assert httpx.get(real, timeout=10).text == "real"
        # A link signed by a sandbox that no longer exists.
        revoked = gone.download_url("/home/user/x.txt")
        gone.kill()
        expired = sbx.download_url("/home/user/real.txt", use_signature_expiration=1)
        time.sleep(2.1)

        base = gateway.url + "/files?"
        links = [revoked, expired]
        for i in range(3000):
            query = {"path": f"/home/user/{i}.txt", "username": "user", "signature": _bogus_signature(i)}
            if i % 3 == 1:
                query["signature"] = "x" * (i % 200)  # malformed
            elif i % 3 == 2:
                query["signature_expiration"] = str(int(time.time()) + 3600)
            links.append(base + urllib.parse.urlencode(query))

        stop = threading.Event()
        list_times = []

        def keep_listing():
            while not stop.is_set():
                t = time.monotonic()
                _list_sandboxes()
                list_times.append(time.monotonic() - t)
                time.sleep(0.05)

        def attack(chunk):
            answers = []
            with httpx.Client(timeout=30) as client:
                for link in chunk:
                    r = client.get(link)
                    answers.append((r.status_code, r.headers.get("content-type", ""), r.text))
            return answers

        lister = threading.Thread(target=keep_listing)
        lister.start()
        try:
            with ThreadPoolExecutor(max_workers=8) as pool:
                answers = [a for part in pool.map(attack, [links[i::8] for i in range(8)]) for a in part]
        finally:
            stop.set()
            lister.join(timeout=30)
        assert len(answers) == len(links)
        for status, content_type, text in answers:
            assert status == 401, text
            assert content_type.startswith("application/json")
            body = json.loads(text)
            assert body["code"] == 401 and "signature" in body["message"], body
        assert list_times, "Sandbox.list() never answered during the flood"
        assert max(list_times) < 5, f"Sandbox.list() took {max(list_times):.2f} s during the flood"
        assert httpx.get(real, timeout=10).text == "real"
    finally:
        sbx.kill()
        try:
            gone.kill()
        except Exception:
            pass


def _mode(path: pathlib.Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_host_state_is_private_to_the_gateway(gateway, tmp_path):
    """The data dir and the database (which holds every access token and
    environment) are not readable by other host users: the suite's own,
    and a fresh one."""
    fresh = tmp_path / "fresh"
    result = _copse(["snapshot", "list", "--data-dir", str(fresh)])
    assert result.returncode == 0, result.stderr
    for data_dir in [DATA_DIR, fresh]:
        assert _mode(data_dir) == 0o700, data_dir
        for name in ["copse.db", "copse.db-wal", "copse.db-shm"]:
            path = data_dir / name
            if name == "copse.db" or path.exists():
                assert _mode(path) == 0o600, path


def _copse(args, env_extra=None, timeout=60):
    env = {k: v for k, v in os.environ.items() if k not in ("COPSE_API_KEY", "E2B_API_KEY")}
    env.update(env_extra or {})
    return subprocess.run([str(COPSE), *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_state_left_readable_by_an_older_version_is_made_private(tmp_path):
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    os.chmod(data, 0o755)
    db = data / "copse.db"
    db.touch()
    os.chmod(db, 0o644)
    result = _copse(["snapshot", "list", "--data-dir", str(data)])
    assert result.returncode == 0, result.stderr
    assert _mode(data) == 0o700
    assert _mode(db) == 0o600


def test_a_short_api_key_is_refused_at_start_without_being_repeated(tmp_path):
    port = free_port()
    key = "shortkey-1234"
    # Were the key accepted, the missing agent would stop `up` before it
    # builds templates.
    result = _copse(
        ["up", "--listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path / "data")]
        + ["--agent", str(tmp_path / "no-agent")],
        {"COPSE_API_KEY": key},
        timeout=30,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "at least 20" in output, output
    assert key not in output


def test_a_generated_api_key_is_written_to_a_private_file_and_never_logged(tmp_path):
    """With no key configured, copse makes one: the operator finds it in a
    0600 file the log names; the log and the keys file never hold it."""
    data = tmp_path / "data"
    port = free_port()
    # A missing agent stops `up` right after the keys are set up, before
    # any template is built.
    result = _copse(
        ["up", "--listen", f"127.0.0.1:{port}", "--data-dir", str(data), "--agent", str(tmp_path / "no-agent")],
        timeout=30,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "agent binary" in output, output
    key_file = data / "generated-api-key"
    key = key_file.read_text().strip()
    assert len(key) >= 20
    assert _mode(key_file) == 0o600
    assert str(key_file) in output
    assert key not in output
    keys = (data / "api-keys").read_text()
    assert key not in keys and keys.startswith("sha256:")
    assert _mode(data / "api-keys") == 0o600
    # A later start neither makes another key nor prints this one.
    again = _copse(
        ["up", "--listen", f"127.0.0.1:{port}", "--data-dir", str(data), "--agent", str(tmp_path / "no-agent")],
        timeout=30,
    )
    assert key not in again.stdout + again.stderr
    assert key_file.read_text().strip() == key


# --- Files API: a request made as a user has exactly that user's power ---

SECRET = "root-only secret"
DENIED = "(?i)permission.denied"


def _planted(sbx):
    """Root keeps a secret; untrusted code as `user` plants links to it, one
    to the file and one to a directory on its path."""
    sbx.commands.run(
        f"mkdir -p /root/vault && echo -n '{SECRET}' > /root/vault/secret && chmod 600 /root/vault/secret"
        " && chmod 700 /root/vault",
        user="root",
    )
    sbx.commands.run(
        "ln -s /root/vault/secret /home/user/report.txt && ln -s /root/vault /home/user/docs",
        user="user",
    )


def _upload_through_link(url: str, payload: bytes) -> int:
    boundary = "copse-hostile-boundary"
    body = (
        f"--{boundary}\r\n"
        'Content-Disposition: form-data; name="file"; filename="f"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode() + payload + f"\r\n--{boundary}--\r\n".encode()
    response = httpx.post(url, content=body, headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    return response.status_code


def test_links_planted_by_user_reach_nothing_user_cannot_read(gateway):
    """`files.*` and the signed links with user="user" follow a planted
    symlink only as far as `user` could: root's secret is never read,
    listed, overwritten or replaced."""
    sbx = Sandbox.create(timeout=120)
    try:
        _planted(sbx)
        for path in ("/home/user/report.txt", "/home/user/docs/secret"):
            with pytest.raises(SandboxException, match=DENIED) as caught:
                sbx.files.read(path, user="user")
            assert SECRET not in str(caught.value)
            with pytest.raises(SandboxException, match=DENIED):
                sbx.files.write(path, "overwritten", user="user")
            response = httpx.get(sbx.download_url(path, user="user"), timeout=30)
            assert response.status_code in (403, 404), response.status_code
            assert SECRET not in response.text
            assert _upload_through_link(sbx.upload_url(path, user="user"), b"replaced") in (403, 404)
        with pytest.raises(SandboxException, match=DENIED):
            sbx.files.list("/home/user/docs", user="user")
        with pytest.raises(SandboxException, match=DENIED):
            sbx.files.write("/home/user/docs/new.txt", "planted", user="user")

        # Root's file is untouched and no file appeared in root's directory.
        assert sbx.commands.run("cat /root/vault/secret; ls /root/vault", user="root").stdout == SECRET + "secret\n"
        # Root requests keep root's power.
        assert sbx.files.read("/home/user/report.txt", user="root") == SECRET
    finally:
        sbx.kill()


def test_files_written_as_a_user_belong_to_that_user(gateway):
    sbx = Sandbox.create(timeout=120)
    try:
        sbx.files.write("/home/user/made/by/user.txt", "mine", user="user")
        assert _upload_through_link(sbx.upload_url("/home/user/made/up.txt", user="user"), b"up") in (200, 201)
        owners = sbx.commands.run(
            "stat -c %U /home/user/made /home/user/made/by /home/user/made/by/user.txt /home/user/made/up.txt"
        )
        assert owners.stdout.split() == ["user"] * 4
        # `user` cannot write where only root may.
        with pytest.raises(SandboxException, match=DENIED):
            sbx.files.write("/etc/copse-planted", "x", user="user")
        assert sbx.commands.run("test -e /etc/copse-planted && echo yes || echo no").stdout.strip() == "no"
    finally:
        sbx.kill()


def test_a_fifo_is_refused_at_once_and_the_agent_keeps_serving(gateway):
    """Reading a FIFO nobody writes would block forever: the agent refuses
    anything that is not a regular file, promptly, for every route."""
    sbx = Sandbox.create(timeout=120)
    try:
        sbx.commands.run("mkfifo /home/user/pipe", user="user")
        started = time.monotonic()
        with pytest.raises(InvalidArgumentException, match="not a regular file"):
            sbx.files.read("/home/user/pipe", request_timeout=20)
        response = httpx.get(sbx.download_url("/home/user/pipe"), timeout=20)
        assert response.status_code == 400, response.status_code
        with pytest.raises(InvalidArgumentException, match="not a regular file"):
            sbx.files.write("/home/user/pipe", "x", request_timeout=20)
        assert time.monotonic() - started < 15, "a FIFO held the agent until the timeout"
        sbx.files.write("/home/user/after.txt", "still serving")
        assert sbx.files.read("/home/user/after.txt") == "still serving"
    finally:
        sbx.kill()


# -- traffic and token hygiene ------------------------------------------------

# A server untrusted code might start as `user`: it records the headers of
# every request it is handed, and answers "served".
HEADER_RECORDER = """
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        with open("/tmp/seen-headers.jsonl", "a") as f:
            f.write(json.dumps({k.lower(): v for k, v in self.headers.items()}) + "\\n")
        self.send_response(200)
        self.send_header("content-length", "6")
        self.end_headers()
        self.wfile.write(b"served")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""
RECORDER_PORT = 8000


def start_header_recorder(sbx, gateway, headers=None):
    """The recorder listening as `user` inside `sbx`, once it answers."""
    sbx.files.write("/tmp/recorder.py", HEADER_RECORDER)
    sbx.commands.run(f"python3 /tmp/recorder.py {RECORDER_PORT}", background=True, user="user")
    host = sbx.get_host(RECORDER_PORT)
    deadline = time.monotonic() + 20
    while (response := httpx.get(gateway.url + "/ready", headers={"host": host, **(headers or {})})).status_code == 502:
        assert time.monotonic() < deadline, "the recorder never answered"
        time.sleep(0.05)
    sbx.commands.run("rm -f /tmp/seen-headers.jsonl", user="user")
    return host


def seen_headers(sbx):
    return [json.loads(line) for line in sbx.files.read("/tmp/seen-headers.jsonl", user="user").splitlines()]


def test_a_private_sandbox_serves_its_ports_only_to_holders_of_its_traffic_token(gateway):
    """`allow_public_traffic=False`: the sandbox gets a traffic token, and a
    request to one of its ports without it (by host name or by the port
    header) is a 403 with E2B's `{code, message}`; with it, it is served.
    The SDK keeps working on the agent's port, which the access token
    guards."""
    sbx = Sandbox.create(timeout=60, network={"allow_public_traffic": False})
    try:
        token = sbx.traffic_access_token
        assert token and token != sbx._envd_access_token
        host = start_header_recorder(sbx, gateway, {"e2b-traffic-access-token": token})
        by_host = lambda headers: httpx.get(gateway.url + "/x", headers={"host": host, **headers}, timeout=10)
        by_port_header = lambda headers: httpx.get(
            gateway.url + "/x",
            headers={"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": str(RECORDER_PORT), **headers},
            timeout=10,
        )
        for request in (by_host, by_port_header):
            for refused in ({}, {"e2b-traffic-access-token": "wrong"}, {"x-access-token": sbx._envd_access_token}):
                response = request(refused)
                assert response.status_code == 403, (refused, response.text)
                assert response.json()["code"] == 403 and response.json()["message"]
            served = request({"e2b-traffic-access-token": token})
            assert served.status_code == 200 and served.text == "served"
        assert sbx.commands.run("echo envd", user="user").stdout == "envd\n"
        # Connecting hands out the same token.
        assert Sandbox.connect(sbx.sandbox_id).traffic_access_token == token
    finally:
        sbx.kill()


def test_a_public_sandbox_serves_anyone_and_its_listeners_never_see_the_access_token(gateway):
    """No traffic token, no 403; a listener as `user` is handed the
    request without the envd access token the caller sent."""
    sbx = Sandbox.create(timeout=60)
    try:
        assert sbx.traffic_access_token is None
        host = start_header_recorder(sbx, gateway)
        response = httpx.get(gateway.url + "/x", headers={"host": host}, timeout=10)
        assert response.status_code == 200 and response.text == "served"
        token = {"x-access-token": sbx._envd_access_token}
        assert httpx.get(gateway.url + "/y", headers={"host": host, **token}, timeout=10).status_code == 200
        seen = seen_headers(sbx)
        assert len(seen) == 2
        assert all("x-access-token" not in headers for headers in seen), seen
    finally:
        sbx.kill()


def test_a_host_mask_cannot_smuggle_headers_or_a_path_to_the_sandboxs_servers(gateway):
    """`maskRequestHost` becomes the `Host` every in-sandbox server is
    handed: a mask carrying a line break (a second header, such as a forged
    access token), a path, user info or another placeholder is a 400 with
    E2B's `{code, message}` and creates nothing; a mask cannot be slipped
    in later through the network update either."""
    headers = {"X-API-KEY": os.environ["E2B_API_KEY"]}
    nonce = os.urandom(6).hex()
    for bad in (
        "${PORT}-a.example.com\r\nx-access-token: forged",
        "a.example.com/admin?x=",
        "user@a.example.com",
        "${HOME}.example.com",
        "a.example.com ",
        "",
    ):
        create_refused(gateway, {"maskRequestHost": bad}, "maskRequestHost", nonce)
    none_created(gateway, nonce)
    # Not a blanket refusal: a host name with the placeholder is taken.
    sbx = Sandbox.create(timeout=60, network={"mask_request_host": "${PORT}-ok.example.com"})
    assert Sandbox.get_info(sbx.sandbox_id).network["mask_request_host"] == "${PORT}-ok.example.com"
    sbx.kill()
    sbx = Sandbox.create(timeout=60)
    try:
        update = {"allowOut": [], "maskRequestHost": "${PORT}-mine.example.com"}
        response = httpx.put(f"{gateway.url}/sandboxes/{sbx.sandbox_id}/network", json=update, headers=headers)
        assert response.status_code == 400 and "maskRequestHost" in response.json()["message"], response.text
        assert "mask_request_host" not in Sandbox.get_info(sbx.sandbox_id).network
    finally:
        sbx.kill()


def test_a_listener_as_user_never_sees_the_access_or_traffic_token(gateway):
    """Untrusted code listening on a port is handed requests without the
    envd access token (which would make it root through the agent) and
    without the traffic token, by host name and by the port header; a
    caller cannot forge the agent's mark that it presented the token."""
    sbx = Sandbox.create(timeout=60, network={"allow_public_traffic": False})
    try:
        access, traffic = sbx._envd_access_token, sbx.traffic_access_token
        host = start_header_recorder(sbx, gateway, {"e2b-traffic-access-token": traffic})
        secrets = {"x-access-token": access, "e2b-traffic-access-token": traffic}
        assert httpx.get(gateway.url + "/a", headers={"host": host, **secrets}, timeout=10).status_code == 200
        port_route = {"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": str(RECORDER_PORT)}
        assert httpx.get(gateway.url + "/b", headers={**port_route, **secrets}, timeout=10).status_code == 200
        forged = {"e2b-traffic-access-token": traffic, "x-copse-caller-authenticated": "1"}
        assert httpx.get(gateway.url + "/c", headers={"host": host, **forged}, timeout=10).status_code == 200
        seen = seen_headers(sbx)
        assert len(seen) == 3
        for headers in seen:
            assert "x-access-token" not in headers and "e2b-traffic-access-token" not in headers, headers
            assert access not in json.dumps(headers) and traffic not in json.dumps(headers)
        assert [h.get("x-copse-caller-authenticated") for h in seen] == ["1", "1", None]
    finally:
        sbx.kill()


def test_a_client_cannot_make_the_agent_speak_tls_to_a_plain_port(gateway):
    """Only the gateway marks a request for TLS to an `https_ports` port: a
    client that sends the mark itself to a plain port, by host name or by
    the port header, is served plainly as before, and the in-sandbox server
    never sees the mark."""
    sbx = Sandbox.create(timeout=60, network={"https_ports": [RECORDER_PORT + 1]})
    try:
        host = start_header_recorder(sbx, gateway)
        forged = {"x-copse-port-tls": "1"}
        by_host = httpx.get(gateway.url + "/a", headers={"host": host, **forged}, timeout=10)
        assert (by_host.status_code, by_host.text) == (200, "served"), by_host.text
        port_route = {"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": str(RECORDER_PORT)}
        by_header = httpx.get(gateway.url + "/b", headers={**port_route, **forged}, timeout=10)
        assert (by_header.status_code, by_header.text) == (200, "served"), by_header.text
        seen = seen_headers(sbx)
        assert len(seen) == 2
        assert all("x-copse-port-tls" not in headers for headers in seen), seen
    finally:
        sbx.kill()


def test_the_code_interpreter_refuses_callers_without_the_access_token(gateway):
    """Whoever knows a public sandbox's host name reaches port 49999, but
    the interpreter's /execute (and contexts) answer only callers who
    presented the access token — a forged mark of the agent does not
    count; the SDK, which sends the token, runs code as before. (As on
    E2B, the context routes run no code and need no token.)"""
    from e2b_code_interpreter import Sandbox as CodeInterpreter

    sbx = CodeInterpreter.create(timeout=120)
    try:
        url = gateway.url + "/execute"
        host = {"host": sbx.get_host(49999)}
        body = {"code": "open('/tmp/pwned', 'w').write('x')"}
        for refused in ({}, {"x-access-token": "wrong"}, {"x-copse-caller-authenticated": "1"}):
            response = httpx.post(url, json=body, headers={**host, **refused}, timeout=30)
            assert response.status_code == 401, (refused, response.text)
        assert not sbx.files.exists("/tmp/pwned")
        assert httpx.get(gateway.url + "/health", headers=host, timeout=10).status_code == 200
        ok = httpx.post(url, json={"code": "1 + 1"}, headers={**host, "x-access-token": sbx._envd_access_token}, timeout=60)
        assert ok.status_code == 200 and '"2"' in ok.text
        assert sbx.run_code("6 * 7").text == "42"
    finally:
        sbx.kill()


def _run_as_root(sbx, name: str, script: str) -> str:
    sbx.files.write(f"/root/{name}", script, user="root")
    return sbx.commands.run(f"python3 /root/{name}", user="root").stdout


def test_x32_system_calls_and_new_namespaces_and_mounts_are_refused(gateway):
    """The seccomp allow-list is for x86-64 only: an x32 number (getpid with
    bit 30 set) is refused even where the kernel enables x32, and so are
    unshare(2) and mount(2), which would hand root a fresh set of capabilities
    or a view of the host's disks."""
    sbx = Sandbox.create(timeout=60)
    try:
        script = (
            "import ctypes, os\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "for name, args in [('x32', (0x40000000 | 39,)), ('unshare', (272, 0x10000000)),\n"
            "                   ('mount', (165, b'none', b'/mnt', b'tmpfs', 0, None))]:\n"
            "    r = libc.syscall(*args)\n"
            "    print(name, r, ctypes.get_errno())\n"
        )
        out = _run_as_root(sbx, "x32.py", script)
        for name in ("x32", "unshare", "mount"):
            assert f"{name} -1 1\n" in out, out
        refused = sbx.commands.run("unshare -U -r true || echo refused", user="root").stdout
        assert "refused" in refused, refused
    finally:
        sbx.kill()


def test_core_dumps_are_off_for_every_process_and_cannot_be_turned_on(gateway):
    sbx = Sandbox.create(timeout=60)
    try:
        for user in ("root", "user"):
            out = sbx.commands.run("ulimit -Hc; ulimit -Sc; (ulimit -Hc unlimited && echo raised) 2>&1; true", user=user)
            lines = out.stdout.split()
            assert lines[:2] == ["0", "0"], out.stdout
            assert "raised" not in out.stdout, out.stdout
    finally:
        sbx.kill()


def test_host_kernel_state_in_proc_and_sys_is_masked(gateway):
    """runc's default masked paths: each is empty or gone inside a sandbox."""
    sbx = Sandbox.create(timeout=60)
    try:
        script = (
            "import os\n"
            "for p in ['/proc/kcore', '/proc/keys', '/proc/timer_list', '/proc/sched_debug',\n"
            "          '/proc/interrupts', '/proc/latency_stats', '/proc/timer_stats']:\n"
            "    if os.path.exists(p):\n"
            "        print('file', p, len(open(p, 'rb').read(4096)))\n"
            "for p in ['/proc/acpi', '/proc/scsi', '/proc/asound', '/sys/firmware', '/sys/devices/virtual/powercap']:\n"
            "    if os.path.exists(p):\n"
            "        print('dir', p, len(os.listdir(p)))\n"
            "try:\n"
            "    open('/proc/sysrq-trigger', 'w').write('h')\n"
            "    print('sysrq written')\n"
            "except OSError as e:\n"
            "    print('sysrq refused', e.errno)\n"
        )
        out = _run_as_root(sbx, "masked.py", script)
        lines = [line for line in out.splitlines() if line.startswith(("file", "dir"))]
        assert any("/proc/interrupts" in line for line in lines), out
        assert any("/sys/firmware" in line for line in lines), out
        for line in lines:
            assert line.endswith(" 0"), out
        assert "sysrq refused" in out, out
    finally:
        sbx.kill()


def test_a_logs_request_naming_a_path_reads_nothing_of_the_host(gateway):
    """A caller puts a path where the logs routes want a sandbox id: the
    gateway keeps each sandbox's log as DATA_DIR/logs/<id>.jsonl, so an id
    of `../planted` would name DATA_DIR/planted.jsonl. Only ids made of
    letters and digits name a log; anything else is E2B's 404."""
    planted = gateway.data_dir / "planted.jsonl"
    planted.write_text(json.dumps({"at_ms": 1, "level": "info", "message": "host secret", "fields": {}}) + "\n")
    try:
        for route in ("/v2/sandboxes/{}/logs", "/sandboxes/{}/logs"):
            for name in ("..%2Fplanted", "..%2F..%2F" + urllib.parse.quote(str(planted.parent.name), safe="") + "%2Fplanted"):
                response = httpx.get(gateway.url + route.format(name), headers={"X-API-KEY": os.environ["E2B_API_KEY"]})
                assert response.status_code == 404, (route, name, response.text)
                assert response.json()["code"] == 404 and "host secret" not in response.text
    finally:
        planted.unlink()


# -- secrets -------------------------------------------------------------------


def test_a_secret_value_is_stored_sealed_and_reaches_no_log(gateway):
    """What a local host user with a copy of the database, or a reader of
    the gateway's log, could look for."""
    value = "sk-" + os.urandom(16).hex()
    name = "hostile-" + os.urandom(4).hex()
    secret = Secret.create(name, value)
    Secret.update(secret.secret_id, value + "-v2")
    data_dir = gateway.data_dir
    for path in [data_dir / "copse.db", data_dir / "copse.db-wal", data_dir / "gateway.log"]:
        if path.exists():
            assert value.encode() not in path.read_bytes(), path
    keyring = data_dir / "secrets.keyring"
    assert stat.S_IMODE(keyring.stat().st_mode) == 0o600
    Secret.destroy(name)
# -- teams ---------------------------------------------------------------------


def test_another_sandboxs_token_or_signed_link_opens_nothing_and_confirms_nothing(gateway):
    """Team b holds its own sandbox's access token and signed links, and
    knows (somehow) the id of team a's sandbox. Presented against a's
    sandbox, they read and write nothing, and the answer is the one a
    sandbox that does not exist gets: no confirmation that it does."""
    from test_tenancy import new_key, new_team

    a, b = new_key(new_team("ha")), new_key(new_team("hb"))
    theirs = Sandbox.create(timeout=120, api_key=a)
    mine = Sandbox.create(timeout=120, api_key=b)
    try:
        theirs.files.write("/home/user/secret.txt", "team a's secret")
        mine.files.write("/home/user/secret.txt", "team b's own")

        def data_plane(sandbox_id, method="GET", url=None, token=None, **kwargs):
            headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983"}
            if token:
                headers["X-Access-Token"] = token
            url = url or f"{gateway.url}/files?path=/home/user/secret.txt&username=user"
            return httpx.request(method, url, headers=headers, timeout=30, **kwargs)

        missing = data_plane("a" * 20, token=mine._envd_access_token)
        assert missing.status_code == 502 and "was not found" in missing.json()["message"]
        read = data_plane(theirs.sandbox_id, token=mine._envd_access_token)
        assert (read.status_code, read.json()["code"]) == (502, 502), read.text
        assert read.json()["message"] == missing.json()["message"].replace("a" * 20, theirs.sandbox_id)
        assert "secret" not in read.text
        upload = f"{gateway.url}/files?path=/home/user/planted.txt&username=user"
        wrote = data_plane(theirs.sandbox_id, "POST", upload, mine._envd_access_token, files={"file": b"x"})
        assert wrote.status_code == 502, wrote.text
        assert not theirs.files.exists("/home/user/planted.txt")

        # A link team b's sandbox signed, pointed at team a's sandbox.
        link = mine.download_url("/home/user/secret.txt")
        assert httpx.get(link, timeout=30).text == "team b's own"
        aimed = data_plane(theirs.sandbox_id, url=link)
        assert aimed.status_code == 502 and "secret" not in aimed.text, aimed.text
        # The owner's own token still works.
        assert data_plane(theirs.sandbox_id, token=theirs._envd_access_token).text == "team a's secret"
    finally:
        theirs.kill()
        mine.kill()


# --- The code interpreter under its own account; i386 system calls ---------
# The interpreter serves port 49999 as `copse-interp`; its kernels are
# started by the agent as `user` (e2b-compat/agent/src/kernels/), so code run
# as `user` can neither reach into the server nor stand in for it.


def _interpreter_pid(sbx) -> int:
    out = sbx.commands.run("pgrep -o -f 'copse_interpreter.py --port 49999'", user="root").stdout
    return int(out.split()[0])


def test_code_as_user_cannot_read_trace_or_signal_the_code_interpreter(gateway):
    """Code run through run_code (and any command as `user`) cannot read the
    interpreter's environment or descriptors, nor signal it: it belongs to
    another account."""
    from e2b_code_interpreter import Sandbox as CodeInterpreter

    sbx = CodeInterpreter.create(timeout=120)
    try:
        pid = _interpreter_pid(sbx)
        probe = (
            f"import os, signal\n"
            f"for what, attempt in [('environ', lambda: open('/proc/{pid}/environ', 'rb').read()),\n"
            f"                      ('fds', lambda: os.listdir('/proc/{pid}/fd')),\n"
            f"                      ('signal', lambda: os.kill({pid}, 0))]:\n"
            f"    try:\n"
            f"        attempt()\n"
            f"        print(what, 'reached')\n"
            f"    except OSError as e:\n"
            f"        print(what, 'refused', e.errno)\n"
        )
        execution = sbx.run_code(probe)
        out = "".join(execution.logs.stdout)
        assert execution.error is None, execution.error
        for what in ("environ", "fds", "signal"):
            assert f"{what} refused" in out, out
        sbx.files.write("/home/user/probe.py", probe)
        out = sbx.commands.run("python3 /home/user/probe.py", user="user").stdout
        assert "reached" not in out, out
        owner = sbx.commands.run(f"stat -c %U /proc/{pid}", user="root").stdout.strip()
        assert owner == "copse-interp", owner
    finally:
        sbx.kill()


def test_code_as_user_cannot_take_over_the_interpreters_port(gateway):
    """Code as `user` tries to kill the interpreter and bind 49999 itself
    (every way Linux offers) to answer the next run_code; it can do
    neither, and the next run_code reaches the real interpreter."""
    from e2b_code_interpreter import Sandbox as CodeInterpreter

    sbx = CodeInterpreter.create(timeout=120)
    try:
        pid = _interpreter_pid(sbx)
        impostor = (
            "import http.server, os, signal, socket, sys, time\n"
            "try:\n"
            f"    os.kill({pid}, signal.SIGKILL)\n"
            "    print('killed', flush=True)\n"
            "except OSError as e:\n"
            "    print('kill refused', e.errno, flush=True)\n"
            "time.sleep(0.5)\n"
            "class Fake(http.server.BaseHTTPRequestHandler):\n"
            "    def do_POST(self):\n"
            "        body = b'{\"type\": \"stdout\", \"text\": \"impostor\"}\\n'\n"
            "        self.send_response(200); self.send_header('content-length', str(len(body)))\n"
            "        self.end_headers(); self.wfile.write(body)\n"
            "    do_GET = do_POST\n"
            "for host in ('127.0.0.1', '0.0.0.0'):\n"
            "    for reuse in (socket.SO_REUSEADDR, socket.SO_REUSEPORT):\n"
            "        s = socket.socket()\n"
            "        s.setsockopt(socket.SOL_SOCKET, reuse, 1)\n"
            "        try:\n"
            "            s.bind((host, 49999)); s.listen(8)\n"
            "        except OSError as e:\n"
            "            print('bind refused', host, e.errno, flush=True)\n"
            "            s.close()\n"
            "            continue\n"
            "        print('bound', host, flush=True)\n"
            "        server = http.server.HTTPServer((host, 49999), Fake, bind_and_activate=False)\n"
            "        server.socket = s\n"
            "        server.serve_forever()\n"
        )
        sbx.files.write("/home/user/impostor.py", impostor)
        sbx.commands.run("python3 /home/user/impostor.py > /tmp/impostor.log 2>&1", user="user", background=True)
        deadline = time.time() + 20
        log = ""
        while time.time() < deadline:
            log = sbx.files.read("/tmp/impostor.log") if sbx.files.exists("/tmp/impostor.log") else ""
            if "bound" in log or log.count("bind refused") == 4:
                break
            time.sleep(0.2)
        assert "kill refused 1" in log, log
        assert log.count("bind refused") == 4 and "bound" not in log, log
        execution = sbx.run_code("6 * 7")
        assert execution.text == "42", execution
        assert _interpreter_pid(sbx) == pid
    finally:
        sbx.kill()


def test_run_code_still_runs_as_user_in_every_language(gateway):
    """The interpreter's own account never reaches the code: Python, bash and
    JavaScript cells run as `user`, with its home and environment."""
    from e2b_code_interpreter import Sandbox as CodeInterpreter

    sbx = CodeInterpreter.create(timeout=120)
    try:
        python = sbx.run_code("import getpass, os; print(getpass.getuser(), os.getcwd(), os.environ['HOME'])")
        assert "".join(python.logs.stdout).split() == ["user", "/home/user", "/home/user"], python
        bash = sbx.run_code("whoami; echo $HOME; pwd", language="bash")
        assert "".join(bash.logs.stdout).split() == ["user", "/home/user", "/home/user"], bash
        js = sbx.run_code("require('os').userInfo().username", language="javascript")
        assert js.text.strip("'\"") == "user", js
        # A directory private to user, which the interpreter's account cannot
        # enter, still serves as a context's cwd: the kernel starts as user.
        sbx.commands.run("mkdir -p /home/user/private/work && chmod 700 /home/user/private", user="user")
        context = sbx.create_code_context(cwd="/home/user/private/work")
        here = sbx.run_code("import os; os.getcwd()", context=context)
        assert here.text == "/home/user/private/work", here
    finally:
        sbx.kill()


def test_the_kernel_socket_serves_the_interpreters_account_alone(gateway):
    """The agent's kernel socket starts processes as `user` for the
    interpreter; `user` itself (or root) asking there with its own pipes is
    refused and nothing is started."""
    sbx = Sandbox.create(timeout=60)
    try:
        script = (
            "import json, os, socket\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
            "try:\n"
            "    s.connect('\\0copse-agent-kernels')\n"
            "except OSError as e:\n"
            "    print('no socket', e.errno); raise SystemExit\n"
            "r, w = os.pipe()\n"
            "req = json.dumps({'argv': ['/usr/bin/touch', '/tmp/started'], 'cwd': '/'}).encode() + b'\\n'\n"
            "try:\n"
            "    socket.send_fds(s, [req], [r, w, w])\n"
            "except OSError as e:\n"
            "    print('send failed', e.errno)  # refused before it was read\n"
            "print('answer', s.makefile().readline().strip())\n"
        )
        for user in ("user", "root"):
            sbx.files.write("/tmp/ask.py", script, user="root")
            out = sbx.commands.run("python3 /tmp/ask.py", user=user).stdout
            assert "answer" in out and '"error"' in out and "copse-interp" in out, (user, out)
        assert not sbx.files.exists("/tmp/started")
    finally:
        sbx.kill()


def test_i386_system_calls_are_refused(gateway):
    """int 0x80 from a 64-bit process enters the kernel as an i386 call
    (AUDIT_ARCH_I386), with its own numbers and none of the x86-64 filter's
    checks; the filter's architecture check kills the caller instead. (The
    same stub returns getpid() on an unconfined host.)"""
    sbx = Sandbox.create(timeout=60)
    try:
        script = (
            "import ctypes, mmap, os\n"
            "code = bytes([0xb8, 20, 0, 0, 0, 0xcd, 0x80, 0xc3])  # mov eax, 20 (i386 getpid); int 0x80; ret\n"
            "buf = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
            "buf.write(code)\n"
            "stub = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))\n"
            "print('ready', flush=True)\n"
            "print('i386 getpid', stub(), 'pid', os.getpid(), flush=True)\n"
        )
        sbx.files.write("/tmp/i386.py", script, user="root")
        for user in ("user", "root"):
            out = sbx.commands.run("python3 /tmp/i386.py; echo status=$?", user=user).stdout
            assert "ready" in out, (user, out)
            assert "i386 getpid" not in out, (user, out)
            assert "status=159" in out, (user, out)  # 128 + SIGSYS
    finally:
        sbx.kill()


# Sandbox ids on the host (docs/userns.md): uid/gid 0-65535 in every
# sandbox are host ids R..R+65535, in a user namespace owned by a host uid
# of the sandbox's own.
ID_BASE = 1 << 31
NS_GET_OWNER_UID = 0xB704


ROOT_PROBES_THE_AGENT = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
agents = [p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()
          and open(f'/proc/{p}/comm').read().strip() == 'copse-agent']
print('agents', len(agents))
for pid in agents:
    for what, attempt in [('environ', lambda: open(f'/proc/{pid}/environ', 'rb').read()),
                          ('mem', lambda: open(f'/proc/{pid}/mem', 'rb').read(1)),
                          ('fd', lambda: os.readlink(f'/proc/{pid}/fd/0')),
                          ('exe', lambda: os.readlink(f'/proc/{pid}/exe'))]:
        try:
            attempt()
            print(what, 'reached')
        except OSError as e:
            print(what, 'refused', e.errno)
    if libc.ptrace(16, int(pid), None, None) == 0:  # PTRACE_ATTACH
        print('ptrace reached')
        libc.ptrace(17, int(pid), None, None)  # PTRACE_DETACH
    else:
        print('ptrace refused', ctypes.get_errno())
"""


def test_root_in_a_sandbox_cannot_read_or_trace_the_agent_that_holds_its_token(gateway):
    """Root keeps a container root's capabilities (chown, setuid, ...) but
    never all of the agent's, so the kernel refuses it the agent's memory,
    environment, descriptors (their numbers it may list, as their owner) and
    ptrace: the access token stays out of
    reach of whatever runs as root (a template's daemon, a package's
    maintainer script)."""
    sbx = Sandbox.create(timeout=60)
    try:
        sbx.files.write("/tmp/probe.py", ROOT_PROBES_THE_AGENT)
        out = sbx.commands.run("python3 /tmp/probe.py", user="root").stdout
        lines = out.splitlines()
        agents = int(lines[0].split()[1])
        assert agents >= 1, out
        assert "reached" not in out, out
        assert sum("refused" in line for line in lines) == 5 * agents, out
    finally:
        sbx.kill()


def test_sandbox_root_is_an_unprivileged_host_id(gateway):
    """The sandbox's uid and gid maps put its root at R, not host root."""
    sbx = Sandbox.create(timeout=60)
    try:
        out = sbx.commands.run("cat /proc/self/uid_map /proc/self/gid_map; id -u", user="root").stdout
        maps = [line.split() for line in out.splitlines()[:2]]
        assert maps == [["0", str(ID_BASE), "65536"]] * 2, out
        assert out.splitlines()[2] == "0", out
    finally:
        sbx.kill()


def test_files_sandbox_root_makes_belong_to_its_host_range(gateway):
    """A file and a setuid-root file written by sandbox root are, in its
    upper dir on the host, owned by R: the setuid file is no host-root
    setuid binary."""
    sbx = Sandbox.create(timeout=60)
    try:
        sbx.commands.run("echo hi > /root/plain && cp /bin/true /root/suid && chmod 4755 /root/suid", user="root")
        upper = DATA_DIR / "disk" / sbx.sandbox_id / "upper" / "root"
        plain, suid = (upper / "plain").lstat(), (upper / "suid").lstat()
        assert (plain.st_uid, plain.st_gid) == (ID_BASE, ID_BASE)
        assert (suid.st_uid, suid.st_gid) == (ID_BASE, ID_BASE)
        assert suid.st_mode & stat.S_ISUID, oct(suid.st_mode)
        # Inside, they are root's as ever.
        out = sbx.commands.run("stat -c '%u %g %a' /root/plain /root/suid", user="root").stdout.split("\n")
        assert out[:2] == ["0 0 644", "0 0 4755"], out
    finally:
        sbx.kill()


def _host_pid_of(token: str) -> int:
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if token.encode() in (entry / "cmdline").read_bytes():
                    return int(entry.name)
            except OSError:
                continue
    raise AssertionError(f"no host process runs {token}")


def _userns_owner(pid: int) -> int:
    import array
    import fcntl

    fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY)
    try:
        buf = array.array("I", [0])
        fcntl.ioctl(fd, NS_GET_OWNER_UID, buf)
        return buf[0]
    finally:
        os.close(fd)


def test_each_sandbox_has_a_user_namespace_owner_of_its_own(gateway):
    """The kernel charges per-user counts to a user namespace's owner: two
    sandboxes' namespaces have distinct owners, neither host root nor a
    sandbox's own ids."""
    first, second = Sandbox.create(timeout=60), Sandbox.create(timeout=60)
    try:
        owners = []
        for sbx in (first, second):
            token = f"copse-owner-probe-{sbx.sandbox_id}"
            sbx.commands.run(f"exec -a {token} sleep 600", user="root", background=True)
            deadline = time.monotonic() + 10
            while True:
                try:
                    owners.append(_userns_owner(_host_pid_of(token)))
                    break
                except AssertionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        assert 0 not in owners, owners
        assert owners[0] != owners[1], owners
        for owner in owners:
            assert not ID_BASE <= owner < ID_BASE + 65536, owners
    finally:
        first.kill()
        second.kill()


def test_inotify_exhaustion_in_one_sandbox_leaves_watch_dir_working_in_another(gateway):
    """Sandbox root opens inotify instances until the kernel refuses; the
    refusal counts against its own namespace's owner, so another
    sandbox's agent can still watch a directory."""
    greedy, neighbour = Sandbox.create(timeout=60), Sandbox.create(timeout=60)
    try:
        script = (
            "import ctypes, time\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "fds = []\n"
            "while len(fds) < 100000:\n"
            "    fd = libc.inotify_init1(0)\n"
            "    if fd < 0:\n"
            "        break\n"
            "    fds.append(fd)\n"
            "open('/root/held', 'w').write(f'{len(fds)} {ctypes.get_errno()}')\n"
            "time.sleep(60)\n"
        )
        greedy.files.write("/root/greedy.py", script, user="root")
        greedy.commands.run("python3 /root/greedy.py", user="root", background=True)
        deadline = time.monotonic() + 20
        while not greedy.files.exists("/root/held", user="root"):
            assert time.monotonic() < deadline, "the greedy process never reported"
            time.sleep(0.2)
        held, errno = greedy.files.read("/root/held", user="root").split()
        # EMFILE below the descriptor limit: the per-user limit refused.
        limit = int(pathlib.Path("/proc/sys/fs/inotify/max_user_instances").read_text())
        assert errno == "24" and int(held) <= limit, f"{held} instances, then errno {errno}"

        events = []
        handle = neighbour.files.watch_dir("/home/user")
        try:
            neighbour.files.write("/home/user/seen", "x")
            deadline = time.monotonic() + 10
            while not any(e.name == "seen" for e in events) and time.monotonic() < deadline:
                events.extend(handle.get_new_events())
                time.sleep(0.2)
        finally:
            handle.stop()
        assert any(e.name == "seen" for e in events), events
    finally:
        greedy.kill()
        neighbour.kill()


def _cgroup_value(controller: str, sandbox_id: str, knob: str) -> str:
    """A knob of the sandbox's cgroup, v1 or v2, read on the host."""
    root = pathlib.Path("/sys/fs/cgroup")
    for path in [*root.glob(f"{controller}/copse-*/{sandbox_id}/{knob}"), *root.glob(f"copse-*/{sandbox_id}/{knob}")]:
        return path.read_text().strip()
    raise AssertionError(f"no {knob} for {sandbox_id}")


def test_a_fork_bomb_stops_at_the_sandboxs_pid_limit_and_neighbours_still_start_processes(gateway):
    """Sandbox root forks until the kernel refuses: the refusal comes from its
    own cgroup's pids.max, not the host's pid space, and another sandbox (and
    the attacker's own agent, once the bomb is gone) still runs commands."""
    greedy, neighbour = Sandbox.create(timeout=120), Sandbox.create(timeout=120)
    try:
        limit = int(_cgroup_value("pids", greedy.sandbox_id, "pids.max"))
        # The bomb holds its processes for 8 s, then kills them: while it
        # holds them, nothing (not even the agent) starts a process in there.
        script = (
            "import os, signal, time\n"
            "children = []\n"
            "while len(children) < 100000:\n"
            "    try:\n"
            "        pid = os.fork()\n"
            "    except OSError as e:\n"
            "        open('/root/forked', 'w').write(f'{len(children)} {e.errno}')\n"
            "        break\n"
            "    if pid == 0:\n"
            "        time.sleep(60)\n"
            "        os._exit(0)\n"
            "    children.append(pid)\n"
            "time.sleep(8)\n"
            "for pid in children:\n"
            "    os.kill(pid, signal.SIGKILL)\n"
        )
        greedy.files.write("/root/bomb.py", script, user="root")
        greedy.commands.run("python3 /root/bomb.py", user="root", background=True)
        deadline = time.monotonic() + 60
        while not greedy.files.exists("/root/forked", user="root"):
            assert time.monotonic() < deadline, "the fork bomb never hit a limit"
            time.sleep(0.5)
        children, errno = greedy.files.read("/root/forked", user="root").split()
        # EAGAIN from fork below the sandbox's own pids.max.
        assert errno == "11" and int(children) < limit, f"{children} children, then errno {errno}, limit {limit}"
        assert int(_cgroup_value("pids", greedy.sandbox_id, "pids.current")) <= limit

        assert neighbour.commands.run("echo alive").stdout.strip() == "alive"
        deadline = time.monotonic() + 30
        while True:
            try:
                assert greedy.commands.run("echo alive", user="root").stdout.strip() == "alive"
                break
            except (CommandExitException, SandboxException):
                assert time.monotonic() < deadline, "the attacker's own sandbox never recovered"
                time.sleep(0.5)
    finally:
        greedy.kill()
        neighbour.kill()


def test_a_memory_hog_is_killed_inside_its_own_limit_and_nothing_else_is(gateway):
    """Sandbox code allocates past the sandbox's memory limit: the kernel
    kills the hog within the sandbox's cgroup; the sandbox's agent, a
    neighbour sandbox and the gateway keep working."""
    greedy, neighbour = Sandbox.create(timeout=120), Sandbox.create(timeout=120)
    try:
        try:
            limit = int(_cgroup_value("memory", greedy.sandbox_id, "memory.limit_in_bytes"))
        except AssertionError:
            limit = int(_cgroup_value("memory", greedy.sandbox_id, "memory.max"))
        hog = (
            "python3 -c \"\n"
            "blocks = []\n"
            f"while len(blocks) < {2 * limit // (64 << 20) + 4}:\n"
            "    blocks.append(bytearray(64 << 20))\n"
            "print('survived', len(blocks))\n"
            "\""
        )
        with pytest.raises(CommandExitException) as caught:
            greedy.commands.run(hog, user="root", timeout=120)
        # SIGKILL from the OOM killer (or a MemoryError if the allocator is refused first).
        assert caught.value.error == "signal: killed" or "MemoryError" in caught.value.stderr, caught.value
        assert "survived" not in caught.value.stdout

        assert greedy.commands.run("echo alive", user="root").stdout.strip() == "alive"
        assert neighbour.commands.run("echo alive").stdout.strip() == "alive"
        assert any(s.sandbox_id == neighbour.sandbox_id for s in Sandbox.list().next_items())
    finally:
        greedy.kill()
        neighbour.kill()


def test_a_malicious_image_layer_cannot_write_outside_the_template_root(gateway, tmp_path):
    """An image author's layer plants a symlink to a host directory and
    writes through it, names a file by an absolute host path, climbs out
    with `..`, and hard-links a host file: every write stays beneath the
    template root, and the layers that cannot be applied there fail the
    pull with no template left behind."""
    import tarfile

    from oci_registry import Registry, copse_pull, layer, member, oci_layout, push, remove_template

    host_dir = tmp_path / "host"
    host_dir.mkdir()
    host_file = host_dir / "secret"
    host_file.write_text("host\n")
    registry = Registry(tmp_path)
    names = [f"oci-evil-{n}-{os.getpid()}" for n in ("link", "climb", "hardlink")]
    try:
        images = {
            "link": [
                member("escape", kind=tarfile.SYMTYPE, link=str(host_dir)),
                member("escape/planted", b"through the link\n"),
                member(str(host_dir / "absolute"), b"by absolute name\n"),
                member("secret-link", kind=tarfile.SYMTYPE, link=str(host_file)),
                member("secret-link", b"replaces the link, never follows it\n"),
            ],
            "climb": [member("../../../../../../../.." + str(host_dir / "climbed"), b"climbed\n")],
            "hardlink": [member("stolen", kind=tarfile.LNKTYPE, link=str(host_file))],
        }
        results = {}
        for (kind, members), name in zip(images.items(), names):
            layout = tmp_path / f"layout-{kind}"
            oci_layout(layout, "1", [layer(members)])
            push(layout, "1", registry, f"copse-test/evil-{kind}")
            results[kind] = copse_pull(f"docker.io/copse-test/evil-{kind}:1", name, registry)

        # Nothing reached the host directory, whatever the outcome.
        assert sorted(p.name for p in host_dir.iterdir()) == ["secret"]
        assert host_file.read_text() == "host\n" and host_file.stat().st_nlink == 1

        # The symlink tricks land inside the root, as the sandbox sees them.
        assert results["link"].returncode == 0, results["link"].stderr
        rootfs = DATA_DIR / "templates" / names[0] / "rootfs"
        inside = rootfs / str(host_dir).lstrip("/")
        assert (inside / "planted").read_text() == "through the link\n"
        assert (inside / "absolute").read_text() == "by absolute name\n"
        assert (rootfs / "secret-link").read_text() == "replaces the link, never follows it\n"
        assert not (rootfs / "secret-link").is_symlink()

        # `..` and a hard link to a host file cannot be applied: refused.
        assert results["climb"].returncode != 0 and "'..'" in results["climb"].stderr, results["climb"].stderr
        assert results["hardlink"].returncode != 0, results["hardlink"].stderr
        for name in names[1:]:
            assert not (DATA_DIR / "templates" / name).exists()
            assert not (DATA_DIR / "templates" / f".{name}.building").exists()
    finally:
        registry.close()
        for name in names:
            remove_template(name)


# --- Persistent volumes ---------------------------------------------------------------
# A volume is written by every sandbox mounting it and read by the host (the
# content API): nothing a sandbox plants there may lead the host elsewhere.


@pytest.fixture
def volume(gateway):
    from e2b import Volume

    os.environ["E2B_VOLUME_API_URL"] = gateway.url
    vol = Volume.create(f"hostile-{os.urandom(4).hex()}")
    yield vol
    Volume.destroy(vol.volume_id)


def test_links_and_fifos_planted_in_a_volume_are_never_followed_by_the_content_api(gateway, volume):
    from e2b import VolumeException, VolumePathNotFoundException

    sbx = Sandbox.create(timeout=90, volume_mounts={"/mnt/data": volume})
    try:
        sbx.commands.run(
            "cd /mnt/data && ln -s /etc/shadow shadow && ln -s / root && ln -s ../../.. up"
            " && mkdir d && mkfifo d/pipe && echo ok > d/plain"
        )
        for path in ["/shadow", "/root/etc/shadow", "/up/etc/hostname", "/d/pipe"]:
            started = time.monotonic()
            with pytest.raises(VolumeException):
                volume.read_file(path)
            assert time.monotonic() - started < 5, f"{path}: the gateway blocked"
        for path in ["/../etc/hostname", "/d/../../etc/hostname", "d/./plain"]:
            with pytest.raises(VolumeException):
                volume.read_file(path)
        with pytest.raises(VolumeException):
            volume.write_file("/root/tmp/planted-by-the-api", "x")
        with pytest.raises(VolumeException):
            volume.write_file("/shadow", "overwritten")
        with pytest.raises(VolumeException):
            volume.write_file("/d/pipe", "x")
        with pytest.raises(VolumeException):
            volume.list("/root")
        assert not pathlib.Path("/tmp/planted-by-the-api").exists()
        # Links are shown as links and removed as links.
        listed = {e.name: e for e in volume.list("/")}
        assert listed["shadow"].type.value == "symlink" and listed["shadow"].target == "/etc/shadow"
        volume.remove("/root")
        assert pathlib.Path("/etc/hostname").exists()
        assert volume.read_file("/d/plain") == "ok\n"
        with pytest.raises(VolumePathNotFoundException):
            volume.read_file("/root")
    finally:
        sbx.kill()


def test_a_volume_export_stores_planted_links_as_links_and_never_opens_a_fifo(gateway, volume, tmp_path):
    """Export runs as host root over files a sandbox wrote: a link to a host
    file is stored as that link (never the file's bytes), a FIFO is skipped
    without being opened (opening one for reading would block)."""
    import tarfile

    sbx = Sandbox.create(timeout=90, volume_mounts={"/mnt/data": volume})
    try:
        sbx.commands.run(
            "cd /mnt/data && ln -s /etc/shadow shadow && ln -s / root && mkfifo pipe"
            " && mkdir d && echo ok > d/plain && ln -s ../../../../etc/hostname d/up"
        )
        archive = tmp_path / "hostile.tar"
        done = subprocess.run(
            [str(COPSE), "volume", "export", volume.name, "--out", str(archive), "--data-dir", str(DATA_DIR)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        assert "skipped /pipe" in done.stderr, done.stderr
    finally:
        sbx.kill()
    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["data/shadow"].issym() and members["data/shadow"].linkname == "/etc/shadow"
    assert members["data/shadow"].size == 0
    assert members["data/root"].issym() and "data/root/etc" not in " ".join(members)
    assert members["data/d/up"].issym() and members["data/d/plain"].isfile()
    assert "data/pipe" not in members
    host_shadow = pathlib.Path("/etc/shadow").read_bytes()
    assert host_shadow[:16] not in archive.read_bytes(), "the host's file is not in the archive"
    # Links that lead out of the volume make its import refused whole.
    name = f"hostile-copy-{os.urandom(4).hex()}"
    back = subprocess.run(
        [str(COPSE), "volume", "import", str(archive), "--name", name, "--data-dir", str(DATA_DIR)],
        capture_output=True,
        text=True,
    )
    assert back.returncode != 0 and "link" in back.stderr, back.stderr
    assert name not in subprocess.run(
        [str(COPSE), "volume", "ls", "--data-dir", str(DATA_DIR)], capture_output=True, text=True
    ).stdout


def test_a_volume_import_refuses_names_and_links_that_lead_out_and_writes_nothing(gateway, tmp_path):
    """A crafted archive: `..` and absolute names, a link to a host dir then
    a file through it, a hard link to a host file, a device node. Each is
    refused whole; no file appears outside and no volume is left."""
    import tarfile

    from test_volumes import tar_member, volume_manifest

    marker = f"copse-import-escape-{os.urandom(4).hex()}"
    outside = tmp_path / "outside"
    outside.mkdir()
    volumes_dir = DATA_DIR / "disk" / ".volumes"
    before = set(os.listdir(volumes_dir)) if volumes_dir.exists() else set()
    attacks = {
        "dot-dot": tar_member(f"data/../../../../../..{outside}/{marker}", b"x"),
        "absolute": tar_member(f"{outside}/{marker}", b"x"),
        "outside data": tar_member(f"../{marker}", b"x"),
        "link then write": tar_member("data/l", type=tarfile.SYMTYPE, linkname=str(outside))
        + tar_member(f"data/l/{marker}", b"x"),
        "relative link then write": tar_member("data/d", type=tarfile.DIRTYPE)
        + tar_member("data/d/up", type=tarfile.SYMTYPE, linkname="..")
        + tar_member("data/d/out", type=tarfile.SYMTYPE, linkname="up/.."),
        "write through a link inside": tar_member("data/here", type=tarfile.SYMTYPE, linkname=".")
        + tar_member(f"data/here/{marker}", b"x"),
        "hard link": tar_member("data/h", type=tarfile.LNKTYPE, linkname="/etc/shadow"),
        "relative hard link": tar_member("data/h", type=tarfile.LNKTYPE, linkname="data/../../../../../../etc/shadow"),
        "device": tar_member("data/null", type=tarfile.CHRTYPE, devmajor=1, devminor=3),
        "fifo": tar_member("data/pipe", type=tarfile.FIFOTYPE),
    }
    for what, body in attacks.items():
        name = f"hostile-import-{os.urandom(4).hex()}"
        archive = tmp_path / "attack.tar"
        archive.write_bytes(tar_member("copse-volume.json", volume_manifest(name)) + body + b"\0" * 1024)
        done = subprocess.run(
            [str(COPSE), "volume", "import", str(archive), "--data-dir", str(DATA_DIR)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode != 0, (what, done.stdout)
        assert "refused" in done.stderr, (what, done.stderr)
        assert not list(outside.iterdir()), what
        assert not pathlib.Path(f"/{marker}").exists() and not (DATA_DIR / marker).exists(), what
        after = set(os.listdir(volumes_dir)) if volumes_dir.exists() else set()
        assert after == before, (what, after - before)
        listed = subprocess.run([str(COPSE), "volume", "ls", "--data-dir", str(DATA_DIR)], capture_output=True, text=True)
        assert name not in listed.stdout, what
    assert pathlib.Path("/etc/shadow").stat().st_nlink == 1


def test_a_volume_mount_never_follows_a_link_in_the_sandboxs_tree(gateway, volume):
    """The mount point is the sandbox's: a snapshot whose /mnt is a link to
    the host's /tmp must not carry the volume, or a directory made for it,
    onto the host."""
    marker = f"copse-volume-escape-{os.urandom(4).hex()}"
    sbx = Sandbox.create(timeout=90)
    try:
        sbx.commands.run(f"rm -rf /mnt && ln -s /tmp /mnt && ln -s /tmp /{marker}", user="root")
        snap = sbx.create_snapshot(mode="filesystem")
    finally:
        sbx.kill()
    try:
        for path in [f"/mnt/{marker}", f"/{marker}/{marker}"]:
            with pytest.raises(SandboxException):
                Sandbox.create(template=snap.snapshot_id, timeout=30, volume_mounts={path: volume})
            assert not pathlib.Path(f"/tmp/{marker}").exists()
    finally:
        Sandbox.delete_snapshot(snap.snapshot_id)
    for path in ["/mnt/../etc", "/mnt/data/..", "/.copse/run"]:
        with pytest.raises(SandboxException, match="400"):
            Sandbox.create(timeout=30, volume_mounts={path: volume})


def test_no_btrfs_subvolume_or_snapshot_can_be_made_in_a_volume(gateway, volume):
    """A volume is a btrfs subvolume bound straight into the sandbox; a new
    subvolume or snapshot in it would have its own, unlimited, quota group."""
    sbx = Sandbox.create(timeout=60, volume_mounts={"/mnt/data": volume})
    try:
        script = (
            "import fcntl, os, struct\n"
            "fd = os.open('/mnt/data', os.O_RDONLY | os.O_DIRECTORY)\n"
            "for cmd in [0x5000940E, 0x50009418]:\n"
            "    args = bytearray(struct.pack('q4088s', 0, b'escape'))\n"
            "    try:\n"
            "        fcntl.ioctl(fd, cmd, args, True)\n"
            "        print('made', hex(cmd))\n"
            "    except OSError as e:\n"
            "        print('refused', hex(cmd), e.errno)\n"
            "for cmd in [0x50009401, 0x50009417]:\n"
            "    args = bytearray(struct.pack('q4088s', fd, b'snap'))\n"
            "    try:\n"
            "        fcntl.ioctl(fd, cmd, args, True)\n"
            "        print('made', hex(cmd))\n"
            "    except OSError as e:\n"
            "        print('refused', hex(cmd), e.errno)\n"
        )
        sbx.files.write("/root/subvol.py", script, user="root")
        out = sbx.commands.run("python3 /root/subvol.py", user="root").stdout
        assert "made" not in out, out
        assert out.count("refused") == 4, out
        assert volume.list("/") == [], "nothing was made"
    finally:
        sbx.kill()


def _tar(members) -> bytes:
    """A tar of (name, kind, data) members, names taken as given."""
    import io
    import tarfile

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            if kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, data
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _raw_template_build(
    gateway, name: str, archive: bytes, after_copy: list, key: str | None = None, files_hash: str | None = None
) -> dict:
    """A template build driven by hand, as a hostile client would: its copy
    step's archive is whatever the client uploads, under whatever files
    hash it claims. The final status."""
    headers = {"X-API-KEY": key or os.environ["E2B_API_KEY"]}
    url = gateway.url
    requested = httpx.post(f"{url}/v3/templates", json={"name": name}, headers=headers, timeout=30)
    assert requested.status_code == 202, requested.text
    template_id, build_id = requested.json()["templateID"], requested.json()["buildID"]
    digest = files_hash or hashlib.sha256(archive).hexdigest()
    link = httpx.get(f"{url}/templates/{template_id}/files/{digest}", headers=headers, timeout=30).json()
    if not link["present"]:
        httpx.put(link["url"], content=archive, timeout=30).raise_for_status()
    copy = {"type": "COPY", "args": ["payload", "/home/user/dest/", "", ""], "filesHash": digest, "force": False}
    body = {"fromTemplate": "base", "steps": [copy, *after_copy]}
    started = httpx.post(f"{url}/v2/templates/{template_id}/builds/{build_id}", json=body, headers=headers, timeout=30)
    assert started.status_code == 202, started.text
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        status = httpx.get(
            f"{url}/templates/{template_id}/builds/{build_id}/status?limit=1000", headers=headers, timeout=30
        ).json()
        if status["status"] in ("ready", "error"):
            return status
        time.sleep(0.5)
    raise AssertionError("the build did not finish")


def test_a_template_copy_archive_cannot_write_outside_the_build_sandbox(gateway):
    """A copy step's archive with `..`, absolute and symlinked members is
    unpacked inside the build sandbox only, never on the host: nothing
    lands in the host's /tmp, and (tar refusing `..` and stripping `/`)
    nothing lands outside the unpack directory inside the sandbox either."""
    tag = os.urandom(4).hex()
    host_marks = [pathlib.Path(f"/tmp/copse-escape-{tag}-{n}") for n in range(4)]
    headers = {"X-API-KEY": os.environ["E2B_API_KEY"]}
    names = []
    try:
        # `..` and absolute members: refused or confined, never on the host.
        names.append(f"evil-{tag}")
        dotdot = _tar(
            [
                ("payload/ok.txt", "file", b"ok"),
                (f"../../../../../../../../tmp/copse-escape-{tag}-0", "file", b"x"),
                (f"/tmp/copse-escape-{tag}-1", "file", b"x"),
            ]
        )
        _raw_template_build(gateway, names[-1], dotdot, [])
        # A symlink out of the unpack directory, then a member through it.
        names.append(f"link-{tag}")
        through_link = _tar(
            [
                ("payload/ok.txt", "file", b"ok"),
                ("payload/esc", "symlink", "/tmp"),
                (f"payload/esc/copse-escape-{tag}-2", "file", b"x"),
                ("hop", "symlink", "/tmp"),
                (f"hop/copse-escape-{tag}-3", "file", b"x"),
            ]
        )
        check = " && ".join(f"test ! -e /tmp/copse-escape-{tag}-{n}" for n in (2, 3))
        status = _raw_template_build(gateway, names[-1], through_link, [{"type": "RUN", "args": [check, "root"]}])
        if status["status"] == "error":
            # tar refused the archive outright: also confined.
            assert "step 1" in status["reason"]["message"], status
        for mark in host_marks:
            assert not mark.exists(), f"{mark} was written on the host"
        # The host never takes a path from the hash or a forged link.
        template_id = httpx.get(f"{gateway.url}/templates/aliases/{names[-1]}", headers=headers).json()["templateID"]
        bad_hash = httpx.get(f"{gateway.url}/templates/{template_id}/files/{'z' * 64}", headers=headers)
        assert bad_hash.status_code == 400, bad_hash.text
        forged = httpx.put(f"{gateway.url}/copse/template-files/{template_id}/{'a' * 64}?token=forged", content=b"x")
        assert forged.status_code == 404, forged.text
        traversal = httpx.put(f"{gateway.url}/copse/template-files/{template_id}/..%2F..%2Fx?token=x", content=b"x")
        assert traversal.status_code in (400, 404), traversal.text
    finally:
        for name in names:
            httpx.delete(f"{gateway.url}/templates/{name}", headers=headers)
        for mark in host_marks:
            if mark.exists() or mark.is_symlink():
                mark.unlink()


def test_a_build_is_never_served_another_teams_cached_layer(gateway):
    """Team b sends exactly team a's steps under a's files hash, with files
    of its own uploaded under that hash: every step runs on b's files, and
    the layer a's build cached (holding a's secret) serves nothing to b."""
    from test_tenancy import new_key, new_team

    a, b = new_key(new_team("ca")), new_key(new_team("cb"))
    tag = os.urandom(4).hex()
    name = f"cache-{tag}"
    secret = f"team-a-secret-{tag}"
    archive = _tar([("payload/secret.txt", "file", secret.encode())])
    forged = _tar([("payload/secret.txt", "file", b"team-b-files")])
    files_hash = hashlib.sha256(archive).hexdigest()
    show = [{"type": "RUN", "args": ["cat /home/user/dest/secret.txt"]}]

    def messages(status: dict) -> list[str]:
        return [entry["message"] for entry in status["logEntries"]]

    try:
        first = _raw_template_build(gateway, name, archive, show, key=a)
        assert first["status"] == "ready", first
        # a's own identical rebuild is served from the cache: the keys match.
        again = _raw_template_build(gateway, name, archive, show, key=a)
        assert [m for m in messages(again) if m.startswith("CACHED [")], messages(again)
        theirs = _raw_template_build(gateway, name, forged, show, key=b, files_hash=files_hash)
        assert theirs["status"] == "ready", theirs
        logged = messages(theirs)
        assert not [m for m in logged if m.startswith("CACHED [")], logged
        assert "team-b-files" in logged and secret not in "\n".join(logged), logged
        sbx = Sandbox.create(name, api_key=b, timeout=60)
        try:
            assert sbx.files.read("/home/user/dest/secret.txt") == "team-b-files"
        finally:
            sbx.kill()
    finally:
        for key in (a, b):
            httpx.delete(f"{gateway.url}/templates/{name}", headers={"X-API-KEY": key})


@pytest.mark.timeout(300, func_only=True)
def test_a_start_command_that_never_gets_ready_cannot_hang_a_build_or_leak_its_sandbox(gateway):
    """A running template's start and ready commands are the tenant's code,
    run by the build before its memory snapshot: a start command that plants
    a FIFO and links to host paths and blocks on the FIFO, with a ready
    command that never exits, fails the build within its bound, writes
    nothing on the host, and leaves nothing of the build sandbox behind."""
    import leakcheck
    from e2b import Template
    from e2b.exceptions import BuildException
    from test_leaks import live_ids

    tag = os.urandom(4).hex()
    host_mark = pathlib.Path(f"/tmp/copse-start-{tag}")
    name = f"hang-{tag}"
    headers = {"X-API-KEY": os.environ["E2B_API_KEY"]}
    before = leakcheck.baseline(gateway.data_dir)
    start = (
        f"mkfifo /home/user/fifo; ln -s {host_mark} /home/user/out; ln -s /etc/shadow /home/user/shadow; "
        "echo planted > /home/user/out; exec cat /home/user/fifo"
    )
    template = Template().from_template("base").set_start_cmd(start, ready_cmd="sleep infinity")
    try:
        began = time.monotonic()
        with pytest.raises(BuildException, match="ready command did not succeed"):
            Template.build(template, alias=name)
        # The build's bound (60 s), not the build sandbox's hour.
        assert time.monotonic() - began < 150
        assert not host_mark.exists() and not host_mark.is_symlink(), "the start command wrote on the host"
        assert not [s for s in Sandbox.list().next_items() if (s.metadata or {}).get("copse.build")]
        leakcheck.assert_no_leaks(gateway.data_dir, live_ids(), before, gateway.proc.pid)
    finally:
        httpx.delete(f"{gateway.url}/templates/{name}", headers=headers)
        if host_mark.exists() or host_mark.is_symlink():
            host_mark.unlink()


@pytest.mark.parametrize(
    "reference",
    ["file:///etc/passwd", "/etc/passwd", "../../../etc", "http://127.0.0.1:5000/x:1", "debian:bookworm\nRUN x"],
)
def test_an_image_reference_naming_a_host_path_or_a_url_is_refused(gateway, reference):
    from e2b import Template
    from e2b.exceptions import BuildException

    name = f"hostile-ref-{os.urandom(3).hex()}"
    try:
        with pytest.raises(BuildException) as refused:
            Template.build(Template().from_image(reference).run_cmd("true"), alias=name)
        assert "not an image reference" in str(refused.value)
    finally:
        httpx.delete(f"{os.environ['E2B_API_URL']}/templates/{name}",
                     headers={"x-api-key": os.environ["E2B_API_KEY"]}, timeout=60)


def test_a_registry_outside_the_mirror_map_is_never_spoken_to_in_plain_http_nor_told_a_password(gateway, tmp_path):
    """A plain-HTTP registry the operator did not name as a mirror: the build
    speaks only HTTPS to it (so it serves nothing), and the password the
    build carried is in no log line and nowhere in the store."""
    from e2b import Template
    from e2b.exceptions import BuildException
    from oci_registry import Registry, layer, oci_layout, push, tiny_root, tree_members

    registry = Registry(tmp_path / "registry")
    try:
        root = tmp_path / "root"
        tiny_root(root, "x")
        oci_layout(tmp_path / "layout", "1", [layer(tree_members(root))])
        push(tmp_path / "layout", "1", registry, "copse-test/plain")
        before = registry.requests()
        password = f"hostile-pw-{os.urandom(8).hex()}"
        name = f"hostile-http-{os.urandom(3).hex()}"
        lines = []
        try:
            with pytest.raises(BuildException) as failed:
                Template.build(
                    Template().from_image(f"{registry.host}/copse-test/plain:1", username="u", password=password)
                    .run_cmd("true"),
                    alias=name, on_build_logs=lines.append,
                )
            assert f"pulling {registry.host}/copse-test/plain:1" in str(failed.value)
            assert password not in str(failed.value)
            assert not any(password in e.message for e in lines)
        finally:
            httpx.delete(f"{os.environ['E2B_API_URL']}/templates/{name}",
                         headers={"x-api-key": os.environ["E2B_API_KEY"]}, timeout=60)
        assert registry.requests() == before
        assert registry.blob_gets("copse-test/plain") == 0
        for path in [DATA_DIR / "gateway.log", *DATA_DIR.glob("copse.db*")]:
            if path.is_file():
                assert password.encode() not in path.read_bytes(), path
    finally:
        registry.close()


def test_tags_cannot_carry_paths_floods_or_reach_another_teams_template(gateway):
    """Tags appear in `name:tag`, in URLs and in the CLI's output: a tag with
    `/`, `..` or a second separator is refused with E2B's 400, a flood of
    tags is bounded, and another team can neither tag, untag, read the tags
    of, nor publish a template it does not own (404, as if it did not
    exist)."""
    from e2b import Template
    from test_tenancy import new_key, new_team

    name = f"victim-{os.urandom(4).hex()}"
    key = os.environ["E2B_API_KEY"]
    other = new_key(new_team("tagger"))

    def call(method, path, body=None, api_key=key):
        return httpx.request(method, gateway.url + path, json=body, headers={"X-API-KEY": api_key}, timeout=60)

    try:
        info = Template.build(Template().from_template("base").run_cmd("true"), name)
        for bad in ["a/b", "..", "../../etc", "x:y", ".hidden", "", "t" * 65, "a b"]:
            response = call("POST", "/templates/tags", {"target": f"{name}:default", "tags": [bad]})
            assert response.status_code == 400, (bad, response.text)
            assert response.json()["code"] == 400
        for target in [f"{name}:../../x", f"{name}:a/b"]:
            assert call("POST", "/templates/tags", {"target": target, "tags": ["ok"]}).status_code == 400
        flood = call("POST", "/templates/tags", {"target": name, "tags": [f"t{n}" for n in range(10_000)]})
        assert flood.status_code == 400 and "at most" in flood.json()["message"]
        huge = call("POST", "/templates/tags", {"target": name, "tags": ["x" * 1_000_000]})
        assert huge.status_code in (400, 413)
        # Tags on a build never become paths: a sandbox named with one is
        # refused, not resolved.
        with pytest.raises(Exception):
            Sandbox.create(f"{name}:../../../etc", timeout=30)

        for method, path, body in [
            ("POST", "/templates/tags", {"target": f"{info.template_id}:default", "tags": ["theirs"]}),
            ("POST", "/templates/tags", {"target": name, "tags": ["theirs"]}),
            ("DELETE", "/templates/tags", {"name": info.template_id, "tags": ["default"]}),
            ("GET", f"/templates/{info.template_id}/tags", None),
            ("GET", f"/templates/{info.template_id}/tags/count", None),
            ("GET", f"/templates/{info.template_id}/tags/exists?tag=default", None),
            ("GET", f"/templates/{info.template_id}/tags/groups", None),
            ("GET", f"/templates/{info.template_id}/tags/default/assignments", None),
            ("GET", f"/templates/{info.template_id}/builds/{info.build_id}/logs", None),
            ("PATCH", f"/templates/{info.template_id}", {"public": True}),
            ("PATCH", f"/v2/templates/{info.template_id}", {"public": True}),
        ]:
            response = call(method, path, body, api_key=other)
            assert response.status_code == 404, (method, path, response.text)
            assert response.json()["code"] == 404
        assert {t.tag for t in Template.get_tags(name)} == {"default"}
        assert call("GET", f"/templates/{info.template_id}").json()["public"] is False
    finally:
        httpx.delete(f"{gateway.url}/templates/{name}", headers={"X-API-KEY": key})


USERFAULTFD_PROBE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.syscall(323, os.O_CLOEXEC)  # userfaultfd(2) on x86_64
print(fd, ctypes.get_errno())
"""


@pytest.mark.timeout(300, func_only=True)
def test_a_lazily_restored_sandbox_holds_no_userfaultfd_and_cannot_make_one(gateway):
    """A sandbox restored lazily had its memory handed to it through
    userfaultfds that CRIU got from /dev/userfaultfd as the host's root.
    Once restored, none of its processes holds one, the device is not in
    it, and its root still may not make one (with a userfaultfd a tenant
    could stall the kernel on its own pages at will); its bytes are
    intact."""
    from test_lifecycle import holders_digest, start_holder

    sbx = Sandbox.create(timeout=300)
    try:
        digest = start_holder(sbx, 160)
        snap = sbx.create_snapshot(mode="full")
        child = Sandbox.create(template=snap.snapshot_id, timeout=120)
        try:
            assert (gateway.data_dir / "sandboxes" / child.sandbox_id / "restore" / "lazy-pages.pid").exists()
            assert holders_digest(child) == digest
            cgroup = next(pathlib.Path("/sys/fs/cgroup/pids").glob(f"copse-*/{child.sandbox_id}"))
            held = []
            for pid in (cgroup / "cgroup.procs").read_text().split():
                for fd in pathlib.Path(f"/proc/{pid}/fd").glob("*"):
                    with contextlib.suppress(OSError):
                        if "userfaultfd" in os.readlink(fd):
                            held.append((pid, fd.name))
            assert held == [], "no restored process keeps a userfaultfd"
            listing = child.commands.run("ls /dev", user="root").stdout.split()
            assert "userfaultfd" not in listing, listing
            child.files.write("/tmp/uffd.py", USERFAULTFD_PROBE)
            fd, errno = child.commands.run("python3 /tmp/uffd.py", user="root").stdout.split()
            assert (fd, errno) == ("-1", "1"), "userfaultfd(2) is EPERM for the sandbox's root"
        finally:
            child.kill()
    finally:
        sbx.kill()
        Sandbox.delete_snapshot(snap.snapshot_id)


@pytest.mark.timeout(300, func_only=True)
def test_what_a_restored_code_interpreter_changes_never_reaches_the_next_one(gateway):
    """Code-interpreter sandboxes the pool cannot serve are restored from one
    warm memory snapshot: whatever one of them plants in its kernel, its
    files or the interpreter's own code stays in that sandbox."""
    from e2b_code_interpreter import Sandbox as CodeSandbox

    # After this one the warm snapshot exists (the first boot may take it).
    CodeSandbox.create(timeout=60).kill()
    tenant = CodeSandbox.create(timeout=120)
    try:
        assert tenant.run_code("planted = 'by the tenant'").error is None
        tenant.commands.run(
            "echo planted > /home/user/planted; echo planted > /tmp/planted; "
            "echo '# copse-planted' >> /opt/copse/copse_interpreter.py",
            user="root",
        )
        assert "copse-planted" in tenant.commands.run("tail -1 /opt/copse/copse_interpreter.py").stdout
        after = CodeSandbox.create(timeout=120)
        try:
            assert after.run_code("'planted' in globals()").text == "False"
            left = after.commands.run(
                "ls /home/user/planted /tmp/planted 2>/dev/null; grep -c copse-planted /opt/copse/copse_interpreter.py || true"
            ).stdout
            assert left.strip() == "0", left
        finally:
            after.kill()
    finally:
        tenant.kill()


# The egress proxy (see test_egress_proxy.py for its fixtures): a name is
# evidence of where a connection is going only if the host agrees.
from test_egress_proxy import OTHER as WEB_OTHER  # noqa: E402
from test_egress_proxy import WEB, create, egress_gateway, fetch, web  # noqa: E402,F401

FORGE = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
s.sendall(sys.argv[3].encode().decode("unicode_escape").encode())
s.settimeout(3)
try:
    print("answered" if s.recv(64) else "closed")
except OSError as e:
    print("closed", e)
"""


def test_an_allowed_host_or_sni_sent_to_another_address_is_refused(egress_gateway):
    env, _ = egress_gateway
    sbx = create(env, allow_out=["allowed.test"], deny_out=["0.0.0.0/0"])
    try:
        assert fetch(sbx, "http://allowed.test/", f"allowed.test:80:{WEB}") == "200", "the control must pass"
        assert fetch(sbx, f"http://{WEB_OTHER}/", header="Host: allowed.test") == "000"
        assert fetch(sbx, "https://allowed.test/", f"allowed.test:443:{WEB_OTHER}") == "000", "forged SNI"
        # Two Host headers name nothing, so the (denied) address decides.
        sbx.files.write("/tmp/forge.py", FORGE)
        two_hosts = r"GET / HTTP/1.1\r\nHost: allowed.test\r\nHost: other.test\r\n\r\n"
        out = sbx.commands.run(f"python3 /tmp/forge.py {WEB} 80 '{two_hosts}'").stdout
        assert out.startswith("closed"), out
        one_host = r"GET / HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n"
        out = sbx.commands.run(f"python3 /tmp/forge.py {WEB} 80 '{one_host}'").stdout
        assert out.startswith("answered"), out
    finally:
        sbx.kill()


def test_the_egress_proxy_is_no_service_and_never_reaches_the_host(egress_gateway):
    """A proxied sandbox cannot address the proxy's port itself, nor make the
    proxy connect to the host (whose own connections nftables would let
    through)."""
    import socket as sockets

    env, bridge = egress_gateway
    sbx = create(env, deny_out=["denied.test"])
    rules = subprocess.run(["nft", "list", "chain", "inet", f"copse_{bridge}", "prerouting"],
                           capture_output=True, text=True, check=True).stdout
    port = int(rules.split("{ 80, 443 } redirect to :")[1].split()[0])
    shown = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", bridge], capture_output=True, text=True).stdout
    gateway_addr = shown.split(" inet ")[1].split("/")[0]
    listener = sockets.socket()
    listener.setsockopt(sockets.SOL_SOCKET, sockets.SO_REUSEADDR, 1)
    listener.bind((gateway_addr, 80))
    listener.listen()
    listener.settimeout(0.5)
    try:
        out = sbx.commands.run(f"python3 -c \"import socket; socket.create_connection(('{gateway_addr}', {port}), "
                               f"timeout=3)\" && echo connected || echo refused").stdout
        assert "refused" in out, out
        sbx.files.write("/tmp/forge.py", FORGE)
        out = sbx.commands.run(
            f"python3 /tmp/forge.py {gateway_addr} 80 'GET / HTTP/1.1\\r\\nHost: x.test\\r\\n\\r\\n'").stdout
        assert out.startswith("closed"), out
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
        sbx.kill()


# Requests to a host with `network.rules` are served one by one by the
# proxy: each must stay with the name the connection was admitted for.
STATUSES = """
import re, socket, sys
s = socket.create_connection((sys.argv[1], 80), timeout=5)
s.sendall(sys.argv[2].encode().decode("unicode_escape").encode())
answer = b""
try:
    while chunk := s.recv(65536):
        answer += chunk
except OSError:
    pass
print(" ".join(status.decode() for status in re.findall(rb"HTTP/1\\.[01] (\\d{3}) ", answer)))
"""


def test_a_rule_hosts_connection_cannot_be_steered_to_another_host(egress_gateway):
    from test_egress_proxy import REQUESTS

    env, _ = egress_gateway
    secrets = dict(api_key=env["api_key"], api_url=env["api_url"])
    value, name = "abs-" + os.urandom(8).hex(), "hostile-abs-" + os.urandom(4).hex()
    Secret.create(name, value, **secrets)
    rules = {"allowed.test": [{"transform": {"headers": {"Authorization": "Bearer " + Secret.fill(name)}}}]}
    sbx = create(env, allow_out=["allowed.test", "other.test"], deny_out=["0.0.0.0/0"], rules=rules)
    try:
        sbx.files.write("/tmp/statuses.py", STATUSES)
        tag = os.urandom(6).hex()
        own, steered, kept = (f"/{what}-{tag}" for what in ("own", "steered", "kept"))

        def send(head: str) -> str:
            return sbx.commands.run(f"python3 /tmp/statuses.py {WEB} '{head}'").stdout.strip()

        # An absolute-form target takes precedence over Host at a server:
        # one naming another host is refused; one naming the rule's host
        # goes on in origin form, with the rule.
        assert send(rf"GET http://other.test{steered} HTTP/1.1\r\nHost: allowed.test\r\n\r\n") == "400"
        assert send(rf"GET http://allowed.test{own} HTTP/1.1\r\nHost: allowed.test\r\n"
                    rf"Connection: close\r\n\r\n") == "200", "the control must pass"
        # A kept-alive connection's next request names another host.
        got = send(rf"GET {kept} HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
                   rf"GET {steered} HTTP/1.1\r\nHost: other.test\r\n\r\n")
        assert got == "200 421", got
        with open(REQUESTS) as log:
            seen = [json.loads(line) for line in log if tag in line]
        assert sorted(r["path"] for r in seen) == sorted([own, kept]), seen
        assert all(r["headers"].get("Authorization") == f"Bearer {value}" for r in seen), seen
    finally:
        sbx.kill()
        Secret.destroy(name, **secrets)


# A SOCKS5 upstream (`network.egress_proxy`, see test_egress_socks.py for
# its fixtures) is dialled by the host, not the sandbox: it must not make
# the host a way into what no sandbox reaches, nor hand the sandbox its
# credentials.
from test_egress_socks import HOST_SIDE as SOCKS_HOST_SIDE  # noqa: E402
from test_egress_socks import proxy as socks_proxy  # noqa: E402
from test_egress_socks import refused as socks_refused  # noqa: E402
from test_egress_socks import fetch as socks_fetch, socks_world  # noqa: E402,F401
from test_egress_socks import SOCKS as SOCKS_ADDR  # noqa: E402


def test_an_egress_proxy_where_no_sandbox_may_go_is_refused(gateway):
    from conftest import SUBNET

    bridge = str(next(ipaddress_network(SUBNET).hosts()))
    for address in ("127.0.0.1:1080", f"{bridge}:1080", "169.254.169.254:80", "10.0.0.5:1080", "224.0.0.1:1080"):
        socks_refused({"egress_proxy": {"address": address}})


def ipaddress_network(cidr):
    import ipaddress

    return ipaddress.ip_network(cidr)


def _listener():
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen()
    listener.settimeout(1)
    return listener


def test_an_egress_proxy_name_that_resolves_to_the_host_reaches_nothing(gateway):
    # Names pass create (they resolve when dialled); the dial carries the
    # proxy's fwmark, which nftables refuses the host's own addresses.
    listener = _listener()
    port = listener.getsockname()[1]
    sbx = Sandbox.create(template="base", network={"egress_proxy": {"address": f"localhost:{port}"}})
    try:
        out = sbx.commands.run("curl -s -o /dev/null -w '%{http_code}' --connect-timeout 5 -m 8 http://198.51.100.140/"
                               " || true").stdout
        assert out.strip() == "000", out
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
        sbx.kill()


def test_a_tunnelled_sandbox_cannot_reach_the_host_through_its_upstream(socks_world):
    # The upstream would connect to the host's own address for it (the
    # SOCKS server routes through the host); the proxy refuses such a
    # destination before dialling, as `forward` would refuse it directly.
    user, password = socks_world
    listener = _listener()
    port = listener.getsockname()[1]
    sbx = Sandbox.create(template="base", network={"egress_proxy": socks_proxy(user, password)})
    try:
        assert socks_fetch(sbx) == SOCKS_ADDR, "the control must pass"
        out = sbx.commands.run(f"curl -s -o /dev/null -w '%{{http_code}}' --connect-timeout 5 -m 8 "
                               f"http://{SOCKS_HOST_SIDE}:{port}/ || true").stdout
        assert out.strip() == "000", out
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
        sbx.kill()


FIND_SECRET = """
import base64, glob, os, sys
needle = base64.b64decode(sys.argv[1])
hits = sum(needle in v.encode() for v in os.environ.values())
paths = glob.glob("/proc/[0-9]*/environ") + glob.glob("/proc/[0-9]*/cmdline")
for top in ("/etc", "/run", "/tmp", "/home", "/root", "/var"):
    for d, _, files in os.walk(top):
        paths += [os.path.join(d, f) for f in files]
for path in paths:
    try:
        with open(path, "rb") as f:
            hits += needle in f.read(1 << 20)
    except OSError:
        pass
print(hits)
"""


def test_a_tunnelled_sandbox_never_holds_its_upstream_password(socks_world):
    user, password = socks_world
    sbx = Sandbox.create(template="base", network={"egress_proxy": socks_proxy(user, password)})
    try:
        assert socks_fetch(sbx) == SOCKS_ADDR, "the control must pass"
        # The needle travels base64-encoded, so the search's own command
        # line does not hold it.
        sbx.files.write("/tmp/find.py", FIND_SECRET)
        needle = base64.b64encode(password.encode()).decode()
        found = sbx.commands.run(f"python3 /tmp/find.py {needle}", user="root").stdout
        assert found.strip() == "0", found
    finally:
        sbx.kill()


# copse's resolver (test_dns.py) answers every sandbox's port 53 on the
# host: one sandbox's flood must not starve another's queries, and the
# addresses it relays open nothing.
from test_dns import HOST_ADDR, air_gapped, dns_gateway, query, resolve, tenant_dns  # noqa: E402,F401

DNS_FLOOD = r"""
import os, socket, struct, sys, time
end = time.monotonic() + float(sys.argv[1])
q = struct.pack(">HHHHHH", 1, 0x0100, 1, 0, 0, 0) + b"\x05flood\x04test\x00" + struct.pack(">HH", 1, 1)
big = os.urandom(4000)
held = []
for _ in range(64):  # TCP connections that never send a query
    try:
        held.append(socket.create_connection(("192.0.2.1", 53), timeout=1))
    except OSError:
        pass
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setblocking(False)
sent = 0
while time.monotonic() < end:
    for packet in (q, q, q, big):
        try:
            s.sendto(packet, ("192.0.2.%d" % (1 + sent % 200), 53))
            sent += 1
        except OSError:
            pass
print(sent, len(held))
"""


def test_a_copy_of_the_database_gives_no_socks_password_away_and_a_restart_still_logs_in(gateway, socks_world):
    """The database never holds the upstream's password in the clear (a
    copy of it gives nothing away), yet a restarted gateway logs in with it
    again for the sandboxes it adopts."""
    import sqlite3

    user, password = socks_world
    sbx = Sandbox.create(template="base", network={"egress_proxy": socks_proxy(user, password)})
    try:
        assert socks_fetch(sbx) == SOCKS_ADDR
        with sqlite3.connect(DATA_DIR / "copse.db") as db:
            (stored,) = db.execute("SELECT record FROM sandboxes WHERE id = ?", (sbx.sandbox_id,)).fetchone()
        assert '"sealed_upstream_password"' in stored and user in stored
        assert password not in stored
        for name in ["copse.db", "copse.db-wal"]:
            if (DATA_DIR / name).exists():
                assert password.encode() not in (DATA_DIR / name).read_bytes(), name
        # Killed: the next start adopts the sandbox from its record.
        gateway.crash()
        gateway.start()
        assert socks_fetch(sbx) == SOCKS_ADDR, "the adopted sandbox still goes through the SOCKS server, logged in"
    finally:
        if gateway.proc.poll() is not None:
            gateway.start()
        sbx.kill()


def test_a_dns_flood_from_one_sandbox_does_not_stop_another_resolving(gateway):
    """Queries, oversized datagrams and idle TCP connections as fast as a
    sandbox can send them; another sandbox's queries are still answered
    at once. Both are air-gapped, so nothing is forwarded off the host."""
    flooder = Sandbox.create(template="base", allow_internet_access=False)
    victim = Sandbox.create(template="base", allow_internet_access=False)
    try:
        flooder.files.write("/tmp/flood.py", DNS_FLOOD)
        flood = flooder.commands.run("python3 /tmp/flood.py 8", background=True)
        time.sleep(1.5)  # the flood is under way
        for _ in range(5):
            started = time.monotonic()
            assert query(victim, "anything.test") == (3, 0, "-"), "the other sandbox got no answer"
            assert time.monotonic() - started < 3
        sent, held = flood.wait().stdout.split()
        assert int(sent) > 10_000, f"the flood sent only {sent} packets"
    finally:
        flooder.kill()
        victim.kill()


def test_a_rebinding_answer_opens_no_egress(dns_gateway, tenant_dns):
    """An allowed name whose (tenant-chosen) DNS server answers with the
    host's own address: the sandbox gets the answer, and the connection is
    still refused, since addresses are checked by nftables, not by DNS."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((HOST_ADDR, 0))
    listener.listen()
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    sbx = Sandbox.create(template="base", network=air_gapped(["rebind.test"], dns_servers=[tenant_dns]),
                         **dns_gateway)
    try:
        assert resolve(sbx, "rebind.test") == HOST_ADDR
        out = sbx.commands.run(f"python3 -c \"import socket; socket.create_connection(('rebind.test', {port}), "
                               f"timeout=3)\" && echo connected || echo refused").stdout
        assert "refused" in out, out
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
        sbx.kill()


def test_a_tenants_dns_server_on_the_host_is_never_asked(dns_gateway):
    """`dns_servers` naming the host's own address (outside every blocked
    range, so only "the host's own" refuses it): the resolver never sends
    the query there (egress::outbound refuses it before the socket exists;
    on Linux nftables' output would refuse the marked socket too), so the
    sandbox gets SERVFAIL and the host's port 53 hears nothing."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind((HOST_ADDR, 53))
    listener.settimeout(1)
    sbx = Sandbox.create(template="base", network=air_gapped(["tenant-only.test"], dns_servers=[HOST_ADDR]),
                         **dns_gateway)
    try:
        for proto in ("udp", "tcp"):
            assert query(sbx, "tenant-only.test", proto=proto) == (2, 0, "-"), proto
        with pytest.raises(TimeoutError):
            listener.recvfrom(512)
    finally:
        listener.close()
        sbx.kill()


# `network.rules` (see test_egress_rules.py): a rule's secret goes only to
# the rule host's own addresses, in the one header the rule names, and only
# for the team that owns it.
from test_egress_proxy import requests_to  # noqa: E402
from test_egress_rules import destroy, secret_of  # noqa: E402


def _authorization(name: str) -> dict:
    return {"allowed.test": [{"transform": {"headers": {"Authorization": Secret.fill(name)}}}]}


def test_a_rule_hosts_name_sent_to_another_address_carries_no_secret(egress_gateway):
    """The sandbox picks both the Host (or SNI) and the address: the rule
    host's name sent to another address the sandbox may reach passes, as
    the policy says, without the secret."""
    env, _ = egress_gateway
    value = f"forged-{os.urandom(8).hex()}"
    name = secret_of(env, value)
    sbx = create(env, allow_out=["allowed.test", WEB_OTHER], deny_out=["0.0.0.0/0"], rules=_authorization(name))
    try:
        control, forged, sni = (f"/{kind}-{os.urandom(4).hex()}" for kind in ("control", "forged", "sni"))
        assert fetch(sbx, f"http://allowed.test{control}", f"allowed.test:80:{WEB}") == "200"
        assert [s["headers"].get("Authorization") for s in requests_to(control)] == [value], "the control must pass"
        assert fetch(sbx, f"http://allowed.test{forged}", f"allowed.test:80:{WEB_OTHER}") == "200"
        (seen,) = requests_to(forged)
        assert seen["to"] == WEB_OTHER and value not in json.dumps(seen), seen
        # TLS is never terminated for another address: it passes untouched.
        assert fetch(sbx, f"https://allowed.test{sni}", f"allowed.test:443:{WEB_OTHER}") == "200"
        (seen,) = requests_to(sni)
        assert value not in json.dumps(seen), seen
    finally:
        sbx.kill()
        destroy(env, name)


def test_header_injection_through_a_rule_or_a_secret_is_refused(egress_gateway):
    env, _ = egress_gateway
    injected = {"allowed.test": [{"transform": {"headers": {"X-Key": "v\r\nX-Injected: 1"}}}]}
    with pytest.raises(SandboxException) as caught:
        create(env, allow_out=["allowed.test"], rules=injected)
    assert getattr(caught.value, "status_code", None) == 400
    # A secret's value is the tenant's to choose too: one that would end
    # the header is never sent.
    name = secret_of(env, "v\r\nX-Injected: 1")
    sbx = create(env, allow_out=["allowed.test"], deny_out=["0.0.0.0/0"], rules=_authorization(name))
    try:
        path = f"/crlf-{os.urandom(4).hex()}"
        # Answered by the proxy (a secret it cannot send is a bad gateway),
        # and nothing goes upstream.
        assert fetch(sbx, f"http://allowed.test{path}", f"allowed.test:80:{WEB}") == "502"
        assert requests_to(path) == []
    finally:
        sbx.kill()
        destroy(env, name)


def test_tls_to_a_rule_host_whose_request_names_another_host_gets_421_and_no_secret(egress_gateway):
    """The SNI names the rule host (the leaf the proxy shows, the name it
    verifies upstream), the request another host, which a server shared by
    both (a CDN) would route it to: the proxy answers 421 (400 for an
    absolute-form target) and closes."""
    from test_egress_proxy import REQUESTS

    env, _ = egress_gateway
    value = f"misdirected-{os.urandom(8).hex()}"
    name = secret_of(env, value)
    sbx = create(env, allow_out=["allowed.test", "other.test"], deny_out=["0.0.0.0/0"], rules=_authorization(name))
    try:
        control, other_host, absolute = (f"/{kind}-{os.urandom(4).hex()}" for kind in ("control", "host", "absolute"))

        def status(path: str, extra: str = "") -> str:
            return sbx.commands.run(f"curl -sk -o /dev/null -w '%{{http_code}}' --resolve allowed.test:443:{WEB} "
                                    f"{extra} https://allowed.test{path} || true").stdout

        assert status(control) == "200"
        assert [s["headers"].get("Authorization") for s in requests_to(control)] == [value], "the control must pass"
        assert status(other_host, "-H 'Host: other.test'") == "421"
        # An absolute-form target for another host is a bad request outright
        # (an HTTP/1.1 form: HTTP/2 has no such target, and refuses the stream).
        assert status(absolute, f"--http1.1 --request-target http://other.test{absolute}") == "400"
        assert status(absolute, f"--http2 --request-target http://other.test{absolute}") in ("400", "000")
        with open(REQUESTS) as log:
            arrived = log.read()
        assert other_host not in arrived and absolute not in arrived, "neither request reached a server"
    finally:
        sbx.kill()
        destroy(env, name)


def test_the_egress_ca_key_is_not_reachable_from_a_sandbox_that_trusts_the_ca(egress_gateway):
    import re

    from conftest import DATA_DIR
    from test_egress_rules import leaks

    env, _ = egress_gateway
    ca_dir = DATA_DIR / "egress" / "egress-ca"
    # Base64 lines (a run must not span a line break to be found in a file).
    key_body = "\n".join((ca_dir / "ca-key.pem").read_text().splitlines()[1:-1])
    cert_body = "\n".join((ca_dir / "ca.pem").read_text().splitlines()[1:-1])
    assert stat.S_IMODE(os.stat(ca_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(ca_dir / "ca-key.pem").st_mode) == 0o600
    name = secret_of(env, "v")
    sbx = create(env, allow_out=["allowed.test"], deny_out=["0.0.0.0/0"], rules=_authorization(name))
    try:
        # A run of the base64 without regex metacharacters, from each file.
        key_part = re.findall(r"[A-Za-z0-9]{20,}", key_body)[-1]
        cert_part = re.findall(r"[A-Za-z0-9]{20,}", cert_body)[-1]
        out = sbx.commands.run(f"cat {ca_dir}/ca-key.pem 2>&1; ls -la {ca_dir} 2>&1; true", user="root").stdout
        assert "No such file or directory" in out and "BEGIN" not in out and key_part not in out, out
        assert "copse-egress.crt" in leaks(sbx, cert_part), "the certificate is there: the search must find it"
        assert leaks(sbx, key_part) == ""
    finally:
        sbx.kill()
        destroy(env, name)


def test_a_rule_cannot_name_another_teams_secret(gateway):
    from e2b import SandboxException, Secret
    from test_tenancy import new_key, new_team

    a, b = new_key(new_team("ra")), new_key(new_team("rb"))
    name = f"b-only-{os.urandom(4).hex()}"
    Secret.create(name, "b's value", api_key=b)
    network = {"allow_out": ["allowed.test"], "rules": _authorization(name)}
    try:
        with pytest.raises(SandboxException) as caught:
            Sandbox.create(template="base", network=network, api_key=a, timeout=30)
        assert getattr(caught.value, "status_code", None) == 400
        assert name in str(caught.value)
        sbx = Sandbox.create(template="base", network=network, api_key=b, timeout=30)
        sbx.kill()
    finally:
        Secret.destroy(name, api_key=b)


def test_a_huge_or_garbage_ca_cert_is_refused_and_a_good_one_never_returned(gateway):
    # `egress_proxy.tls.ca_cert` is the caller's PEM, parsed by the host:
    # a megabyte of it or garbage is a 400 before anything is stored.
    pem = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
         "-subj", "/CN=copse-hostile-ca", "-keyout", "/dev/null"], check=True, capture_output=True, text=True).stdout
    address = "socks.test:1443"
    for ca_cert in (pem * (1024 * 1024 // len(pem)), "\x00" * 4096, "-----BEGIN CERTIFICATE-----\n" + "A" * 8000,
                    pem.replace("CERTIFICATE", "PRIVATE KEY")):
        socks_refused({"egress_proxy": {"address": address, "tls": {"ca_cert": ca_cert}}})
    sbx = Sandbox.create(template="base", network={"egress_proxy": {"address": address, "tls": {"ca_cert": pem}}})
    try:
        headers = {"X-API-Key": os.environ["E2B_API_KEY"]}
        api = os.environ["E2B_API_URL"]
        for path in (f"/sandboxes/{sbx.sandbox_id}", "/v2/sandboxes", "/sandboxes"):
            body = httpx.get(f"{api}{path}", headers=headers).text
            assert "CERTIFICATE" not in body and pem.splitlines()[1] not in body, path
        assert sbx.get_info().network["egress_proxy"] == {"address": address, "tls": {}}
    finally:
        sbx.kill()


# The image-builds gateway of test_images (a registry mirror of its own).
from test_images import builder, drop, image_with  # noqa: E402,F401


@pytest.mark.timeout(600, func_only=True)
def test_an_images_template_is_reached_only_through_a_team_template_built_on_it(builder):
    # An image's template may hold a team's private image: no listing names
    # it, no create or `from_template` reaches it, a refusal's list of
    # templates names none, and a team template of its name is only that.
    from e2b import Template
    from e2b.exceptions import BuildException

    repository = f"copse-test/hidden-{os.urandom(3).hex()}"
    digest = image_with(builder, builder.public, repository)
    internal = f"image-{digest.removeprefix('sha256:')[:16]}"
    name = f"hidden-{os.urandom(3).hex()}"
    headers = {"X-API-KEY": builder.env["api_key"]}
    try:
        Template.build(Template().from_image(f"{repository}:1").run_cmd("true"), alias=name, **builder.env)
        assert (builder.data_dir / "templates" / internal).is_dir()
        for path in ("/templates", "/default-templates"):
            listed = httpx.get(builder.url + path, headers=headers, timeout=30)
            assert listed.status_code == 200 and "image-" not in listed.text, (path, listed.text)
        refused = httpx.post(builder.url + "/sandboxes", json={"templateID": internal, "timeout": 30},
                             headers=headers, timeout=60)
        assert refused.status_code in (400, 404), refused.text
        assert "image-" not in refused.json()["message"].replace(internal, ""), refused.text
        with pytest.raises(BuildException) as based:
            Template.build(Template().from_template(internal).run_cmd("true"), alias=f"{name}-on", **builder.env)
        assert "image-" not in str(based.value).replace(internal, ""), based.value
        # A team's own template of that name is its own: its files, not the
        # image's, and deleting it leaves the image's template alone.
        Template.build(Template().from_template("base").run_cmd("touch /tmp/own"), alias=internal, **builder.env)
        own = Sandbox.create(internal, timeout=60, **builder.env)
        try:
            assert own.commands.run("[ -e /tmp/own ] && [ ! -e /etc/image-marker ]").exit_code == 0
        finally:
            own.kill()
        drop(builder, internal)
        assert (builder.data_dir / "templates" / internal).is_dir()
        sbx = Sandbox.create(name, timeout=60, **builder.env)
        try:
            assert sbx.commands.run("read -r m < /etc/image-marker").exit_code == 0
        finally:
            sbx.kill()
    finally:
        drop(builder, internal)
        drop(builder, name)


from object_store import copse_snapshot, object_store, snapshot_with_file  # noqa: E402,F401


@pytest.mark.timeout(300, func_only=True)
def test_a_pulled_snapshot_is_only_what_its_manifests_hashes_name(gateway, object_store):
    """Whoever can write the object store (another host, a leaked bucket
    key) cannot make `copse snapshot pull` import other bytes than the
    manifest's chunk hashes name, read keys outside `chunks/`, or trust a
    manifest whose sizes lie, nor have a compressed chunk expand past the
    length its manifest lists; nothing is imported from a refused pull."""
    name = f"hashed-{os.urandom(4).hex()}"
    snapshot_with_file(name, "/home/user/note", "the real bytes")
    on_disk = ["--data-dir", str(gateway.data_dir)]
    copse_snapshot(object_store, "push", name, *on_disk)
    Sandbox.delete_snapshot(name)

    def refused(*args, says: str | tuple[str, ...]):
        done = copse_snapshot(object_store, "pull", *args, *on_disk, check=False)
        says = (says,) if isinstance(says, str) else says
        assert done.returncode != 0 and any(s in done.stderr for s in says), done.stderr[-2000:]
        listed = [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
        assert not any(name in s for s in listed), f"a refused pull imported something: {listed}"

    manifest_key = f"snapshots/default/{name}"
    manifest_bytes = object_store.read(manifest_key)
    manifest = json.loads(manifest_bytes)
    for chunk in manifest["chunks"]:
        victim = f"chunks/{chunk['sha256']}" + (".lz4" if chunk.get("codec") == "lz4" else "")
        original = object_store.read(victim)
        object_store.overwrite(victim, bytes(b ^ 0x55 for b in original))
        # A compressed chunk may fail to decompress before it fails its hash.
        refused(name, says=("does not match its name", "does not decompress"))
        object_store.overwrite(victim, original)
    # A compressed chunk that expands past its listed length.
    packed = next((c for c in manifest["chunks"] if c.get("codec") == "lz4"), None)
    assert packed is not None, "a snapshot's tar compresses"
    forged = dict(manifest, chunks=[dict(c, len=c["len"] - 1) if c is packed else c for c in manifest["chunks"]],
                  size=manifest["size"] - 1)
    object_store.overwrite(manifest_key, json.dumps(forged).encode())
    refused(name, says="does not decompress")
    object_store.overwrite(manifest_key, manifest_bytes)

    forgeries = [
        dict(manifest, chunks=[dict(manifest["chunks"][0], sha256="../" * 20 + "etc/passwd")]),
        dict(manifest, chunks=[dict(manifest["chunks"][0], sha256=manifest["chunks"][0]["sha256"].upper())]),
        dict(manifest, size=manifest["size"] + 1),
        dict(manifest, chunks=[dict(c, len=1 << 30) for c in manifest["chunks"]], size=(1 << 30) * len(manifest["chunks"])),
    ]
    for forged in forgeries:
        object_store.overwrite(manifest_key, json.dumps(forged).encode())
        refused(name, says="manifest")
    object_store.overwrite(manifest_key, manifest_bytes)

    for outside in ("../default/x", ".."):
        refused(outside, "--name", f"{name}-x", says="invalid snapshot name")
    for ambiguous in ("a//b", "./x", "x/"):  # one S3 key for two names
        refused(ambiguous, "--name", f"{name}-x", says="path segment")
    refused(name, "--team", "../other", "--name", f"{name}-x", says="invalid team name")

    copse_snapshot(object_store, "pull", name, *on_disk)
    try:
        child = Sandbox.create(template=name, timeout=60)
        assert child.files.read("/home/user/note") == "the real bytes"
        child.kill()
    finally:
        Sandbox.delete_snapshot(name)



@pytest.mark.timeout(300, func_only=True)
def test_a_forged_manifest_or_odd_key_never_makes_gc_remove_anything_but_unnamed_chunks(gateway, object_store):
    """Whoever writes the bucket plants a manifest naming keys outside
    `chunks/`, and objects under `chunks/` that are not a chunk's name,
    hoping `copse snapshot gc` removes a snapshot's manifest or follows a
    path. Collection reads a manifest only as one (a forged one names
    nothing and is reported) and removes only `chunks/<sha256>` keys."""
    name = f"gc-victim-{os.urandom(4).hex()}"
    snapshot_with_file(name, "/home/user/note", "kept through gc")
    copse_snapshot(object_store, "push", name, "--data-dir", str(gateway.data_dir))
    Sandbox.delete_snapshot(name)
    forged = {"format": "copse-chunks 1", "size": 1, "chunks": [{"sha256": f"../snapshots/default/{name}", "len": 1}]}
    object_store.overwrite(f"snapshots/default/forged-{name}", json.dumps(forged).encode())
    odd = [f"chunks/{'0' * 63}", f"chunks/{'a' * 64}.x", f"chunks/nested/{'b' * 64}"]
    for key in odd:
        object_store.overwrite(key, b"not a chunk")
    out = copse_snapshot(object_store, "gc", "--min-age-hours", "0").stdout
    assert f"not a manifest (left alone): snapshots/default/forged-{name}" in out, out
    assert object_store.read(f"snapshots/default/{name}") is not None
    assert object_store.read(f"snapshots/default/forged-{name}") is not None
    assert [key for key in odd if object_store.read(key) is None] == [], "only a chunk's own name is collected"
    copse_snapshot(object_store, "pull", name, "--data-dir", str(gateway.data_dir))
    Sandbox.delete_snapshot(name)

from postgres_server import database_server, database_url  # noqa: E402,F401
from test_cluster import (  # noqa: E402,F401
    cluster_ca, create_on, create_while_stored, drain, image_key, node_cert, nodes, stored_image,
)
from test_cluster import HEARTBEAT_S, LOST_AFTER_S, NODE_TABLE_TTL_S, kill_quietly, limited_team, node_table  # noqa: E402
from test_cluster import lazy_server_pids, on_one_seen_through_two, paused_field, stored_paused  # noqa: E402
from test_cluster import stored_volume, volume_file, volume_move  # noqa: E402
from test_cluster import built_from_private_image, private_image, stored_lazy_image_layers  # noqa: E402
from test_cluster import from_private_image, ran_commands, stored_layers  # noqa: E402
from test_lifecycle import processes_end, start_holder  # noqa: E402
from test_templates import build_logged, cached_steps, run_steps  # noqa: E402


def test_a_forged_forwarding_mark_never_lets_a_gateway_act_on_another_nodes_sandbox(nodes, database_url):
    """A caller marks its request as already forwarded by another node,
    hoping the gateway it reaches acts on a sandbox its host does not hold
    (a kill there would forget the record and leave the sandbox running
    unseen). A mark counts only on the peer listener, over the cluster's
    mutual TLS: on the public listener it is dropped and the call goes to
    the sandbox's own node like any other."""
    one, two = nodes
    victim = create_on(one, nodes, database_url, via=one)
    try:
        forged = {"x-copse-forwarded-by": two.id, "X-API-KEY": one.env()["api_key"]}
        files = httpx.get(
            f"{two.url}/files",
            params={"path": "/etc/hostname"},
            headers={**forged, "e2b-sandbox-id": victim.sandbox_id, "X-Access-Token": victim._envd_access_token},
            timeout=30,
        )
        assert files.status_code == 200, files.text
        assert files.text == victim.files.read("/etc/hostname")
        kill = httpx.delete(f"{two.url}/sandboxes/{victim.sandbox_id}", headers=forged, timeout=30)
        assert kill.status_code == 204, kill.text
        assert not one.holds(victim.sandbox_id), "the kill reached the node that runs the sandbox"
        assert victim.sandbox_id not in {s.sandbox_id for s in Sandbox.list(**two.env()).next_items()}
    finally:
        if one.holds(victim.sandbox_id):
            victim.kill()


def peer_context(node, cert_dir=None) -> ssl.SSLContext:
    """TLS that trusts the cluster CA and shows the node certificate in
    `cert_dir`, if any."""
    context = ssl.create_default_context(cafile=f"{node.tls}/ca.pem")
    if cert_dir is not None:
        context.load_cert_chain(f"{cert_dir}/node.pem", f"{cert_dir}/node-key.pem")
    return context


def peer_client(node, cert_dir=None) -> httpx.Client:
    """A client of `node`'s peer listener (see `peer_context`)."""
    return httpx.Client(base_url=f"https://127.0.0.1:{node.peer_port}", verify=peer_context(node, cert_dir), timeout=30)


def test_only_a_node_of_the_cluster_ca_reaches_the_peer_listener(nodes, database_url, tmp_path):
    """The peer listener is where a forwarded call is believed: a client
    without a certificate, or with one from another CA, gets no answer; a
    node of the cluster does, and a call it marks as forwarded is still
    never acted on by a node that does not hold the sandbox."""
    one, two = nodes
    victim = create_on(one, nodes, database_url, via=one)
    try:
        api = {"X-API-KEY": one.env()["api_key"]}
        stranger = node_cert(cluster_ca(tmp_path / "other-ca"), tmp_path / "stranger")
        for refused in (peer_client(one), peer_client(one, stranger)):
            with refused, pytest.raises((httpx.TransportError, ssl.SSLError)):
                refused.get(f"/sandboxes/{victim.sandbox_id}", headers=api)
        with peer_client(one, two.tls) as peer:
            detail = peer.get(f"/sandboxes/{victim.sandbox_id}", headers={**api, "x-copse-forwarded-by": two.id})
            assert detail.status_code == 200, detail.text
            assert detail.json()["sandboxID"] == victim.sandbox_id
        with peer_client(two, one.tls) as peer:
            marked = peer.delete(f"/sandboxes/{victim.sandbox_id}", headers={**api, "x-copse-forwarded-by": one.id})
            assert marked.status_code == 409, marked.text
        assert victim.commands.run("echo alive").stdout.strip() == "alive"
    finally:
        victim.kill()


def test_a_leaked_node_certificate_reaches_no_node_once_revoked(nodes, database_url, tmp_path):
    """A node certificate leaks (a decommissioned host's disk). Until it is
    revoked it reaches the peer listener as a node would. Once `copse tls
    revoke --database` publishes the list, the running nodes take it up at
    their next heartbeat, with no restart: a connection it holds is closed
    and a new handshake fails on either node. Whoever can write the
    database cannot take the revocation back, with an older list of the
    CA or one another CA signed. Node two's certificate still gets through
    and the cluster keeps forwarding."""
    one, two = nodes
    api = {"X-API-KEY": one.env()["api_key"]}
    crl = pathlib.Path(one.ca) / "crl.pem"
    revoke(one.ca, node_cert(one.ca, tmp_path / "retired"), database_url)
    older = crl.read_text()
    leaked = node_cert(one.ca, tmp_path / "leaked")
    held = http.client.HTTPSConnection("127.0.0.1", one.peer_port, context=peer_context(one, leaked), timeout=10)
    try:
        held.request("GET", "/sandboxes", headers=api)
        answer = held.getresponse()
        assert answer.read() is not None and answer.status == 200, "a node's certificate reaches the listener"
        revoke(one.ca, leaked, database_url)
        published = crl.read_text()
        # Kept busy, the connection never idles out: only the list ends it.
        deadline = time.monotonic() + 8 * HEARTBEAT_S
        while True:
            assert time.monotonic() < deadline, "the held connection outlived the revocation"
            try:
                held.request("GET", "/sandboxes", headers=api)
                assert held.getresponse().read() is not None
            except (OSError, http.client.HTTPException):
                break
            time.sleep(0.2)
        assert "client certificate was revoked" in (one.data_dir / "gateway.log").read_text()
    finally:
        held.close()
    for node in nodes:
        # Each node at its own heartbeat.
        deadline = time.monotonic() + 4 * HEARTBEAT_S
        while reaches_peer_listener(node, leaked):
            assert time.monotonic() < deadline, "the node still takes the revoked certificate"
            time.sleep(0.2)
        assert (pathlib.Path(node.tls) / "crl.pem").read_text() == published
    forged = (pathlib.Path(cluster_ca(tmp_path / "other-ca")) / "crl.pem")
    revoke(str(forged.parent), node_cert(str(forged.parent), tmp_path / "stranger"))
    try:
        for pem in (older, forged.read_text()):
            publish_revocations(database_url, pem)
            time.sleep(3 * HEARTBEAT_S)
            assert not any(reaches_peer_listener(node, leaked) for node in nodes)
    finally:
        publish_revocations(database_url, published)
    assert reaches_peer_listener(one, two.tls)
    sbx = create_on(one, nodes, database_url, via=two)
    try:
        assert sbx.commands.run("echo forwarded").stdout.strip() == "forwarded"
    finally:
        sbx.kill()


def reaches_peer_listener(node, cert_dir: str) -> bool:
    """Whether a client showing the certificate in `cert_dir` gets an
    answer from `node`'s peer listener."""
    with peer_client(node, cert_dir) as client:
        try:
            return client.get("/sandboxes", headers={"X-API-KEY": node.env()["api_key"]}).status_code == 200
        except (httpx.TransportError, ssl.SSLError):
            return False


def revoke(ca: str, cert_dir: str, database: str | None = None):
    """`copse tls revoke` of the node certificate in `cert_dir`."""
    args = [str(COPSE), "tls", "revoke", "--ca", ca, f"{cert_dir}/node.pem"]
    subprocess.run(args + (["--database", database] if database else []), check=True, capture_output=True)


def publish_revocations(database: str, pem: str):
    """Writes `pem` as the published list, as anyone with the database could."""
    subprocess.run(["psql", database, "-v", "ON_ERROR_STOP=1", "-v", f"pem={pem}"], check=True,
                   capture_output=True, text=True,
                   input="UPDATE revocation_lists SET pem = :'pem' WHERE id = 'cluster';")


def test_a_manifest_swapped_in_the_bucket_never_starts_another_snapshots_files(nodes, database_url, object_store):
    """Whoever can write the cluster's bucket puts one snapshot's manifest
    under another's name, hoping a node that fetches the first starts the
    second's files (another sandbox's secrets, under a name the victim
    trusts). The node checks the fetched stream names the files the
    database records for that snapshot, and refuses anything else; the
    layer image it would mount as it arrives is refused first, its
    manifest not hashing to what the record keeps."""
    one, two = nodes
    tag = os.urandom(4).hex()
    names = {text: f"swap-{text}-{tag}" for text in ("victim", "other")}
    source = create_on(one, nodes, database_url, via=one)
    try:
        for text, name in names.items():
            source.files.write("/home/user/note", text)
            source.create_snapshot(name=name, mode="filesystem")
    finally:
        source.kill()
    keys = {text: f"snapshots/default/{name}" for text, name in names.items()}
    all_stored(object_store, keys.values())
    try:
        # The layer's image too: its manifest is refused on the record's
        # hash, and the stream is what is left to try.
        refused_while_swapped(nodes, database_url, object_store, keys,
                              lambda: create_while_stored(names["victim"], via=two), "victim", ("", "@layer0"))
    finally:
        for name in names.values():
            Sandbox.delete_snapshot(name, **one.env())


def test_a_volume_swapped_in_the_bucket_is_never_taken_for_another(nodes, database_url, object_store):
    """Volumes leaving a drained node wait in the bucket for their next
    node. Whoever can write the bucket puts another team's or another
    volume's stream under the victim's key, hoping the victim's token then
    opens the other's files. The node asked refuses the stream on the hash
    the database keeps (a 503, nothing of it kept), and the victim's own
    bytes come back when its node is undrained."""
    one, two = nodes
    made = {}
    try:
        for text in ("victim", "other"):
            volume = Volume.create(f"swap-{text}-{secrets.token_hex(4)}", api_key=API_KEY, api_url=one.url)
            made[text] = volume
            put = httpx.put(f"{one.url}/volumecontent/{volume.volume_id}/file", params={"path": "/owner.txt"},
                            content=text.encode(), headers={"Authorization": f"Bearer {volume.token}"}, timeout=30)
            assert put.status_code < 300, put.text
        subprocess.run([str(COPSE), "node", "drain", one.id, "--move-sandboxes", "--database", database_url],
                       check=True)
        try:
            streams = {text: stored_volume(object_store, database_url, v.volume_id) for text, v in made.items()}
            object_store.overwrite(f"volumes/default/{made['victim'].volume_id}", streams["other"])
            read = volume_file(two, made["victim"], "/owner.txt")
            assert read.status_code == 503, read.text
            assert "not the manifest its record names" in read.text, read.text
            assert not (two.data_dir / "disk" / ".volumes" / made["victim"].volume_id).exists(), "nothing kept"
            assert volume_move(database_url, made["victim"].volume_id) == (one.id, "stored")
        finally:
            drain(one, database_url, False)
        deadline = time.monotonic() + 5 * HEARTBEAT_S
        while volume_move(database_url, made["victim"].volume_id) != (one.id, ""):
            assert time.monotonic() < deadline, "node one never took its volume back"
            time.sleep(0.2)
        for text, volume in made.items():
            assert volume_file(two, volume, "/owner.txt").text == text
    finally:
        drain(one, database_url, False)
        for volume in made.values():
            Volume.destroy(volume.volume_id, api_key=API_KEY, api_url=one.url)


def test_a_checkpoint_swapped_in_the_bucket_never_restores_another_snapshots_memory(nodes, database_url,
                                                                                   object_store):
    """A snapshot with memory sends an image of its checkpoint apart from
    its layers (`…@memimage`), served as read like theirs. Whoever can
    write the bucket puts another snapshot's checkpoint image there,
    hoping the victim's name restores the other's processes (and what is
    in their memory). The node refuses it on the hash the database keeps,
    fetches the snapshot's own stream whole instead, and restores the
    victim's processes only."""
    one, two = nodes
    tag = os.urandom(4).hex()
    names = {text: f"swap-memory-{text}-{tag}" for text in ("victim", "other")}
    for text, name in names.items():
        source = create_on(one, nodes, database_url, via=one)
        try:
            source.commands.run(f"sleep {4242 if text == 'victim' else 4343}", background=True)
            source.create_snapshot(name=name, mode="full")
        finally:
            source.kill()
    keys = {text: f"snapshots/default/{name}@memimage" for text, name in names.items()}
    all_stored(object_store, keys.values())
    object_store.overwrite(keys["victim"], object_store.read(keys["other"]))
    drain(one, database_url)
    try:
        time.sleep(NODE_TABLE_TTL_S + 0.5)
        moved = create_while_stored(names["victim"], via=two)
        try:
            assert two.holds(moved.sandbox_id)
            processes = moved.commands.run("ps -eo args").stdout
            assert "sleep 4242" in processes and "sleep 4343" not in processes, processes
            log = (two.data_dir / "gateway.log").read_text().splitlines()
            assert any(f"snapshot {names['victim']}" in line and "fetching it whole" in line for line in log), \
                "refused, then fetched whole"
        finally:
            moved.kill()
    finally:
        drain(one, database_url, False)
        for name in names.values():
            Sandbox.delete_snapshot(name, **one.env())


def test_a_lazily_mounted_layer_never_serves_a_byte_its_manifest_does_not_name(nodes, database_url, object_store):
    """A node mounts a lazily fetched layer's image in its own kernel, from
    a bucket whoever holds its keys can write. Every byte is vouched for:
    the record (in the trusted database) keeps the hash of each image's
    manifest, and the manifest each chunk's. With a chunk in the middle
    of the image altered, the sandbox still starts and reads the files
    elsewhere in the image, but reading the file that chunk holds fails
    (EIO), never returning other bytes; the layer server's log says why."""
    one, two = nodes
    name = f"lazy-tamper-{os.urandom(4).hex()}"
    source = create_on(one, nodes, database_url, via=one)
    try:
        source.files.write("/home/user/note", "intact")
        source.commands.run("head -c 8M /dev/urandom > /home/user/big", timeout=60)
        source.create_snapshot(name=name, mode="filesystem")
    finally:
        source.kill()
    manifest_key = f"snapshots/default/{name}@layer0"
    deadline = time.monotonic() + 60
    while not object_store.read(manifest_key):
        assert time.monotonic() < deadline, "the node stored the layer's image"
        time.sleep(0.5)
    middle, victim, original = alter_middle_chunk(object_store, manifest_key)
    drain(one, database_url)
    try:
        time.sleep(NODE_TABLE_TTL_S + 0.5)
        moved = create_while_stored(name, via=two)
        try:
            assert two.holds(moved.sandbox_id)
            assert "to arrive as read" in (two.data_dir / "gateway.log").read_text()
            assert moved.files.read("/home/user/note") == "intact"
            read = moved.commands.run("cat /home/user/big > /dev/null; echo rc=$?", timeout=120)
            assert "rc=1" in read.stdout and "Input/output error" in read.stderr, (read.stdout, read.stderr)
            logs = "".join(p.read_text() for p in (two.data_dir / "lazy").glob("*/server.log"))
            assert f"chunk {middle['sha256']} does not match its name" in logs
            # The server gets the bucket's keys and nothing else of the
            # gateway's environment (which here holds all of pytest's).
            for server in lazy_server_pids(two):
                names = {entry.split(b"=", 1)[0].decode()
                         for entry in pathlib.Path(f"/proc/{server}/environ").read_bytes().split(b"\0") if entry}
                assert "AWS_SECRET_ACCESS_KEY" in names
                assert names <= {"PATH", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "COPSE_LOG",
                                 "COPSE_LOG_FORMAT"}, names
        finally:
            moved.kill()
    finally:
        object_store.overwrite(victim, original)
        drain(one, database_url, False)
        Sandbox.delete_snapshot(name, **one.env())


@pytest.mark.timeout(300, func_only=True)
def test_a_memory_page_altered_in_the_bucket_is_never_run_on(nodes, database_url, object_store):
    """A checkpoint's image is read from a bucket whoever holds its keys can
    write, page by page as a lazily restored sandbox touches its memory.
    With one chunk of a 160 MiB process's pages altered, the pager's read
    of that chunk fails on its hash (the image server's log says so), and
    the sandbox's processes are killed rather than run on memory they
    never got back: after node two handed the sandbox over, or before,
    when the background copy gets there first (the create then fails)."""
    one, two = nodes
    name = f"memory-tamper-{os.urandom(4).hex()}"
    source = create_on(one, nodes, database_url, via=one)
    try:
        start_holder(source, 160)
        source.create_snapshot(name=name, mode="full")
    finally:
        source.kill()
    manifest_key = f"snapshots/default/{name}@memimage"
    all_stored(object_store, [manifest_key], within_s=120)
    middle, victim, original = alter_middle_chunk(object_store, manifest_key)
    drain(one, database_url)
    try:
        time.sleep(NODE_TABLE_TTL_S + 0.5)
        try:
            moved = create_while_stored(name, via=two, deadline_s=120)
        except SandboxException as e:
            assert "500" in str(e), e
            moved = None
        try:
            if moved is not None:
                assert two.holds(moved.sandbox_id)
                processes_end(moved.sandbox_id, within_s=60)
            assert b"copying a restored sandbox's memory failed" in (two.data_dir / "gateway.log").read_bytes()
            logs = "".join(p.read_text() for p in (two.data_dir / "lazy").glob("*/server.log"))
            assert f"chunk {middle['sha256']} does not match its name" in logs
        finally:
            if moved is not None:
                moved.kill()
    finally:
        object_store.overwrite(victim, original)
        drain(one, database_url, False)
        Sandbox.delete_snapshot(name, **one.env())


def alter_middle_chunk(object_store, manifest_key: str) -> tuple[dict, str, bytes]:
    """Flips every bit of the chunk in the middle of the stream
    `manifest_key` names, in the bucket: that chunk's manifest entry, its
    key and its original bytes (to put back)."""
    chunks = json.loads(object_store.read(manifest_key))["chunks"]
    middle = chunks[len(chunks) // 2]
    victim = f"chunks/{middle['sha256']}" + (".lz4" if middle.get("codec") == "lz4" else "")
    original = object_store.read(victim)
    object_store.overwrite(victim, bytes(b ^ 0x55 for b in original))
    return middle, victim, original


def all_stored(object_store, keys, within_s: float = 60):
    """Once a node has stored every one of `keys` in the bucket."""
    deadline = time.monotonic() + within_s
    while not all(object_store.read(k) for k in keys):
        assert time.monotonic() < deadline, f"the node stored {list(keys)}"
        time.sleep(0.5)


def refused_while_swapped(nodes, database: str, object_store, keys: dict, create, note: str, suffixes=("",)):
    """With `keys["other"]`'s objects under `keys["victim"]` (each key with
    each of `suffixes`) and node one drained, `create()` is refused as
    another version; once the real objects are back, it starts on node two
    with `note` in its files."""
    one, two = nodes
    real = {suffix: object_store.read(keys["victim"] + suffix) for suffix in suffixes}
    for suffix in suffixes:
        object_store.overwrite(keys["victim"] + suffix, object_store.read(keys["other"] + suffix))
    drain(one, database)
    try:
        time.sleep(NODE_TABLE_TTL_S + 0.5)
        with pytest.raises(Exception, match="another version"):
            create()
        for suffix, data in real.items():
            object_store.overwrite(keys["victim"] + suffix, data)
        moved = create()
        try:
            assert two.holds(moved.sandbox_id)
            assert moved.files.read("/home/user/note") == note
        finally:
            moved.kill()
    finally:
        drain(one, database, False)


def test_a_template_image_swapped_in_the_bucket_never_starts_another_templates_files(nodes, database_url,
                                                                                     object_store):
    """Whoever can write the cluster's bucket puts one built template's
    image under another's key, hoping a node that fetches the first starts
    the second's files. The node checks that the fetched stream names the
    template and image the database records, and refuses anything else
    (the layer image it would mount as it arrives is refused first, its
    manifest not hashing to what the labels keep); the real image still
    starts once it is back."""
    from e2b import Template

    one = nodes[0]
    tag = os.urandom(4).hex()
    names = {text: f"swap-image-{text}-{tag}" for text in ("victim", "other")}
    for text, name in names.items():
        Template.build(Template().from_template("base").run_cmd(f"echo {text} > /home/user/note"), alias=name,
                       **one.env())
    images = {text: image_key(database_url, name) for text, name in names.items()}
    for key in images.values():
        stored_image(object_store, key)
        stored_lazy_image_layers(database_url, key)
    try:
        # The top layer's image too: refused on the hash the labels keep,
        # which leaves the stream to try.
        refused_while_swapped(nodes, database_url, object_store, {t: f"images/{k}" for t, k in images.items()},
                              lambda: Sandbox.create(names["victim"], timeout=60, **one.env()), "victim\n",
                              ("", "@layer0"))
    finally:
        for name in names.values():
            httpx.delete(f"{one.url}/templates/{name}", headers={"X-API-KEY": API_KEY}, timeout=60)


def test_a_build_cache_entry_swapped_in_the_bucket_is_never_stacked_on(nodes, database_url, object_store):
    """Whoever can write the cluster's bucket puts one build cache entry's
    files under another's key, hoping a build on another node stacks on
    them. That node checks that the fetched stream names the entry's files
    as the database records them, refuses it, and runs the step itself:
    its template holds what its own step wrote."""
    from e2b import Template

    one, two = nodes
    tag = os.urandom(4).hex()
    base = f"swap-layer-base-{tag}"
    Template.build(Template().from_template("base").run_cmd("true"), alias=base, **one.env())
    stored_image(object_store, image_key(database_url, base))
    steps = {text: Template().from_template(base).run_cmd(f"echo {text} > /home/user/note")
             for text in ("victim", "other")}
    names = {text: f"swap-layer-{text}-{tag}" for text in steps}
    rebuilt = f"swap-layer-victim-two-{tag}"
    try:
        for text, template in steps.items():
            Template.build(template, alias=names[text], **one.env())
        [victim], [other] = (stored_layers(database_url, names[text]) for text in ("victim", "other"))
        saved = object_store.read(f"layers/{victim}")
        object_store.overwrite(f"layers/{victim}", object_store.read(f"layers/{other}"))
        try:
            messages, _ = build_logged(steps["victim"], rebuilt, **two.env())
            assert cached_steps(messages) == [] and run_steps(messages) == [1], messages
            sbx = Sandbox.create(rebuilt, timeout=60, **two.env())
            try:
                assert sbx.files.read("/home/user/note") == "victim\n"
            finally:
                sbx.kill()
        finally:
            object_store.overwrite(f"layers/{victim}", saved)
    finally:
        for name in [*names.values(), rebuilt, base]:
            httpx.delete(f"{one.url}/templates/{name}", headers={"X-API-KEY": API_KEY}, timeout=60)


def test_a_build_from_an_image_on_another_node_never_stacks_on_another_teams_or_another_images_entries(
        nodes, database_url, object_store):
    """A build cache entry on an image's template is known by the image's
    digest, so it serves builds of that image on every node; but only the
    team's own. Another team building the same image with the same step
    through node two runs the step itself; and once the tag is pushed over
    with another image, the default team's build of that tag through node
    two runs it again, on the new image's files."""
    one, two = nodes
    repository = f"copse-test/cache-owner-{os.urandom(3).hex()}"
    reference, _, marker = private_image(one, repository)
    command = "echo step > /home/user/note"
    tag = os.urandom(3).hex()
    names = [f"image-owner-{n}-{tag}" for n in ("default", "other", "repushed")]
    _, other_key = limited_team(database_url, "cache-other", "--max-sandboxes", "5")

    def marker_of(name: str, **env) -> str:
        sbx = Sandbox.create(name, timeout=60, **env)
        try:
            return sbx.commands.run("read -r m < /etc/image-marker; echo $m").stdout.strip()
        finally:
            sbx.kill()

    try:
        messages, _ = build_logged(from_private_image(reference).run_cmd(command), names[0], **one.env())
        assert ran_commands(messages) == [command], messages
        stored_layers(database_url, names[0])
        messages, _ = build_logged(from_private_image(reference).run_cmd(command), names[1],
                                   **two.env(api_key=other_key))
        assert ran_commands(messages) == [command] and cached_steps(messages) == [], messages
        assert marker_of(names[1], **two.env(api_key=other_key)) == marker
        _, _, pushed_over = private_image(one, repository)
        messages, _ = build_logged(from_private_image(reference).run_cmd(command), names[2], **two.env())
        assert ran_commands(messages) == [command] and cached_steps(messages) == [], messages
        assert marker_of(names[2], **two.env()) == pushed_over != marker
    finally:
        httpx.delete(f"{one.url}/templates/{names[1]}", headers={"X-API-KEY": other_key}, timeout=60)
        for name in (names[0], names[2]):
            httpx.delete(f"{one.url}/templates/{name}", headers={"X-API-KEY": API_KEY}, timeout=60)


def test_an_image_blob_swapped_in_the_bucket_never_becomes_another_templates_base(nodes, database_url,
                                                                                  object_store):
    """Whoever can write the cluster's bucket puts one image's layer blob
    under the key of another template's, hoping a node that makes the
    victim's image template from the object store unpacks the other
    image. The node checks each blob against the digest the database
    keeps: the create is refused, nothing of the image is made there; once
    the real blob is back, the victim starts on node two with its own
    image."""
    one, two = nodes
    tag = os.urandom(3).hex()
    made = {}
    for text in ("victim", "other"):
        reference, image_template, marker = private_image(one, f"copse-test/swap-{text}-{tag}")
        name = f"swap-base-{text}-{tag}"
        built_from_private_image(one, reference, name, text)
        made[text] = (name, image_key(database_url, name), image_template, marker)
    for _, key, _, _ in made.values():
        stored_image(object_store, key)
    victim, other = made["victim"], made["other"]
    real = object_store.read(f"images/{victim[1]}@base0")
    object_store.overwrite(f"images/{victim[1]}@base0", object_store.read(f"images/{other[1]}@base0"))

    def on_two():
        return {p.name for p in (two.data_dir / "sandboxes").glob("*")}

    drain(one, database_url)
    try:
        time.sleep(NODE_TABLE_TTL_S + 0.5)
        before = on_two()
        with pytest.raises(Exception, match="refused"):
            Sandbox.create(victim[0], timeout=60, **one.env())
        assert not (two.data_dir / "templates" / victim[2]).exists(), "no template of the swapped blob"
        assert not (two.data_dir / "templates" / other[2]).exists()
        assert on_two() == before, "no sandbox left of the refused create"
        object_store.overwrite(f"images/{victim[1]}@base0", real)
        moved = Sandbox.create(victim[0], timeout=120, **one.env())
        try:
            assert two.holds(moved.sandbox_id)
            out = moved.commands.run("read -r m < /etc/image-marker; echo $m; read -r n < /home/user/note; echo $n")
            assert out.stdout.split() == [victim[3], "victim"], out.stdout
        finally:
            moved.kill()
    finally:
        drain(one, database_url, False)
        for name, _, _, _ in made.values():
            httpx.delete(f"{one.url}/templates/{name}", headers={"X-API-KEY": API_KEY}, timeout=60)


def test_a_team_spreading_its_creates_over_the_nodes_runs_no_more_than_its_limit(nodes, database_url):
    """A team may run two sandboxes and sends its creates to every node,
    hoping each counts only what it holds. With one on each node, a third is
    refused with a 429 through either gateway, wherever placement would put
    it; once one is killed, a create passes again."""
    one, two = nodes
    _, key = limited_team(database_url, "capped", "--max-sandboxes", "2")
    made = []
    try:
        made.append(create_on(one, nodes, database_url, via=one, api_key=key))
        made.append(create_on(two, nodes, database_url, via=one, api_key=key))
        time.sleep(2 * HEARTBEAT_S + 1)  # each node's figures reach the other at its heartbeat
        for via in nodes:
            with pytest.raises(RateLimitException, match="max-sandboxes"):
                made.append(Sandbox.create(timeout=60, **via.env(key)))
        made.pop(0).kill()
        time.sleep(2 * HEARTBEAT_S + 1)
        made.append(Sandbox.create(timeout=60, **two.env(key)))
    finally:
        kill_quietly(made)


def test_a_burst_of_creates_placed_on_two_nodes_at_once_runs_no_more_than_the_teams_limit(nodes, database_url):
    """A team may run two sandboxes and sends six creates at once, which
    placement spreads over both nodes: each node alone sees room for two,
    and neither has heard of the other's before its next heartbeat. Exactly
    two run; the other four are refused with a 429, and no sandbox of the
    team runs that a create did not answer for."""
    one, two = nodes
    _, key = limited_team(database_url, "burst", "--max-sandboxes", "2")

    def create():
        try:
            return Sandbox.create(timeout=60, **one.env(key))
        except RateLimitException as refused:
            assert "max-sandboxes" in str(refused)
            return None

    made = []
    try:
        with ThreadPoolExecutor(max_workers=6) as pool:
            answers = list(pool.map(lambda _: create(), range(6)))
        made = [s for s in answers if s is not None]
        assert len(made) == 2, f"{len(made)} of the team's creates ran, its limit is 2"
        listed = Sandbox.list(**one.env(key)).next_items()
        assert sorted(s.sandbox_id for s in listed) == sorted(s.sandbox_id for s in made)
        time.sleep(2 * HEARTBEAT_S + 1)  # the claims settle into the nodes' figures: still two
        with pytest.raises(RateLimitException, match="max-sandboxes"):
            made.append(Sandbox.create(timeout=60, **two.env(key)))
    finally:
        kill_quietly(made)


@pytest.fixture(scope="module")
def script_cluster():
    from cluster_script import cluster_up

    with cluster_up("copsehcl", "172.30.79", nodes=2) as pair:
        yield pair


def test_a_cluster_sandbox_reaches_neither_the_database_nor_the_object_store_nor_any_node(script_cluster):
    """`scripts/cluster` puts PostgreSQL, SeaweedFS and every node's and API
    front's API and peer listener on one host link; a sandbox's root must reach none of them
    (the database's password and the bucket's keys are in the node
    processes' environments, not the sandbox's)."""
    from cluster_script import reachable

    cluster = script_cluster
    sbx = Sandbox.create(timeout=120, **cluster.via(cluster.gateways[0]))
    try:
        # The probe itself works: a port the sandbox serves opens.
        sbx.commands.run("python3 -m http.server 8123 --bind 127.0.0.1", background=True)
        deadline = time.monotonic() + 10
        while not reachable(sbx, "127.0.0.1", 8123):
            assert time.monotonic() < deadline, "nothing opens from this sandbox: the probe proves nothing"
            time.sleep(0.2)
        host = f"{cluster.net}.1"
        services = {"PostgreSQL": (host, 5439), "S3": (host, 18333), "filer": (host, 18888),
                    "master": (host, 19333), "volume": (host, 18080)}
        for n in (1, 2):
            services[f"node {n} API"] = (cluster.node_address(n), 3000)
            services[f"node {n} peers"] = (cluster.node_address(n), 3443)
            services[f"API front {n}"] = (cluster.front_address(n), 3000)
            services[f"API front {n} peers"] = (cluster.front_address(n), 3443)
        opened = [name for name, (address, port) in services.items() if reachable(sbx, address, port)]
        assert opened == []
        environment = sbx.commands.run(
            "env; for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done 2>/dev/null; true"
        ).stdout
        assert cluster.env["E2B_API_KEY"] not in environment
        assert cluster.env["AWS_SECRET_ACCESS_KEY"] not in environment
        assert cluster.env["COPSE_DATABASE"].split(":")[2].split("@")[0] not in environment
    finally:
        sbx.kill()


def test_a_paused_sandboxs_files_swapped_in_the_bucket_never_resume_as_it(nodes, database_url, object_store):
    """The same swap for a paused sandbox that may move: another paused
    sandbox's manifests (its stream's and its top layer image's) under the
    victim's keys. The node that resumes the victim refuses the image on
    the hash its record keeps and a stream that names other files than its
    record, and resumes it once the bucket holds its own again."""
    one, two = nodes
    victim, other = made = [create_on(one, nodes, database_url, via=one) for _ in range(2)]
    try:
        for text, sbx in zip(("victim", "other"), made):
            sbx.files.write("/home/user/note", text)
            assert sbx.pause(mode="filesystem") is True
        for sbx in made:
            stored_paused(object_store, database_url, sbx.sandbox_id)
        keys = {sbx: f"paused/default/{sbx.sandbox_id}" for sbx in made}
        real = {}
        for suffix in ("", "@layer0"):
            real[suffix] = object_store.read(keys[victim] + suffix)
            object_store.overwrite(keys[victim] + suffix, object_store.read(keys[other] + suffix))
        drain(one, database_url)
        time.sleep(NODE_TABLE_TTL_S + 0.5)
        with pytest.raises(Exception, match="another version"):
            Sandbox.connect(victim.sandbox_id, timeout=60, **two.env())
        for suffix, data in real.items():
            object_store.overwrite(keys[victim] + suffix, data)
        back = Sandbox.connect(victim.sandbox_id, timeout=60, **two.env())
        assert two.holds(victim.sandbox_id)
        assert back.files.read("/home/user/note") == "victim"
    finally:
        drain(one, database_url, False)
        kill_quietly(made)


def test_a_lost_nodes_paused_sandbox_is_ended_elsewhere_only_by_its_team_and_only_if_stored(
        nodes, database_url, object_store):
    """While a node is lost, another gateway describes and kills a sandbox
    it paused into the object store (they need only the record and the
    bucket). Another team's key is told it does not exist, and a sandbox
    whose files are not in the bucket is never killed there: its record
    is all that would be left to remove, its files would stay on the
    lost node. The lost node, back, drops its leftover copy."""
    from e2b import NotFoundException, SandboxState

    one, two = nodes
    team = f"lost-{os.urandom(4).hex()}"
    made = subprocess.run([str(COPSE), "keys", "create", "--team", team, "--database", database_url],
                          check=True, capture_output=True, text=True)
    stranger = made.stdout.strip()
    stored, unstored = create_on(one, nodes, database_url, via=two), create_on(one, nodes, database_url, via=two)
    try:
        assert stored.pause(mode="filesystem") is True
        stored_paused(object_store, database_url, stored.sandbox_id)
        key = paused_field(database_url, stored.sandbox_id, "files_only")
        assert (one.data_dir / "snapshots" / f"{key}.json").exists()
        one.crash()
        time.sleep(LOST_AFTER_S + 1)
        assert node_table(database_url)[one.id] == "lost"
        for call in (Sandbox.get_info, Sandbox.kill):
            with pytest.raises(Exception, match="lost"):
                call(unstored.sandbox_id, **two.env())
        as_stranger = {**two.env(), "api_key": stranger}
        with pytest.raises(NotFoundException):
            Sandbox.get_info(stored.sandbox_id, **as_stranger)
        assert Sandbox.kill(stored.sandbox_id, **as_stranger) is False, "not found for another team"
        assert object_store.read(f"paused/default/{stored.sandbox_id}") is not None
        assert Sandbox.get_info(stored.sandbox_id, **two.env()).state == SandboxState.PAUSED
        assert Sandbox.kill(stored.sandbox_id, **two.env()) is True
        with pytest.raises(NotFoundException):
            Sandbox.get_info(stored.sandbox_id, **two.env())
        assert object_store.read(f"paused/default/{stored.sandbox_id}") is None, "its files left the bucket"
        one.up()
        assert not (one.data_dir / "snapshots" / f"{key}.json").exists(), "no record names them any more"
        time.sleep(HEARTBEAT_S + 0.5)
        assert Sandbox.get_info(unstored.sandbox_id, **two.env()).state == SandboxState.RUNNING, "adopted again"
    finally:
        if one.proc.poll() is not None:
            one.up()
        kill_quietly([stored, unstored])


def test_a_signed_link_sent_to_another_nodes_gateway_is_checked_as_on_its_own(nodes, database_url):
    """Another node's gateway looks a link's signer up among every node's
    sandboxes: a link whose path or user was changed after signing, or that
    expired, is refused there as on the sandbox's own node, and a flood of
    bogus links (each a miss that may re-read the tokens) is answered 401
    while the real link keeps working."""
    two = nodes[1]
    victim, elsewhere = on_one_seen_through_two(nodes, database_url, "/home/user/secret.txt",
                                                "only for the link's holder")
    try:
        real = elsewhere.download_url("/home/user/secret.txt")
        assert real.startswith(two.url)
        expired = elsewhere.download_url("/home/user/secret.txt", use_signature_expiration=1)
        time.sleep(2.1)

        def changed(link: str, **fields) -> str:
            url = urllib.parse.urlsplit(link)
            query = dict(urllib.parse.parse_qsl(url.query))
            query.update(fields)
            return urllib.parse.urlunsplit(url._replace(query=urllib.parse.urlencode(query)))

        forged = [changed(real, path="/etc/shadow"), changed(real, username="root"), expired]
        forged += [changed(real, signature=_bogus_signature(i)) for i in range(300)]
        with httpx.Client(timeout=30) as client:
            for link in forged:
                response = client.get(link)
                assert response.status_code == 401, (link, response.status_code, response.text)
                assert response.json()["code"] == 401
            assert client.get(real).text == "only for the link's holder"
    finally:
        victim.kill()


def test_metrics_of_another_teams_sandboxes_on_any_node_give_nothing_away(nodes, database_url):
    """A key of another team names sandboxes on both nodes in one
    `GET /sandboxes/metrics`, through either gateway, with and without a
    forged forwarding mark (hoping a node serves its share without the
    team check, or skips asking the other): it learns nothing of them."""
    one, two = nodes
    made = [create_on(one, nodes, database_url, via=two), create_on(two, nodes, database_url, via=one)]
    try:
        stranger = subprocess.run(
            [str(COPSE), "keys", "create", "--team", f"nosy-{secrets.token_hex(4)}", "--database", database_url],
            check=True, capture_output=True, text=True).stdout.strip()
        query = {"sandbox_ids": ",".join(sbx.sandbox_id for sbx in made)}
        for via, other in [(one, two), (two, one)]:
            for mark in ({}, {"x-copse-forwarded-by": other.id}):
                reply = httpx.get(f"{via.url}/sandboxes/metrics", params=query,
                                  headers={"x-api-key": stranger, **mark}, timeout=60)
                assert reply.status_code == 200 and reply.json()["sandboxes"] == {}, reply.text
                own = httpx.get(f"{via.url}/sandboxes/metrics", params=query,
                                headers={"x-api-key": API_KEY, **mark}, timeout=60)
                assert sorted(own.json()["sandboxes"]) == sorted(query["sandbox_ids"].split(",")), own.text
    finally:
        kill_quietly(made)


def test_a_volume_on_another_node_gives_nothing_to_a_wrong_token_and_never_splits_a_sandbox(nodes, database_url):
    """Through the gateway of the node that does not hold a volume, its
    content API with a wrong token (with or without a forged forwarding
    mark) is answered exactly as an unknown volume, without saying where it
    lives; and a create mounting volumes of two nodes is refused whole,
    never booting a sandbox that sees one of them empty."""
    one, two = nodes
    here = Volume.create(f"vol-{secrets.token_hex(4)}", api_key=API_KEY, api_url=one.url)
    there = Volume.create(f"vol-{secrets.token_hex(4)}", api_key=API_KEY, api_url=two.url)
    try:
        def read(volume_id: str, token: str, **mark) -> httpx.Response:
            return httpx.get(f"{two.url}/volumecontent/{volume_id}/file", params={"path": "/x"},
                             headers={"Authorization": f"Bearer {token}", **mark}, timeout=30)

        unknown = read("nosuchvolume00000000", "wrong")
        assert unknown.status_code == 404
        for mark in ({}, {"x-copse-forwarded-by": one.id}):
            answer = read(here.volume_id, "wrong-" + here.token[6:], **mark)
            assert answer.status_code == 404, answer.text
            assert answer.json()["message"] == unknown.json()["message"].replace("nosuchvolume00000000",
                                                                                 here.volume_id)
            assert one.id not in answer.text
        before = {s.sandbox_id for s in Sandbox.list(api_key=API_KEY, api_url=one.url).next_items()}
        with pytest.raises(SandboxException, match="different nodes"):
            Sandbox.create(timeout=60, volume_mounts={"/mnt/a": here, "/mnt/b": there}, **one.env())
        after = {s.sandbox_id for s in Sandbox.list(api_key=API_KEY, api_url=one.url).next_items()}
        assert after == before, "nothing was created"
    finally:
        for volume, via in ((here, one), (there, two)):
            Volume.destroy(volume.volume_id, api_key=API_KEY, api_url=via.url)


def test_a_build_on_another_node_takes_no_upload_without_its_token_and_no_call_from_another_team(nodes, database_url):
    """Through the gateway of the node that does not run a build, an upload
    with a wrong token is answered as one for an unknown template (nothing
    is passed on, nothing said of where the build runs), and another team's
    key can neither get an upload link nor start or delete the build."""
    one, two = nodes
    headers = {"X-API-KEY": API_KEY}
    requested = httpx.post(f"{one.url}/v3/templates", json={"name": f"guarded-{secrets.token_hex(4)}"},
                           headers=headers, timeout=30)
    assert requested.status_code == 202, requested.text
    template_id, build_id = requested.json()["templateID"], requested.json()["buildID"]
    try:
        digest = "ab" * 32
        unknown = httpx.put(f"{two.url}/copse/template-files/nosuchtemplate000000/{digest}?token=x", content=b"x",
                            timeout=30)
        forged = httpx.put(f"{two.url}/copse/template-files/{template_id}/{digest}?token=x", content=b"x",
                           headers={"x-copse-forwarded-by": one.id}, timeout=30)
        assert forged.status_code == unknown.status_code == 404, (forged.text, unknown.text)
        assert one.id not in forged.text
        stranger = {"X-API-KEY": subprocess.run(
            [str(COPSE), "keys", "create", "--team", f"nosy-{secrets.token_hex(4)}", "--database", database_url],
            check=True, capture_output=True, text=True).stdout.strip()}
        link = httpx.get(f"{two.url}/templates/{template_id}/files/{digest}", headers=stranger, timeout=30)
        started = httpx.post(f"{two.url}/v2/templates/{template_id}/builds/{build_id}",
                             json={"fromTemplate": "base", "steps": []}, headers=stranger, timeout=30)
        deleted = httpx.delete(f"{two.url}/templates/{template_id}", headers=stranger, timeout=30)
        for answer in (link, started, deleted):
            assert answer.status_code == 404, answer.text
        status = httpx.get(f"{one.url}/templates/{template_id}/builds/{build_id}/status", headers=headers,
                           timeout=30).json()
        assert status["status"] == "waiting", status
    finally:
        httpx.delete(f"{one.url}/templates/{template_id}", headers=headers, timeout=60)


def test_an_api_front_makes_nothing_of_its_own_whatever_a_call_claims(nodes, database_url, object_store):
    """An API front (`copse up --no-sandboxes`) holds nothing. A caller marks
    a create, a build request and a volume as already forwarded, hoping the
    front makes them itself (a record naming a host with no sandbox, build
    or volume behind it): on its public listener the mark is dropped and
    each goes to a node. Over its peer listener, where a node's marked call
    is believed, a create, a build request and a volume are refused with a
    503 that says the front runs none, and no record names the front."""
    from test_cluster import api_front

    one, two = nodes
    api = {"X-API-KEY": API_KEY}
    with api_front(nodes, database_url, object_store) as front:
        forged = {**api, "x-copse-forwarded-by": one.id}
        made = httpx.post(f"{front.url}/sandboxes", json={"templateID": "base", "timeout": 60}, headers=forged,
                          timeout=120)
        assert made.status_code == 201, made.text
        sandbox_id = made.json()["sandboxID"]
        try:
            assert one.holds(sandbox_id) or two.holds(sandbox_id)
        finally:
            httpx.delete(f"{front.url}/sandboxes/{sandbox_id}", headers=api, timeout=60)
        name = f"marked-{secrets.token_hex(4)}"
        requested = httpx.post(f"{front.url}/v3/templates", json={"name": name}, headers=forged, timeout=30)
        assert requested.status_code == 202, requested.text
        template_id = requested.json()["templateID"]
        try:
            query = f"SELECT record::jsonb ->> 'node' FROM built_templates WHERE id = '{template_id}'"
            node = subprocess.run(["psql", database_url, "-tAc", query], check=True, capture_output=True,
                                  text=True).stdout.strip()
            assert node in (one.id, two.id), node
        finally:
            httpx.delete(f"{front.url}/templates/{template_id}", headers=api, timeout=60)
        volume = httpx.post(f"{front.url}/volumes", json={"name": name}, headers=forged, timeout=30)
        assert volume.status_code == 201, volume.text
        httpx.delete(f"{front.url}/volumes/{volume.json()['volumeID']}", headers=api, timeout=60)

        with peer_client(front, one.tls) as peer:
            calls = [("/sandboxes", {"templateID": "base", "timeout": 60}), ("/v3/templates", {"name": f"{name}-2"}),
                     ("/volumes", {"name": f"{name}-2"})]
            for path, body in calls:
                refused = peer.post(path, json=body, headers=forged)
                assert refused.status_code == 503, (path, refused.text)
                assert "runs no sandboxes" in refused.json()["message"], (path, refused.text)
        for table in ("sandboxes", "built_templates", "team_volumes"):
            query = f"SELECT count(*) FROM {table} WHERE record::jsonb ->> 'node' = '{front.id}'"
            count = subprocess.run(["psql", database_url, "-tAc", query], check=True, capture_output=True,
                                   text=True).stdout.strip()
            assert count == "0", f"{table} names the front"
