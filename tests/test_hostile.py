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
        deadline = time.monotonic() + 10
        metrics = []
        while not metrics and time.monotonic() < deadline:
            metrics = sbx.get_metrics()
            if not metrics:
                time.sleep(0.5)
        assert metrics, "no metrics within 10 s"
        m = metrics[-1]
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
