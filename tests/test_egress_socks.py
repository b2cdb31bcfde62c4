"""E2B's `network.egress_proxy` through the official SDK: a sandbox's
outbound TCP is tunnelled through a SOCKS5 server (RFC 1929 username and
password) by the host's egress proxy, after the sandbox's own filtering.

Two network namespaces this module creates, each a veth routed from the
host (two /28s of TEST-NET-2): the SOCKS5 server (Debian's `danted`,
authenticating a system user this module adds and removes) and the
destination, an HTTP server on a non-web port that answers with the
address it sees the connection come from and keeps a list of them.
For `egress_proxy.tls`, a third: a TLS terminator in front of danted
(Python's ssl), with a certificate from a test CA made with `openssl`.
"""

import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request

import pytest
from e2b import Sandbox

from conftest import DATA_DIR, netns_host_names, remove_netns_host
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

# danted's log: every client it accepts is a line there.
DANTED_LOG = f"/tmp/copse-danted-{os.getpid()}.log"

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
    log: connect
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
        self.ns, self.veth = netns_host_names(tag)
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

    def spawn(self, *argv, log=None) -> subprocess.Popen:
        out = open(log, "ab") if log else subprocess.DEVNULL
        try:
            return subprocess.Popen(["ip", "netns", "exec", self.ns, *argv], start_new_session=True,
                                    stdout=subprocess.DEVNULL, stderr=out)
        finally:
            if log:
                out.close()

    def delete(self):
        remove_netns_host(self.ns, self.veth)


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
        procs.append(peers[0].spawn("danted", "-f", conf.name, "-p", f"{conf.name}.pid", log=DANTED_LOG))
        _wait(DEST, DEST_PORT)
        _wait(SOCKS, 1080)
        yield user, password
    finally:
        for proc in procs:
            _stop(proc)
        for peer in peers:
            peer.delete()
        sh("userdel", user, check=False)
        for path in (conf.name, f"{conf.name}.pid", DANTED_LOG):
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
                 {"address": "p.test:1080", "username": "u", "password": "a\nb"}):
        refused({"egress_proxy": opts})



# TLS to the upstream (`egress_proxy.tls`): a terminator in a netns of its
# own in front of danted, so danted's log tells a tunnel that came through
# TLS (from FRONT) from anything else.
FRONT = "198.51.100.74"  # in 198.51.100.64/28, the host at .65
FRONT_PORT = 1443

# Logs "hello <SNI>" for each ClientHello and "tunnel" for each session
# that completed its handshake and was passed on to danted.
TLS_FRONT = """
import asyncio, ssl, sys
cert, key, log, listen, socks = sys.argv[1:]
def note(line):
    with open(log, "a") as f: f.write(line + "\\n")
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.minimum_version = ssl.TLSVersion.TLSv1_2
ctx.load_cert_chain(cert, key)
ctx.sni_callback = lambda sock, name, c: note(f"hello {name}")
async def pipe(r, w):
    try:
        while data := await r.read(65536):
            w.write(data); await w.drain()
        if w.can_write_eof(): w.write_eof()
    except Exception: pass
async def handle(r, w):
    note("tunnel")
    ur, uw = await asyncio.open_connection(socks, 1080)
    await asyncio.gather(pipe(r, uw), pipe(ur, w))
    w.close(); uw.close()
async def main():
    server = await asyncio.start_server(handle, listen, 1443, ssl=ctx)
    await server.serve_forever()
asyncio.run(main())
"""


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(directory, name):
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
             "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=directory)
    return open(os.path.join(directory, f"{name}.pem")).read()


@pytest.fixture(scope="module")
def tls_front(socks_world):
    """The terminator; yields (trusted CA PEM, another CA's PEM, its log)."""
    directory = tempfile.mkdtemp(prefix="copse-tls-front-")
    log = os.path.join(directory, "front.log")
    peer, proc = None, None
    try:
        ca = _ca(directory, "ca")
        other = _ca(directory, "other-ca")
        with open(os.path.join(directory, "ext"), "w") as f:
            f.write(f"subjectAltName=DNS:socks.test,IP:{FRONT}\nbasicConstraints=CA:FALSE\n"
                    "extendedKeyUsage=serverAuth\n")
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", "/CN=socks.test",
                 "-keyout", "front.key", "-out", "front.csr", cwd=directory)
        _openssl("x509", "-req", "-in", "front.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-extfile", "ext", "-out", "front.pem", cwd=directory)
        peer = Peer("tf", FRONT)
        proc = peer.spawn("python3", "-c", TLS_FRONT, os.path.join(directory, "front.pem"),
                          os.path.join(directory, "front.key"), log, FRONT, SOCKS)
        _wait(FRONT, FRONT_PORT)
        yield ca, other, log
    finally:
        _stop(proc)
        if peer:
            peer.delete()
        shutil.rmtree(directory, ignore_errors=True)


def danted_accepts() -> int:
    with open(DANTED_LOG, errors="replace") as f:
        lines = f.read().splitlines()
    return sum("accept" in line for line in lines)


def front_log(log) -> list:
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return f.read().split("\n")[:-1]


def tls_proxy(user, password, **tls):
    return {**proxy(user, password, address=f"{FRONT}:{FRONT_PORT}"), "tls": tls or True}


def test_tls_to_the_upstream_carries_the_tunnel_and_info_hides_the_ca(socks_world, tls_front):
    user, password = socks_world
    ca, _, log = tls_front
    accepts, tunnels = danted_accepts(), front_log(log).count("tunnel")
    # The certificate names the address the proxy is dialled at (an IP)...
    by_address = Sandbox.create(template="base", network={"egress_proxy": tls_proxy(user, password, ca_cert=ca)})
    # ...and the name it is asked to verify instead.
    by_name = Sandbox.create(template="base", network={
        "egress_proxy": tls_proxy(user, password, ca_cert=ca, server_name="socks.test")})
    try:
        assert fetch(by_address) == SOCKS
        assert fetch(by_name) == SOCKS
        assert front_log(log).count("tunnel") == tunnels + 2
        assert "hello socks.test" in front_log(log), "serverName is sent as SNI"
        assert danted_accepts() > accepts, "the control: danted logs what it accepts"
        info = by_name.get_info().network["egress_proxy"]
        assert info == {"address": f"{FRONT}:{FRONT_PORT}", "username": user, "tls": {"server_name": "socks.test"}}
        assert by_address.get_info().network["egress_proxy"]["tls"] == {}
        raw = urllib.request.urlopen(urllib.request.Request(
            f"{os.environ['E2B_API_URL']}/sandboxes/{by_name.sandbox_id}",
            headers={"X-API-Key": os.environ["E2B_API_KEY"]})).read().decode()
        assert "BEGIN CERTIFICATE" not in raw and ca.splitlines()[1] not in raw and password not in raw
    finally:
        by_address.kill()
        by_name.kill()


@pytest.mark.parametrize("why", ["wrong server name", "untrusted CA", "system trust store"])
def test_tls_to_an_upstream_that_fails_verification_sends_nothing(socks_world, tls_front, why):
    user, password = socks_world
    ca, other, log = tls_front
    tls = {"wrong server name": {"ca_cert": ca, "server_name": "other.test"},
           "untrusted CA": {"ca_cert": other},
           "system trust store": {}}[why]
    before, accepts, hellos = len(seen()), danted_accepts(), len(front_log(log))
    sbx = Sandbox.create(template="base", network={"egress_proxy": tls_proxy(user, password, **tls)})
    try:
        assert fetch(sbx) == ""
        said = front_log(log)[hellos:]
        assert said and all(line.startswith("hello") for line in said), f"a TLS attempt and no tunnel: {said}"
        assert danted_accepts() == accepts, "nothing reached the SOCKS server"
        assert len(seen()) == before, "nothing went direct"
    finally:
        sbx.kill()


@pytest.mark.parametrize("tls", [
    {"server_name": "not a name"},
    {"server_name": "-x.test"},
    {"server_name": "a" * 254},
    {"ca_cert": "not a certificate"},
    {"ca_cert": "-----BEGIN CERTIFICATE-----\nAAAAAAAA\n-----END CERTIFICATE-----\n"},
])
def test_bad_tls_settings_are_refused(gateway, tls):
    refused({"egress_proxy": {"address": f"{FRONT}:{FRONT_PORT}", "tls": tls}})
