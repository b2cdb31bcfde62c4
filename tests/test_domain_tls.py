"""Domain mode: `copse up --domain D --tls-cert --tls-key` on port 443 of a
loopback address, and the unchanged SDK configured only with `E2B_DOMAIN`
and `SSL_CERT_FILE` — no `E2B_API_URL` or `E2B_SANDBOX_URL` — so it reaches
`https://api.D` for the control plane and `https://49983-<id>.D` for envd,
exactly as it reaches E2B. Names resolve through /etc/hosts lines the test
writes and always removes.

The SDK runs in child processes: its HTTP client reads the trust store and
/etc/hosts when it is built, and a sandbox's envd host is known only after
create, so create and use happen in two processes, with the hosts line
written in between (wildcard DNS would need neither). Its resolver asks for
IPv6 addresses too, so each name also gets an IPv4-mapped IPv6 line (which
reaches the same IPv4 listener), and the children see a resolv.conf naming
only loopback: no lookup leaves the machine even if one slips past the
hosts file."""

import ipaddress
import json
import os
import pathlib
import random
import secrets
import socket
import ssl
import subprocess
import sys
import time

import pytest
from websockets.sync.client import connect as websocket_connect

from conftest import API_KEY, BRIDGE, COPSE, DATA_DIR, SUBNET, Gateway, share_templates

HOSTS = pathlib.Path("/etc/hosts")

# The code interpreter's sandbox: envd (49983) and the interpreter (49999)
# are both reached by host name.
CREATE = """
import json
from e2b_code_interpreter import Sandbox
sbx = Sandbox.create(timeout=120)
print(json.dumps({"id": sbx.sandbox_id, "hosts": [sbx.get_host(49983), sbx.get_host(49999)]}))
"""

# Leaves the sandbox running with sandbox_server.py on port 8000, for the
# WebSocket check; the gateway kills it when it stops.
USE = """
import json, sys
from e2b_code_interpreter import Sandbox
sbx = Sandbox.connect(sys.argv[1])
sbx.files.write("/tmp/server.py", sys.stdin.read())
sbx.commands.run("python3 /tmp/server.py 8000", background=True)
run = sbx.commands.run("echo over $((40 + 2)) tls")
sbx.files.write("/home/user/domain.txt", "read back over TLS")
code = sbx.run_code("print('streamed'); 6 * 7")
print(json.dumps({"stdout": run.stdout, "file": sbx.files.read("/home/user/domain.txt"),
                  "code": [code.logs.stdout, code.text]}))
"""


class HostsFile:
    """Adds lines tagged with this run's domain to /etc/hosts (in place: it
    may be a bind mount) and removes exactly those lines afterwards."""

    def __init__(self, address: str, domain: str):
        self.address, self.domain = address, domain

    def add(self, *names: str):
        text = HOSTS.read_text()
        if not text.endswith("\n"):
            text += "\n"
        for address in (self.address, f"::ffff:{self.address}"):
            text += f"{address} {' '.join(names)}  # copse test {self.domain}\n"
        HOSTS.write_text(text)

    def clean(self):
        lines = HOSTS.read_text().splitlines(keepends=True)
        HOSTS.write_text("".join(line for line in lines if f"# copse test {self.domain}" not in line))


@pytest.fixture(scope="module")
def domain_mode(gateway, tmp_path_factory):
    """A second gateway in domain mode, with its own data dir (sharing the
    session's built templates through hard links)."""
    domain = f"copse-{secrets.token_hex(3)}.test"
    # A random loopback address, so port 443 never clashes with another run.
    address = f"127.{random.randint(1, 254)}.{random.randint(0, 255)}.{random.randint(1, 254)}"
    tls_dir = tmp_path_factory.mktemp("tls") / domain
    resolv_conf = tls_dir.parent / "resolv.conf"
    resolv_conf.write_text("nameserver 127.0.0.1\n")
    subprocess.run([str(COPSE), "tls", "init", "--domain", domain, "--out", str(tls_dir)], check=True,
                   stdout=subprocess.DEVNULL)
    data_dir = DATA_DIR / "domain-mode"
    data_dir.mkdir(exist_ok=True)
    share_templates(data_dir)
    gw = Gateway(data_dir, host=address, port=443)
    hosts = HostsFile(address, domain)
    # A network of its own: a bridge belongs to one gateway at a time.
    bridge = f"{BRIDGE[:9]}t"
    subnet = f"10.{(ipaddress.ip_network(SUBNET).network_address.packed[1] + 140) % 256}.0.0/16"
    try:
        hosts.add(f"api.{domain}")
        gw.start(extra_args=["--domain", domain, "--tls-cert", str(tls_dir / "cert.pem"),
                             "--tls-key", str(tls_dir / "key.pem"), "--bridge", bridge, "--subnet", subnet])
        yield {"domain": domain, "address": address, "ca": tls_dir / "ca.pem", "hosts": hosts,
               "resolv_conf": resolv_conf}
    finally:
        gw.stop()
        hosts.clean()
        subprocess.run(["nft", "delete", "table", "inet", f"copse_{bridge}"], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def sdk(domain_mode, script: str, *args: str, stdin: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("E2B_API_URL", "E2B_SANDBOX_URL")}
    env.update(E2B_DOMAIN=domain_mode["domain"], SSL_CERT_FILE=str(domain_mode["ca"]), E2B_API_KEY=API_KEY)
    # A private mount namespace, so the loopback-only resolv.conf is this
    # child's alone.
    isolated = ["unshare", "--mount", "sh", "-c", 'mount --bind "$0" /etc/resolv.conf && exec "$@"',
                str(domain_mode["resolv_conf"])]
    command = [*isolated, sys.executable, "-c", script, *args]
    done = subprocess.run(command, env=env, input=stdin, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def https_status(domain_mode, host: str, path: str) -> int:
    """The status of one HTTP/1.1 GET over TLS to the gateway, by address."""
    context = ssl.create_default_context(cafile=str(domain_mode["ca"]))
    with socket.create_connection((domain_mode["address"], 443), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname=host) as tls:
            tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            return int(tls.makefile("rb").readline().split()[1])


def test_certificate_covers_the_domain_and_only_it(domain_mode):
    context = ssl.create_default_context(cafile=str(domain_mode["ca"]))
    for name in (f"api.{domain_mode['domain']}", f"49983-abc.{domain_mode['domain']}"):
        with socket.create_connection((domain_mode["address"], 443), timeout=10) as raw:
            with context.wrap_socket(raw, server_hostname=name) as tls:
                assert tls.version() in ("TLSv1.2", "TLSv1.3")
    with socket.create_connection((domain_mode["address"], 443), timeout=10) as raw:
        with pytest.raises(ssl.SSLCertVerificationError):
            context.wrap_socket(raw, server_hostname="api.elsewhere.test")


def test_unchanged_sdk_works_with_only_a_domain(domain_mode):
    domain = domain_mode["domain"]
    created = sdk(domain_mode, CREATE)
    sandbox_id = created["id"]
    assert created["hosts"] == [f"49983-{sandbox_id}.{domain}", f"49999-{sandbox_id}.{domain}"]
    domain_mode["hosts"].add(*created["hosts"])
    server = (pathlib.Path(__file__).parent / "sandbox_server.py").read_text()
    used = sdk(domain_mode, USE, sandbox_id, stdin=server)
    assert used == {"stdout": "over 42 tls\n", "file": "read back over TLS", "code": [["streamed\n"], "42"]}

    # A browser-style wss:// connection to a port of the sandbox, once the
    # server answers plain HTTPS (as test_exposure waits for it): the first
    # CI failure of this test was a WebSocket handshake sent while the server
    # was starting that got no answer for 10 s, not reproduced since (see
    # test_exposure's upgrade-during-start-up test).
    app_host = f"8000-{sandbox_id}.{domain}"
    deadline = time.monotonic() + 20
    while (status := https_status(domain_mode, app_host, "/hello")) != 200:
        assert status == 502 and time.monotonic() < deadline, status  # until the server binds its port
        time.sleep(0.05)
    context = ssl.create_default_context(cafile=str(domain_mode["ca"]))
    sock = socket.create_connection((domain_mode["address"], 443), timeout=10)
    ws = websocket_connect(f"wss://{app_host}/ws", sock=sock, ssl=context, server_hostname=app_host, open_timeout=10)
    with ws:
        ws.send("over wss")
        assert ws.recv(timeout=10) == "over wss"
