"""Attacks a sandbox's root can make on the host, each answered without
the host following what the sandbox wrote. Every feature that lets a
sandbox write something the host later reads adds its attack here."""

import os
import socket
import tempfile
import threading
import time

import httpx
import pytest
from e2b import Sandbox


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
