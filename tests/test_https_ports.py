"""`network.https_ports`: a server in the sandbox that speaks TLS itself,
with a self-signed certificate, is reached through the gateway by plain
clients of the gateway's own scheme; the agent speaks TLS to it and does
not verify its certificate, as E2B's proxy does. Other ports stay plain,
and a sandbox that does not list the port cannot reach the TLS server.
Ports that are not ports, or are the agent's, are a 400 naming the field."""

import os
import pathlib
import socket
import subprocess
import time

import httpx
import pytest
from e2b import Sandbox, SandboxException
from websockets.sync.client import connect as websocket_connect

from conftest import create_refused, none_created

SERVER = (pathlib.Path(__file__).parent / "sandbox_server.py").read_text()
TLS_PORT, PLAIN_PORT = 3000, 3001


def get(gateway, host: str, path: str) -> httpx.Response:
    # The gateway listens on an IP address; the host name rides in `Host`.
    return httpx.get(gateway.url + path, headers={"host": host}, timeout=10)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate and its key, made on the host."""
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        + ["-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=sandbox.test"],
        check=True,
        capture_output=True,
    )
    return cert.read_text(), key.read_text()


def start_server(sbx, certificate, port: int, tls: bool):
    """sandbox_server.py on `port` inside `sbx`, over TLS with the
    self-signed certificate when `tls`."""
    sbx.files.write("/tmp/server.py", SERVER)
    sbx.files.write("/tmp/cert.pem", certificate[0])
    sbx.files.write("/tmp/key.pem", certificate[1])
    tls_args = " /tmp/cert.pem /tmp/key.pem" if tls else ""
    sbx.commands.run(f"python3 /tmp/server.py {port}{tls_args}", background=True)


def answered(gateway, host: str, path: str) -> httpx.Response:
    """The first answer that is not "port is not open": the server bound."""
    deadline = time.monotonic() + 20
    while True:
        response = get(gateway, host, path)
        if response.status_code != 502 or "port is not open" not in response.text:
            return response
        assert time.monotonic() < deadline, "the server in the sandbox never bound its port"
        time.sleep(0.05)


def test_an_https_port_is_reached_over_tls_and_a_plain_port_beside_it_stays_plain(gateway, certificate):
    sbx = Sandbox.create(timeout=120, network={"https_ports": [TLS_PORT]})
    try:
        start_server(sbx, certificate, TLS_PORT, tls=True)
        start_server(sbx, certificate, PLAIN_PORT, tls=False)
        tls_host = sbx.get_host(TLS_PORT)
        response = answered(gateway, tls_host, "/scheme")
        assert (response.status_code, response.text) == (200, "https"), response.text
        # The server still sees the host name the client used.
        assert get(gateway, tls_host, "/hello").text == f"hello from port {TLS_PORT}, host {tls_host}"
        plain = answered(gateway, sbx.get_host(PLAIN_PORT), "/scheme")
        assert (plain.status_code, plain.text) == (200, "http"), plain.text
        # The port header route (the SDK's E2B_SANDBOX_URL) is held to the
        # same list.
        by_header = httpx.get(
            gateway.url + "/scheme",
            headers={"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": str(TLS_PORT)},
            timeout=10,
        )
        assert by_header.text == "https"
        assert Sandbox.get_info(sbx.sandbox_id).network["https_ports"] == [TLS_PORT]
        assert sbx.commands.run("echo envd").stdout == "envd\n"
    finally:
        sbx.kill()


def test_streams_and_websockets_cross_the_tls_hop(gateway, certificate):
    sbx = Sandbox.create(timeout=120, network={"https_ports": [TLS_PORT]})
    try:
        start_server(sbx, certificate, TLS_PORT, tls=True)
        host = sbx.get_host(TLS_PORT)
        assert answered(gateway, host, "/scheme").text == "https"
        with httpx.stream("GET", gateway.url + "/stream", headers={"host": host}, timeout=10) as response:
            lines = response.iter_lines()
            assert next(lines) == "first"
            sbx.files.write("/tmp/release-stream", "")
            assert next(lines) == "second"
        sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=10)
        with websocket_connect(f"ws://{host}/ws", sock=sock, open_timeout=10, close_timeout=5) as ws:
            ws.send("over tls")
            assert ws.recv(timeout=10) == "over tls"
            payload = os.urandom(100_000)
            ws.send(payload)
            assert ws.recv(timeout=10) == payload
    finally:
        sbx.kill()


def test_a_tls_server_on_a_port_not_listed_is_not_reached(gateway, certificate):
    """The control: without the port in https_ports the agent speaks plain
    HTTP to the TLS server, which the server refuses; a 502 with a message,
    never a hang."""
    sbx = Sandbox.create(timeout=120)
    try:
        assert "https_ports" not in Sandbox.get_info(sbx.sandbox_id).network
        start_server(sbx, certificate, TLS_PORT, tls=True)
        response = answered(gateway, sbx.get_host(TLS_PORT), "/scheme")
        assert response.status_code == 502, response.text
        assert response.json()["code"] == 502 and response.json()["message"]
    finally:
        sbx.kill()


@pytest.mark.timeout(240, func_only=True)
def test_a_fork_keeps_its_sources_https_ports(gateway, certificate):
    source = Sandbox.create(timeout=120, network={"https_ports": [TLS_PORT]})
    children = []
    try:
        start_server(source, certificate, TLS_PORT, tls=True)
        assert answered(gateway, source.get_host(TLS_PORT), "/scheme").text == "https"
        children = [c for c in source.fork(count=1, timeout=60) if isinstance(c, Sandbox)]
        assert len(children) == 1
        child = children[0]
        assert Sandbox.get_info(child.sandbox_id).network["https_ports"] == [TLS_PORT]
        # A fork without memory has no server running yet; with memory, this
        # second one cannot bind and exits.
        start_server(child, certificate, TLS_PORT, tls=True)
        assert answered(gateway, child.get_host(TLS_PORT), "/scheme").text == "https"
    finally:
        for child in children:
            child.kill()
        source.kill()


def test_ports_that_are_not_ports_or_are_the_agents_are_refused_by_name(gateway):
    headers = {"X-API-KEY": os.environ["E2B_API_KEY"]}
    nonce = os.urandom(6).hex()
    for bad in ([49983], [0], [70000], [-1], [3000, 49983], list(range(1, 66))):
        with pytest.raises(SandboxException, match="400: network.httpsPorts"):
            Sandbox.create(timeout=30, metadata={"probe": nonce}, network={"https_ports": bad})
        create_refused(gateway, {"httpsPorts": bad}, "httpsPorts", nonce)
    none_created(gateway, nonce)
    # Duplicates collapse; the list is fixed at create, as E2B has it.
    sbx = Sandbox.create(timeout=60, network={"https_ports": [8443, 3000, 8443]})
    try:
        assert Sandbox.get_info(sbx.sandbox_id).network["https_ports"] == [3000, 8443]
        update = {"allowOut": [], "httpsPorts": [9443]}
        response = httpx.put(f"{gateway.url}/sandboxes/{sbx.sandbox_id}/network", json=update, headers=headers)
        assert response.status_code == 400 and "httpsPorts" in response.json()["message"], response.text
        sbx.update_network({"allow_out": []})
        assert Sandbox.get_info(sbx.sandbox_id).network["https_ports"] == [3000, 8443]
    finally:
        sbx.kill()
