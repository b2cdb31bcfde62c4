"""The gateway's state in PostgreSQL (`copse up --database postgres://…`):
a real server from Debian's `postgresql` package, started here in a
temporary directory and listening only on a unix socket there, behind a
gateway of its own. The SDK creates, lists, snapshots and kills; the CLI
adds a key to the same database while the gateway runs; a restart finds
everything again, with no SQLite database in the data dir."""

import os
import subprocess
import time

import pytest
from e2b import Sandbox

from conftest import API_KEY, BRIDGE, COPSE, DATA_DIR, SUBNET, Gateway, second_data_dir
from postgres_server import database_server, database_url  # noqa: F401 (fixtures, used by name)

PG_BRIDGE = f"{BRIDGE[:9]}p"
PG_SUBNET = f"10.{(int(SUBNET.split('.')[1]) + 110) % 256}.0.0/16"


@pytest.fixture(scope="module")
def pg_gateway(database_url):
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(COPSE), "template", "build", "--data-dir", str(DATA_DIR)], check=True)
    os.environ["E2B_CONNECTION_RETRIES"] = "0"
    gw = Gateway(second_data_dir("postgres"))
    gw.args = ["--database", database_url, "--bridge", PG_BRIDGE, "--subnet", PG_SUBNET]
    gw.start(keep_sandboxes=True, extra_args=gw.args)
    yield gw
    gw.stop()
    subprocess.run(["nft", "delete", "table", "inet", f"copse_{PG_BRIDGE}"], capture_output=True)
    subprocess.run(["ip", "link", "del", PG_BRIDGE], capture_output=True)


def listed(env) -> set[str]:
    return {s.sandbox_id for s in Sandbox.list(**env).next_items()}


def test_a_gateway_on_postgres_keeps_sandboxes_snapshots_and_keys_across_a_restart(pg_gateway, database_url):
    gw = pg_gateway
    env = dict(api_key=API_KEY, api_url=gw.url, sandbox_url=gw.url)
    kept = Sandbox.create(timeout=300, **env)
    gone = Sandbox.create(timeout=300, **env)
    snapshot_id = None
    try:
        kept.files.write("/home/user/note", "in postgres")
        assert {kept.sandbox_id, gone.sandbox_id} <= listed(env)
        snapshot_id = kept.create_snapshot().snapshot_id
        gone.kill()
        assert gone.sandbox_id not in listed(env)

        # The CLI writes a key to the same database; the running gateway
        # accepts it without a restart.
        key = subprocess.run([str(COPSE), "keys", "create", "--team", "acme", "--name", "pg",
                              "--data-dir", str(gw.data_dir), "--database", database_url],
                             check=True, capture_output=True, text=True).stdout.strip()
        deadline = time.monotonic() + 10
        while True:
            try:
                theirs = Sandbox.list(api_key=key, api_url=gw.url, sandbox_url=gw.url).next_items()
                break
            except Exception:
                assert time.monotonic() < deadline, "the CLI's key never reached the gateway"
                time.sleep(0.2)
        assert theirs == [], "another team sees none of the default team's sandboxes"

        gw.stop()
        gw.start(keep_sandboxes=True, extra_args=gw.args)
        assert kept.sandbox_id in listed(env), "re-adopted from the database's record"
        assert gone.sandbox_id not in listed(env)
        again = Sandbox.connect(kept.sandbox_id, **env)
        assert again.files.read("/home/user/note") == "in postgres"
        child = Sandbox.create(template=snapshot_id, timeout=120, **env)
        try:
            assert child.files.read("/home/user/note") == "in postgres"
        finally:
            child.kill()
        keys = subprocess.run([str(COPSE), "keys", "list", "--data-dir", str(gw.data_dir), "--database", database_url],
                              check=True, capture_output=True, text=True).stdout
        assert "acme" in keys
        assert not (gw.data_dir / "copse.db").exists(), "nothing was written to SQLite"
    finally:
        for sbx in (kept, gone):
            try:
                sbx.kill()
            except Exception:
                pass
        if snapshot_id:
            Sandbox.delete_snapshot(snapshot_id, **env)


def test_an_unreachable_database_stops_the_gateway_with_a_clear_error(tmp_path):
    missing = f"postgresql:///postgres?user=postgres&host={tmp_path}&connect_timeout=2"
    out = subprocess.run([str(COPSE), "keys", "list", "--data-dir", str(tmp_path), "--database", missing],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "connecting to the database" in out.stderr, out.stderr
