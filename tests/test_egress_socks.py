"""E2B's `network.egress_proxy` through the official SDK: a sandbox's
outbound TCP is tunnelled through a SOCKS5 server (RFC 1929 username and
password) by the host's egress proxy, after the sandbox's own filtering.

Two network namespaces this module creates, each a veth routed from the
host (two /28s of TEST-NET-2): the SOCKS5 server (Debian's `danted`,
authenticating a system user this module adds and removes) and the
destination, an HTTP server on a non-web port that answers with the
address it sees the connection come from and keeps a list of them.
"""

import ipaddress
import os
import secrets
import signal
import subprocess
import tempfile
import time
import urllib.request

import pytest
from e2b import Sandbox

from conftest import DATA_DIR
from test_egress_proxy import _reachable, sh

SOCKS = "198.51.100.10"  # in 198.51.100.0/28, the host at .1
DEST = "198.51.100.130"  # in 198.51.100.128/28, the host at .129
DEST_PORT = 8080
HOST_SIDE = "198.51.100.129"  # what the destination sees of a direct, masqueraded connection

DEST_SERVER = """
import http.server, socketserver, sys
seen = []
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/seen":
            body = ",".join(seen).encode()
        else:
            seen.append(self.client_address[0])
            body = self.client_address[0].encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
socketserver.ThreadingTCPServer.allow_reuse_address = True
socketserver.ThreadingTCPServer(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
"""

DANTED_CONF = f"""
logoutput: stderr
internal: {SOCKS} port = 1080
external: {SOCKS}
clientmethod: none
socksmethod: username
user.privileged: root
user.unprivileged: nobody
client pass {{
    from: 0.0.0.0/0 to: 0.0.0.0/0
}}
socks pass {{
    from: 0.0.0.0/0 to: 0.0.0.0/0
    command: connect
}}
"""


def _wait(addr, port):
    deadline = time.monotonic() + 10
    while not _reachable(addr, port):
        assert time.monotonic() < deadline, f"{addr}:{port} did not come up"
        time.sleep(0.05)


class Peer:
    """A network namespace at `addr`/28, routed from the host, which is the
    first address of that /28."""

    def __init__(self, tag: str, addr: str):
        self.ns = f"cn-{tag}-{os.getpid()}"
        self.veth = f"cn{tag[:2]}{os.getpid() % 100000}"
        net = ipaddress.ip_network(f"{addr}/28", strict=False)
        host = str(net.network_address + 1)
        sh("ip", "netns", "add", self.ns)
        sh("ip", "link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "netns", self.ns)
        sh("ip", "addr", "add", f"{host}/28", "dev", self.veth)
        sh("ip", "link", "set", self.veth, "up")
        sh("ip", "-n", self.ns, "addr", "add", f"{addr}/28", "dev", "eth0")
        for link in ("eth0", "lo"):
            sh("ip", "-n", self.ns, "link", "set", link, "up")
        sh("ip", "-n", self.ns, "route", "add", "default", "via", host)

    def spawn(self, *argv) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.ns, *argv], start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def delete(self):
        sh("ip", "netns", "del", self.ns, check=False)
        sh("ip", "link", "del", self.veth, check=False)


def _stop(proc):
    if proc and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def socks_world(gateway):
    """The SOCKS5 server and the destination; yields (username, password)."""
    user, password = f"cpsocks{os.getpid() % 100000}", "pw-" + secrets.token_hex(12)
    sh("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", user)
    procs, peers = [], []
    conf = tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False)
    try:
        subprocess.run(["chpasswd"], input=f"{user}:{password}\n", text=True, check=True)
        conf.write(DANTED_CONF)
        conf.close()
        peers.append(Peer("sk", SOCKS))
        peers.append(Peer("dt", DEST))
        procs.append(peers[1].spawn("python3", "-c", DEST_SERVER, str(DEST_PORT)))
        procs.append(peers[0].spawn("danted", "-f", conf.name, "-p", f"{conf.name}.pid"))
        _wait(DEST, DEST_PORT)
        _wait(SOCKS, 1080)
        yield user, password
    finally:
        for proc in procs:
            _stop(proc)
        for peer in peers:
            peer.delete()
        sh("userdel", user, check=False)
        for path in (conf.name, f"{conf.name}.pid"):
            if os.path.exists(path):
                os.unlink(path)


def seen() -> list:
    """Where the destination's connections came from, so far."""
    body = urllib.request.urlopen(f"http://{DEST}:{DEST_PORT}/seen", timeout=5).read().decode()
    return [a for a in body.split(",") if a]


def fetch(sbx) -> str:
    """What the destination says the sandbox's connection came from ("" if
    the connection failed)."""
    result = sbx.commands.run(f"curl -s --connect-timeout 5 -m 10 http://{DEST}:{DEST_PORT}/ || true")
    return result.stdout.strip()


def refused(network):
    """Asserts that creating a sandbox with `network` is a 400."""
    with pytest.raises(Exception) as raised:
        Sandbox.create(template="base", network=network).kill()
    assert getattr(raised.value, "status_code", None) == 400 or "400" in str(raised.value), raised.value


def proxy(user, password, address=f"{SOCKS}:1080"):
    return {"address": address, "username": user, "password": password}


def test_tcp_goes_through_the_socks_server_and_info_hides_the_password(socks_world):
    user, password = socks_world
    direct = Sandbox.create(template="base")
    sbx = Sandbox.create(template="base", network={"egress_proxy": proxy(user, password)})
    try:
        # The control: without a proxy the destination sees the host's NAT.
        assert fetch(direct) == HOST_SIDE
        assert fetch(sbx) == SOCKS
        info = sbx.get_info()
        assert info.network["egress_proxy"] == {"address": f"{SOCKS}:1080", "username": user}
        raw = urllib.request.urlopen(urllib.request.Request(
            f"{os.environ['E2B_API_URL']}/sandboxes/{sbx.sandbox_id}",
            headers={"X-API-Key": os.environ["E2B_API_KEY"]})).read().decode()
        assert password not in raw and user in raw
        listed = urllib.request.urlopen(urllib.request.Request(
            f"{os.environ['E2B_API_URL']}/v2/sandboxes", headers={"X-API-Key": os.environ["E2B_API_KEY"]}
        )).read().decode()
        assert password not in listed
    finally:
        sbx.kill()
        direct.kill()
    log = (DATA_DIR / "gateway.log").read_bytes()
    assert password.encode() not in log


def test_a_wrong_password_fails_closed(socks_world):
    user, _ = socks_world
    before = len(seen())
    sbx = Sandbox.create(template="base", network={"egress_proxy": proxy(user, "wrong-password")})
    try:
        assert fetch(sbx) == ""
        assert len(seen()) == before, "nothing may go direct"
    finally:
        sbx.kill()


def test_filtering_runs_before_the_tunnel(socks_world):
    user, password = socks_world
    before = len(seen())
    sbx = Sandbox.create(template="base", network={"egress_proxy": proxy(user, password), "deny_out": [DEST]})
    try:
        assert fetch(sbx) == ""
        assert len(seen()) == before
        # update_network replaces the whole configuration: without
        # egress_proxy the sandbox goes out directly again.
        sbx.update_network({"egress_proxy": proxy(user, password)})
        assert fetch(sbx) == SOCKS
        sbx.update_network({})
        assert fetch(sbx) == HOST_SIDE
        assert "egress_proxy" not in (sbx.get_info().network or {})
    finally:
        sbx.kill()


@pytest.mark.parametrize("address,why", [
    ("proxy", "no port"),
    ("proxy:0", "port 0"),
    ("[::1]:1080", "IPv6"),
    ("pro xy:1080", "not a host name"),
])
def test_bad_addresses_are_refused(gateway, address, why):
    refused({"egress_proxy": {"address": address}})


def test_credentials_are_checked(gateway):
    for opts in ({"address": "p.test:1080", "password": "x"}, {"address": "p.test:1080", "username": "u"},
                 {"address": "p.test:1080", "username": "u" * 256, "password": "x"},
                 {"address": "p.test:1080", "username": "u", "password": "a\nb"},
                 {"address": "p.test:1080", "tls": True}):
        refused({"egress_proxy": opts})

