"""A real S3-compatible object store on loopback for the object-store
tests: SeaweedFS (`weed server` with its filer and S3 gateway, built by
scripts/seaweedfs), one bucket, one signing identity. Its filer's HTTP API
reaches the bucket's objects directly, so a test can change what a copse
host wrote there as an attacker holding the bucket would."""

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time

import httpx
import pytest

from conftest import COPSE, free_port

WEED = shutil.which("weed") or "/usr/local/bin/weed"
BUCKET = "copse-test"
KEY_ID, SECRET = "copse-test-key", "copse-test-secret-0123456789"


class SeaweedFS:
    def __init__(self, workdir: pathlib.Path):
        self.workdir = workdir
        (workdir / "data").mkdir(parents=True, exist_ok=True)
        ports = {name: free_port() for name in ("master", "volume", "filer", "s3")}
        grpc = {name: free_port() for name in ports}
        self.s3_port, self.filer_port = ports["s3"], ports["filer"]
        # SeaweedFS's address form for a gRPC port that is not HTTP's + 10000.
        master = f"127.0.0.1:{ports['master']}.{grpc['master']}"
        config = workdir / "s3.json"
        identity = {"name": "copse", "credentials": [{"accessKey": KEY_ID, "secretKey": SECRET}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
        config.write_text(json.dumps({"identities": [identity]}))
        self.argv = [WEED, "server", f"-dir={workdir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                     "-volume.max=16", "-master.volumeSizeLimitMB=64", "-filer", "-s3", f"-s3.config={config}",
                     "-s3.port.iceberg=0", "-s3.port.lance=0"]
        for name in ports:
            self.argv += [f"-{name}.port={ports[name]}", f"-{name}.port.grpc={grpc[name]}"]
        self.log = open(workdir / "weed.log", "ab")
        self.proc = None
        try:
            self.start()
            shell = subprocess.run([WEED, "shell", f"-master={master}"], input=f"s3.bucket.create -name {BUCKET}\n",
                                   capture_output=True, text=True, timeout=60)
            assert f"created bucket {BUCKET}" in shell.stdout, shell.stdout + shell.stderr
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}/{BUCKET}"

    def env(self) -> dict:
        """The environment a copse command needs to reach the bucket."""
        return dict(os.environ, COPSE_OBJECT_STORE=self.url, AWS_ACCESS_KEY_ID=KEY_ID, AWS_SECRET_ACCESS_KEY=SECRET)

    def start(self):
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=self.log, start_new_session=True)
        # Listening is not ready: a write needs the master's raft to have a
        # leader and a volume server registered with it, which takes some
        # seconds after a restart. A write through the filer proves both.
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.workdir / "weed.log").read_text()[-2000:]
            try:
                probe = httpx.post(f"http://127.0.0.1:{self.filer_port}/copse-ready/probe",
                                   files={"file": ("probe", b"ready")}, timeout=5)
                if probe.status_code < 300:
                    socket.create_connection(("127.0.0.1", self.s3_port), timeout=0.2).close()
                    return
            except (httpx.HTTPError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError("SeaweedFS did not become ready for writes")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)

    def object_path(self, key: str) -> str:
        return f"http://127.0.0.1:{self.filer_port}/buckets/{BUCKET}/{key}"

    def read(self, key: str) -> bytes | None:
        got = httpx.get(self.object_path(key), timeout=10)
        return None if got.status_code == 404 else got.raise_for_status().content

    def overwrite(self, key: str, data: bytes):
        """Replaces an object behind copse's back, through the filer."""
        httpx.delete(self.object_path(key), timeout=10)
        httpx.post(self.object_path(key), files={"file": (key.rsplit("/", 1)[-1], data)}, timeout=10).raise_for_status()
        assert self.read(key) == data

    def keys(self, prefix: str) -> list[str]:
        listing = httpx.get(self.object_path(prefix) + "/", headers={"Accept": "application/json"},
                            params={"limit": 10000}, timeout=10)
        if listing.status_code == 404:
            return []
        return sorted(f"{prefix}/{entry['FullPath'].rsplit('/', 1)[-1]}"
                      for entry in listing.raise_for_status().json().get("Entries") or [])


def snapshot_with_file(name: str, path: str, text: str):
    """A files-only snapshot `name` of a new sandbox holding `text` at `path`."""
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=120)
    try:
        sbx.files.write(path, text)
        sbx.create_snapshot(name=name, mode="filesystem")
    finally:
        sbx.kill()


def copse_snapshot(store: SeaweedFS, *args, check=True, timeout=120) -> subprocess.CompletedProcess:
    """`copse snapshot ARGS` with the bucket in its environment."""
    done = subprocess.run([str(COPSE), "snapshot", *args], env=store.env(), capture_output=True, text=True,
                          timeout=timeout)
    if check:
        assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.fixture(scope="module")
def object_store(tmp_path_factory):
    store = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"))
    yield store
    store.stop()
