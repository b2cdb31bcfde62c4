"""Sandbox ports reached by host name, `{port}-{sandboxID}.{domain}`, as
`sandbox.get_host(port)` names them: a server started inside a sandbox
answers plain requests, streams, and WebSocket through the gateway; the
agent's own port answers the same way; a sandbox or port that is not there
is a prompt 502 with a message, never a hang."""

import pathlib
import socket
import time

import httpx
import pytest
from e2b import Sandbox
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as websocket_connect

from conftest import API_KEY

SERVER = (pathlib.Path(__file__).parent / "sandbox_server.py").read_text()
PORT = 8000
ENVD_PORT = 49983


def get(gateway, host: str, path: str) -> httpx.Response:
    # The gateway listens on an IP address; the host name rides in `Host`,
    # as it would after a wildcard DNS or /etc/hosts lookup.
    return httpx.get(gateway.url + path, headers={"host": host}, timeout=10)


@pytest.fixture
def served(gateway, sandbox):
    """The sandbox, with sandbox_server.py listening on PORT inside it."""
    sandbox.files.write("/tmp/server.py", SERVER)
    sandbox.commands.run(f"python3 /tmp/server.py {PORT}", background=True)
    host = sandbox.get_host(PORT)
    deadline = time.monotonic() + 20
    while (response := get(gateway, host, "/hello")).status_code != 200:
        # Until the server binds, the port is closed: a 502, not a hang.
        assert response.status_code == 502, response.text
        assert time.monotonic() < deadline, "the server in the sandbox never answered"
        time.sleep(0.05)
    return sandbox, host


def test_get_host_names_the_port_and_the_sandbox(sandbox):
    assert sandbox.get_host(PORT) == f"{PORT}-{sandbox.sandbox_id}.{sandbox.sandbox_domain}"


def test_server_in_a_sandbox_answers_by_host_name(gateway, served):
    sandbox, host = served
    response = get(gateway, host, "/hello")
    assert response.status_code == 200
    # The server sees the host name the client used.
    assert response.text == f"hello from port {PORT}, host {host}"


def test_streamed_response_arrives_part_by_part(gateway, served):
    sandbox, host = served
    with httpx.stream("GET", gateway.url + "/stream", headers={"host": host}, timeout=10) as response:
        lines = response.iter_lines()
        # The server holds its second part until we have read the first.
        assert next(lines) == "first"
        sandbox.files.write("/tmp/release-stream", "")
        assert next(lines) == "second"


def test_websocket_echo_through_the_gateway(gateway, served):
    sandbox, host = served
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=10)
    with websocket_connect(f"ws://{host}/ws", sock=sock, open_timeout=10, close_timeout=5) as ws:
        for i in range(5):
            ws.send(f"message {i}")
            assert ws.recv(timeout=10) == f"message {i}"
        payload = bytes(range(256)) * 400  # > 64 KiB: an extended-length frame
        ws.send(payload)
        assert ws.recv(timeout=10) == payload


def test_a_websocket_upgrade_while_the_server_starts_gets_an_answer(gateway, sandbox):
    """Upgrades sent back to back while a server starts (closed port, bound
    but not yet listening, listening but not yet accepting) each get a 502
    or a 101 at once, never silence: a CI run once saw a handshake sent at
    that moment go unanswered for 10 s."""
    sandbox.files.write("/tmp/server.py", SERVER)
    host = sandbox.get_host(PORT)
    for _ in range(6):
        started = sandbox.commands.run(f"sleep 0.3; exec python3 /tmp/server.py {PORT}", background=True)
        refused, deadline = 0, time.monotonic() + 20
        while True:
            sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=10)
            try:
                ws = websocket_connect(f"ws://{host}/ws", sock=sock, open_timeout=5, close_timeout=5)
                break
            except InvalidStatus as e:
                assert e.response.status_code == 502 and time.monotonic() < deadline
                refused += 1
                time.sleep(0.01)
        with ws:
            ws.send("up")
            assert ws.recv(timeout=10) == "up"
        assert refused > 0, "the first upgrade was sent after the server started: nothing raced"
        started.kill()


def test_agent_port_answers_by_host_name(gateway, sandbox):
    host = sandbox.get_host(ENVD_PORT)
    assert get(gateway, host, "/health").status_code == 204
    # The agent still guards everything else with the sandbox's token.
    assert get(gateway, host, "/envs").status_code == 401


def test_closed_port_is_a_prompt_502(gateway, sandbox):
    started = time.monotonic()
    response = get(gateway, sandbox.get_host(PORT + 1), "/")
    assert response.status_code == 502
    assert f"port is not open: {PORT + 1}" in response.json()["message"]
    assert time.monotonic() - started < 2


def test_unknown_sandbox_by_host_name_is_a_prompt_502(gateway):
    started = time.monotonic()
    response = get(gateway, f"{PORT}-nosuchsandbox0000000.e2b.app", "/")
    assert response.status_code == 502
    assert response.json() == {"code": 502, "message": "The sandbox nosuchsandbox0000000 was not found"}
    assert time.monotonic() - started < 2


def test_other_host_names_reach_the_control_plane(gateway):
    response = httpx.get(
        gateway.url + "/v2/sandboxes", headers={"host": "api.e2b.app", "x-api-key": API_KEY}, timeout=10
    )
    assert response.status_code == 200
    assert isinstance(response.json(), list)


def test_code_interpreter_port_answers_by_host_name(gateway):
    from e2b_code_interpreter import Sandbox

    sandbox = Sandbox.create(timeout=120)
    try:
        response = get(gateway, sandbox.get_host(49999), "/health")
        assert response.status_code == 200, response.text
    finally:
        sandbox.kill()


def test_a_masked_sandbox_hands_its_servers_the_mask_as_their_host(gateway):
    """`network.mask_request_host`: a server in the sandbox is handed the
    mask as `Host`, `${PORT}` filled in, whether the caller named the port
    by host name or by header; info reports the mask; the SDK, on the
    agent's port, is unaffected."""
    sbx = Sandbox.create(timeout=60, network={"mask_request_host": "${PORT}-myapp.example.com"})
    try:
        sbx.files.write("/tmp/server.py", SERVER)
        sbx.commands.run(f"python3 /tmp/server.py {PORT}", background=True)
        host = sbx.get_host(PORT)
        deadline = time.monotonic() + 20
        while (response := get(gateway, host, "/hello")).status_code != 200:
            assert response.status_code == 502 and time.monotonic() < deadline, response.text
            time.sleep(0.05)
        assert response.text == f"hello from port {PORT}, host {PORT}-myapp.example.com"
        by_header = httpx.get(
            gateway.url + "/hello",
            headers={"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": str(PORT)},
            timeout=10,
        )
        assert by_header.text == f"hello from port {PORT}, host {PORT}-myapp.example.com"
        assert Sandbox.get_info(sbx.sandbox_id).network["mask_request_host"] == "${PORT}-myapp.example.com"
        assert sbx.commands.run("echo envd").stdout == "envd\n"
    finally:
        sbx.kill()


def test_an_unmasked_sandbox_reports_no_mask(sandbox):
    network = Sandbox.get_info(sandbox.sandbox_id).network
    assert "mask_request_host" not in network and network["allow_public_traffic"] is True
