"""A throwaway PostgreSQL from Debian's `postgresql` package, started in a
temporary directory and listening only on a unix socket there: the shared
database of the tests that need one."""

import glob
import os
import pathlib
import pwd
import shutil
import signal
import subprocess
import tempfile
import time

import pytest


def pg_program(name: str) -> str:
    """Debian keeps the server's programs off the PATH, one directory per
    major version: the newest."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(p.split("/")[4]))
    assert found, f"no {name}: scripts/bootstrap installs postgresql"
    return found[-1]


class PostgresServer:
    """One throwaway cluster; `restart` stops it (fast shutdown, every
    connection cut) and starts it again on the same files."""

    def __init__(self):
        pg = pwd.getpwnam("postgres")
        self.root = tempfile.mkdtemp(prefix="copse-pg-")
        os.chown(self.root, pg.pw_uid, pg.pw_gid)
        self.as_postgres = dict(user=pg.pw_uid, group=pg.pw_gid, cwd=self.root)
        self.data = f"{self.root}/data"
        subprocess.run([pg_program("initdb"), "--no-sync", "--auth=trust", "--username=postgres", "-D", self.data],
                       check=True, capture_output=True, **self.as_postgres)
        self.server = None
        self.start()

    @property
    def url(self) -> str:
        return f"postgresql:///postgres?user=postgres&host={self.root}"

    def start(self):
        log_path = pathlib.Path(f"{self.root}/server.log")
        log_path.unlink(missing_ok=True)
        log = open(log_path, "wb")
        self.server = subprocess.Popen([pg_program("postgres"), "-D", self.data, "-c", "listen_addresses=",
                                        "-k", self.root], stdout=log, stderr=log, **self.as_postgres)
        deadline = time.monotonic() + 60
        while b"ready to accept connections" not in log_path.read_bytes():
            assert self.server.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)

    def stop(self):
        self.server.send_signal(signal.SIGINT)  # fast shutdown
        self.server.wait(timeout=60)

    def restart(self):
        self.stop()
        self.start()


@pytest.fixture(scope="module")
def database_server():
    server = PostgresServer()
    yield server
    server.stop()
    shutil.rmtree(server.root, ignore_errors=True)


@pytest.fixture(scope="module")
def database_url(database_server):
    return database_server.url
