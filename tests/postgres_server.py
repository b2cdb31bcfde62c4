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


@pytest.fixture(scope="module")
def database_url():
    pg = pwd.getpwnam("postgres")
    root = tempfile.mkdtemp(prefix="copse-pg-")
    os.chown(root, pg.pw_uid, pg.pw_gid)
    as_postgres = dict(user=pg.pw_uid, group=pg.pw_gid, cwd=root)
    data = f"{root}/data"
    subprocess.run([pg_program("initdb"), "--no-sync", "--auth=trust", "--username=postgres", "-D", data],
                   check=True, capture_output=True, **as_postgres)
    log = open(f"{root}/server.log", "wb")
    server = subprocess.Popen([pg_program("postgres"), "-D", data, "-c", "listen_addresses=", "-k", root],
                              stdout=log, stderr=log, **as_postgres)
    deadline = time.monotonic() + 60
    while b"ready to accept connections" not in pathlib.Path(f"{root}/server.log").read_bytes():
        assert server.poll() is None and time.monotonic() < deadline, pathlib.Path(f"{root}/server.log").read_text()
        time.sleep(0.1)
    yield f"postgresql:///postgres?user=postgres&host={root}"
    server.send_signal(signal.SIGINT)  # fast shutdown
    server.wait(timeout=60)
    shutil.rmtree(root, ignore_errors=True)
