"""The host's egress proxy, through the official SDK: `allow_out`/`deny_out`
host names (and wildcards) are matched by name on ports 80 and 443 (HTTP
`Host`, TLS SNI), whatever address a name resolves to.

The "web" is a network namespace this module creates: a veth routed from
the host to 203.0.113.0/24, with an HTTP server on port 80 and an HTTPS
server on port 443, on two addresses. The HTTPS server's certificate is
signed by a test CA (`WEB_CA`, which the module's gateway trusts for the
upstreams of intercepted HTTPS, `--egress-upstream-ca`) for every test
name but badcert.test; sandboxes do not trust that CA and pass -k. A second gateway of this module's own pins
the test names to those addresses (`--egress-hosts-file`), which is the
host's view of the names; the sandbox names its destination itself
(`curl --resolve`), so a name can be sent to any address.
"""

import contextlib
import ipaddress
import os
import subprocess
import tempfile
import time

import pytest
from e2b import Sandbox

from conftest import BRIDGE, SUBNET, netns_host_names, remove_netns_host

WEB = "203.0.113.10"  # allowed.test, denied.test, api.wild.test, badcert.test
OTHER = "203.0.113.20"  # other.test
HOSTS = f"{WEB} allowed.test denied.test api.wild.test badcert.test\n{OTHER} other.test\n"

# The test CA of the web's HTTPS certificate, and its name (its issuer, as
# a client in a sandbox sees it when the proxy does not intercept).
WEB_CA = f"{tempfile.gettempdir()}/cn-web-{os.getpid()}.ca.pem"
WEB_CA_NAME = "copse-test-web-ca"

# Every request the servers get is one JSON line in REQUESTS (see
# `requests_to`): what a sandbox sent is checked where it arrived, and on
# which connection (the client's port).
REQUESTS = f"{tempfile.gettempdir()}/cn-web-{os.getpid()}.requests.jsonl"

SERVER = """
import http.server, json, socketserver, ssl, sys, threading
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keeps connections alive, as real servers do
    def do_GET(self):
        # Names in one case: a proxy may send them in lower case (HTTP/2's).
        seen = {"path": self.path, "to": self.connection.getsockname()[0], "port": self.client_address[1],
                "headers": {name.title(): value for name, value in self.headers.items()}}
        with open(sys.argv[3], "a") as log:
            log.write(json.dumps(seen) + "\\n")
        body = b"web"
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
socketserver.ThreadingTCPServer.allow_reuse_address = True
plain = socketserver.ThreadingTCPServer(("0.0.0.0", 80), H)
tls = socketserver.ThreadingTCPServer(("0.0.0.0", 443), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(sys.argv[1], sys.argv[2])
tls.socket = ctx.wrap_socket(tls.socket, server_side=True)
threading.Thread(target=plain.serve_forever, daemon=True).start()
tls.serve_forever()
"""


def sh(*args, check=True):
    return subprocess.run(args, check=check, capture_output=True, text=True)


def _reachable(addr, port):
    import socket

    try:
        socket.create_connection((addr, port), timeout=0.5).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def web():
    ns, veth = netns_host_names("web")
    certs = tempfile.TemporaryDirectory()
    cert, key, ca_key = f"{certs.name}/cert.pem", f"{certs.name}/key.pem", f"{certs.name}/ca.key"
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1")
    sh("openssl", "req", "-x509", *ec, "-subj", f"/CN={WEB_CA_NAME}", "-keyout", ca_key, "-out", WEB_CA)
    names = ",".join(f"DNS:{n}" for n in ("allowed.test", "denied.test", "api.wild.test", "other.test"))
    sh("openssl", "req", "-x509", *ec, "-subj", "/CN=web.test", "-CA", WEB_CA, "-CAkey", ca_key,
       "-addext", f"subjectAltName={names}", "-addext", "basicConstraints=critical,CA:FALSE",
       "-keyout", key, "-out", cert)
    sh("ip", "netns", "add", ns)
    server = None
    try:
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "addr", "add", "203.0.113.1/24", "dev", veth)
        sh("ip", "link", "set", veth, "up")
        for addr in (WEB, OTHER):
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "route", "add", "default", "via", "203.0.113.1")
        server = subprocess.Popen(["ip", "netns", "exec", ns, "python3", "-c", SERVER, cert, key, REQUESTS])
        deadline = time.monotonic() + 10
        while not (_reachable(WEB, 80) and _reachable(WEB, 443)) and time.monotonic() < deadline:
            time.sleep(0.05)
        yield ns
    finally:
        if server:
            server.kill()
            server.wait()
        remove_netns_host(ns, veth)
        certs.cleanup()
        for made in (REQUESTS, WEB_CA):
            if os.path.exists(made):
                os.remove(made)


def requests_to(path: str) -> list:
    """The requests the web's servers received for `path`, oldest first."""
    import json

    if not os.path.exists(REQUESTS):
        return []
    with open(REQUESTS) as log:
        return [seen for seen in map(json.loads, log) if seen["path"] == path]


@contextlib.contextmanager
def hosts_gateway(name: str, bridge_letter: str, subnet_offset: int, names: str = HOSTS, extra_args=()):
    """A second gateway with `names` (hosts(5) lines) in its static table, on a
    bridge and subnet of its own; yields the SDK's connection arguments and
    its bridge."""
    from conftest import Gateway, second_data_dir

    data_dir = second_data_dir(name)
    hosts = data_dir / "egress-hosts"
    hosts.write_text(names)
    other = Gateway(data_dir)
    second = ipaddress.ip_network(SUBNET).network_address.packed[1]
    bridge = f"{BRIDGE[:9]}{bridge_letter}"
    other.start(extra_args=["--bridge", bridge, "--subnet", f"10.{(second + subnet_offset) % 256}.0.0/16",
                            "--egress-hosts-file", str(hosts), *extra_args])
    try:
        yield dict(api_key=os.environ["E2B_API_KEY"], api_url=other.url, sandbox_url=other.url), bridge
    finally:
        other.stop()
        subprocess.run(["nft", "delete", "table", "inet", f"copse_{bridge}"], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


@pytest.fixture(scope="module")
def egress_gateway(gateway, web):
    """A gateway whose host resolves the test names and trusts the web's
    test CA for intercepted HTTPS; yields the SDK's connection arguments and
    its bridge."""
    with hosts_gateway("egress", "e", 101, extra_args=("--egress-upstream-ca", WEB_CA)) as made:
        yield made


def fetch(sbx, url: str, resolve: str = "", header: str = "") -> str:
    """The HTTP status a curl in the sandbox gets ("000": no response)."""
    opts = f"--resolve {resolve} " if resolve else ""
    opts += f"-H '{header}' " if header else ""
    result = sbx.commands.run(
        f"curl -sk -o /dev/null -w '%{{http_code}}' --connect-timeout 3 -m 5 {opts}{url} || true"
    )
    return result.stdout.strip()


def create(env, **network):
    return Sandbox.create(template="base", network=network, **env)


def test_an_allowed_name_passes_by_host_and_sni_where_its_address_is_denied(egress_gateway):
    env, _ = egress_gateway
    sbx = create(env, allow_out=["allowed.test"], deny_out=["0.0.0.0/0"])
    try:
        for scheme, port in (("http", 80), ("https", 443)):
            assert fetch(sbx, f"{scheme}://allowed.test/", f"allowed.test:{port}:{WEB}") == "200", scheme
            # The same address under a name no entry matches: names, not
            # addresses, decide on the web ports.
            assert fetch(sbx, f"{scheme}://other.test/", f"other.test:{port}:{WEB}") == "000", scheme
            assert fetch(sbx, f"{scheme}://{OTHER}/") == "000", scheme
    finally:
        sbx.kill()


def test_a_denied_name_is_refused_though_its_address_is_allowed(egress_gateway):
    env, _ = egress_gateway
    sbx = create(env, allow_out=[WEB], deny_out=["denied.test"])
    try:
        for scheme, port in (("http", 80), ("https", 443)):
            assert fetch(sbx, f"{scheme}://denied.test/", f"denied.test:{port}:{WEB}") == "000", scheme
            assert fetch(sbx, f"{scheme}://allowed.test/", f"allowed.test:{port}:{WEB}") == "200", scheme
            assert fetch(sbx, f"{scheme}://{WEB}/") == "200", scheme
        # Open egress otherwise: a deny name narrows nothing else.
        assert fetch(sbx, f"http://{OTHER}/") == "200"
        assert fetch(sbx, "http://other.test/", f"other.test:80:{OTHER}") == "200"
    finally:
        sbx.kill()


def test_a_wildcard_matches_names_below_it_not_the_apex(egress_gateway):
    env, _ = egress_gateway
    sbx = create(env, allow_out=["*.wild.test"], deny_out=["0.0.0.0/0"])
    try:
        assert fetch(sbx, "https://api.wild.test/", f"api.wild.test:443:{WEB}") == "200"
        assert fetch(sbx, "https://wild.test/", f"wild.test:443:{WEB}") == "000"
    finally:
        sbx.kill()


def test_update_network_moves_a_sandbox_onto_and_off_the_proxy(egress_gateway):
    env, _ = egress_gateway
    sbx = create(env)
    try:
        assert fetch(sbx, "http://denied.test/", f"denied.test:80:{WEB}") == "200"
        sbx.update_network({"deny_out": ["denied.test"]})
        assert fetch(sbx, "http://denied.test/", f"denied.test:80:{WEB}") == "000"
        sbx.update_network({})
        assert fetch(sbx, "http://denied.test/", f"denied.test:80:{WEB}") == "200"
    finally:
        sbx.kill()
