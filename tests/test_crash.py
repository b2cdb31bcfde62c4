"""Crash-safe state changes: for every fault point the gateway exports
(`copse debug fault-points`), a gateway of its own aborts at that step of the
operation (`copse up --debug-faults` with COPSE_FAULT), is started again, and
must have settled the change: the sandbox in its old state or its new one
with its files, nothing frozen that it lists as running, snapshot records
and snapshot files in step, no orphan layers, no leftovers on the host, and
an empty journal."""

import io
import ipaddress
import json
import os
import signal
import sqlite3
import subprocess
import time
import urllib.request

import pytest
from e2b import Sandbox, SandboxNotFoundException, Volume

import leakcheck
from conftest import API_KEY, BRIDGE, COPSE, DATA_DIR, SUBNET, Gateway, second_data_dir

ALL_POINTS = subprocess.run([str(COPSE), "debug", "fault-points"], check=True, capture_output=True,
                            text=True).stdout.split()
# The import runs in the CLI, not in the gateway: a test of its own.
POINTS = [p for p in ALL_POINTS if not p.startswith("import:")]
# Each point is one short gateway life and one restart; the whole loop
# stays under four minutes.
PER_POINT_S = 45
CRASH_BRIDGE = f"{BRIDGE[:9]}x"
CRASH_SUBNET = f"10.{(ipaddress.ip_network(SUBNET).network_address.packed[1] + 120) % 256}.0.0/16"
MARKER = "/home/user/marker"


def test_every_operation_has_fault_points():
    assert "import:after-files" in ALL_POINTS
    ops = {p.split(":")[0] for p in POINTS}
    assert {"pause", "pause-files", "restart", "resume", "resume-files", "snapshot", "fork", "rollback",
            "kill"} <= ops, POINTS
    assert set(OPERATIONS) >= ops, f"fault points without an operation in this test: {ops - set(OPERATIONS)}"


@pytest.fixture(scope="module")
def crash_network():
    """The crash gateways' own network; the suite's gateway is not needed,
    only its templates (a gateway builds any that are missing at start)."""
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(COPSE), "template", "build", "--data-dir", str(DATA_DIR)], check=True)
    os.environ["E2B_CONNECTION_RETRIES"] = "0"
    yield ["--bridge", CRASH_BRIDGE, "--subnet", CRASH_SUBNET]
    subprocess.run(["nft", "delete", "table", "inet", f"copse_{CRASH_BRIDGE}"], capture_output=True)
    subprocess.run(["ip", "link", "del", CRASH_BRIDGE], capture_output=True)


class Crashing:
    """A gateway on a fresh data dir, armed to abort at `point`."""

    def __init__(self, point: str, network: list[str]):
        self.point = point
        self.network = network
        self.data_dir = second_data_dir("crash")
        self.gw = Gateway(self.data_dir)
        os.environ["COPSE_FAULT"] = point
        try:
            self.gw.start(extra_args=[*network, "--debug-faults"])
        finally:
            del os.environ["COPSE_FAULT"]
        self.env = dict(api_key=API_KEY, api_url=self.gw.url, sandbox_url=self.gw.url)

    def aborted(self) -> None:
        """The armed step was reached: the gateway died of SIGABRT."""
        code = self.gw.proc.wait(timeout=30)
        assert code == -signal.SIGABRT, f"{self.point}: gateway exited with {code}, not at the fault"

    def restart(self) -> None:
        self.gw.log.write(b"--- restarted after the injected fault ---\n")
        self.gw.log.flush()
        self.gw.start(extra_args=self.network)

    def db(self, sql: str) -> list:
        with sqlite3.connect(self.data_dir / "copse.db") as db:
            return db.execute(sql).fetchall()


def frozen(data_dir, sandbox_id: str) -> bool:
    for d in leakcheck.cgroup_dirs().get((leakcheck.subtree_for(data_dir), sandbox_id), []):
        if (d / "cgroup.freeze").exists() and (d / "cgroup.freeze").read_text().strip() == "1":
            return True
        if (d / "freezer.state").exists() and "FROZEN" in (d / "freezer.state").read_text():
            return True
    return False


# What each operation does through the SDK: (setup, act). `act` is expected
# to fail (the gateway aborts while answering).
def _pause(sbx, c):
    sbx.pause()


def _pause_files(sbx, c):
    sbx.pause(mode="filesystem")


def _resume(sbx, c):
    Sandbox.connect(sbx.sandbox_id, timeout=120, **c.env)


def _restart(sbx, c):
    Sandbox.connect(sbx.sandbox_id, timeout=120, on_resume="reboot", **c.env)


def _snapshot(sbx, c):
    sbx.create_snapshot(mode="filesystem")


def _fork(sbx, c):
    sbx.fork(count=1, timeout=120)


def _rollback(sbx, c):
    request = urllib.request.Request(
        f"{c.gw.url}/copse/sandboxes/{sbx.sandbox_id}/rollback", data=json.dumps({"snapshotID": "crash-v1"}).encode(),
        method="POST", headers={"X-API-KEY": API_KEY, "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        raise AssertionError(f"the rollback answered {response.status} instead of aborting")


def _kill(sbx, c):
    sbx.kill()


def _paused(sbx, c):
    assert sbx.pause() is True


def _paused_files(sbx, c):
    assert sbx.pause(mode="filesystem") is True


def _snapshot_then_change(sbx, c):
    sbx.create_snapshot(name="crash-v1", mode="filesystem")
    sbx.files.write(MARKER, "v2")


OPERATIONS = {
    "pause": (None, _pause),
    "pause-files": (None, _pause_files),
    "resume": (_paused, _resume),
    "restart": (_paused, _restart),
    "resume-files": (_paused_files, _resume),
    "snapshot": (None, _snapshot),
    "fork": (None, _fork),
    "rollback": (_snapshot_then_change, _rollback),
    "kill": (None, _kill),
}


@pytest.mark.timeout(PER_POINT_S, func_only=True)
@pytest.mark.parametrize("point", POINTS)
def test_a_crash_at_each_step_leaves_old_or_new_state(crash_network, point):
    op = point.split(":")[0]
    setup, act = OPERATIONS[op]
    c = Crashing(point, crash_network)
    try:
        sbx = Sandbox.create(template="base", timeout=300, **c.env)
        sid = sbx.sandbox_id
        sbx.files.write(MARKER, "v1")
        if setup:
            setup(sbx, c)
        with pytest.raises(Exception):
            act(sbx, c)
        c.aborted()
        c.restart()
        check_invariants(c, sid, op)
    finally:
        cleanup(c)


def test_the_fault_variable_alone_arms_nothing(crash_network):
    """Without the hidden flag COPSE_FAULT is ignored: nothing an
    environment (or a request) carries can make a production gateway abort."""
    data_dir = second_data_dir("crash")
    gw = Gateway(data_dir)
    os.environ["COPSE_FAULT"] = "pause:after-freeze"
    try:
        gw.start(extra_args=crash_network)
    finally:
        del os.environ["COPSE_FAULT"]
    env = dict(api_key=API_KEY, api_url=gw.url, sandbox_url=gw.url)
    try:
        sbx = Sandbox.create(template="base", timeout=60, **env)
        assert sbx.pause() is True
        assert gw.proc.poll() is None
        sbx.kill()
    finally:
        gw.stop()
    bad = subprocess.run([str(COPSE), "up", "--debug-faults", "--data-dir", str(data_dir), *crash_network],
                         env=dict(os.environ, COPSE_FAULT="no-such:step"), capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0 and "no fault point" in bad.stderr, bad.stderr[-500:]


@pytest.mark.timeout(120, func_only=True)
def test_an_import_cut_short_leaves_nothing_after_a_restart(crash_network, tmp_path):
    """`copse snapshot import` killed while it reads the stream, and aborted
    between its files and its record: after the gateway's next start no
    snapshot, layer, or staging directory of either is left."""
    data_dir = second_data_dir("crash")
    gw = Gateway(data_dir)
    gw.start(extra_args=crash_network)
    env = dict(api_key=API_KEY, api_url=gw.url, sandbox_url=gw.url)
    export = tmp_path / "snap.copse"
    try:
        sbx = Sandbox.create(template="base", timeout=120, **env)
        sbx.files.write(MARKER, "v1")
        sbx.commands.run("head -c 4000000 /dev/urandom > /home/user/ballast")
        sbx.create_snapshot(name="to-move")
        sbx.kill()
        on_disk = ["--data-dir", str(data_dir)]
        subprocess.run([str(COPSE), "snapshot", "export", "to-move", str(export), *on_disk], check=True)
        Sandbox.delete_snapshot("to-move", **env)

        # Killed mid-stream: half the export in, the rest never comes.
        fifo = tmp_path / "stream"
        os.mkfifo(fifo)
        importer = subprocess.Popen([str(COPSE), "snapshot", "import", str(fifo), "--name", "cut", *on_disk])
        with open(fifo, "wb") as stream:
            data = export.read_bytes()
            stream.write(data[: len(data) // 2])
            stream.flush()
            deadline = time.monotonic() + 10
            while not list(data_dir.glob(".import-*")) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert list(data_dir.glob(".import-*")), "the import never began"
            importer.kill()
            importer.wait(timeout=10)

        # Aborted with its files in place and no record.
        aborted = subprocess.run([str(COPSE), "snapshot", "import", "--debug-faults", str(export), "--name", "torn",
                                  *on_disk], env=dict(os.environ, COPSE_FAULT="import:after-files"),
                                 capture_output=True, text=True, timeout=60)
        assert aborted.returncode == -signal.SIGABRT, aborted.stderr[-500:]

        gw.stop()
        gw.start(extra_args=crash_network)
        assert Sandbox.list_snapshots(**env).next_items() == []
        assert list((data_dir / "snapshots").glob("*.json")) == []
        assert leakcheck.unnamed_layers(data_dir) == []
        layers = [e.name for e in (data_dir / "layers").iterdir() if e.name != ".lock"]
        assert layers == [], "no layer outlives the imports"
        assert list(data_dir.glob(".import-*")) == [], "the cut import's staging is collected"
    finally:
        if gw.proc.poll() is None:
            gw.stop()


@pytest.mark.timeout(180, func_only=True)
def test_a_volume_import_killed_midway_is_removed_at_the_next_start_and_a_live_one_is_not(
    crash_network, tmp_path, monkeypatch
):
    """`copse volume import` killed while it reads the stream leaves a
    volume no record names: the gateway's next start removes it. An import
    still running across that start is left alone and finishes."""
    data_dir = second_data_dir("crash")
    gw = Gateway(data_dir)
    gw.start(extra_args=crash_network)
    monkeypatch.setenv("E2B_VOLUME_API_URL", gw.url)
    on_disk = ["--data-dir", str(data_dir)]
    volumes, claims = data_dir / "disk" / ".volumes", data_dir / "volume-imports"
    archive = tmp_path / "vol.tar"
    streams = []
    try:
        vol = Volume.create("to-move", api_key=API_KEY, api_url=gw.url)
        vol.write_file("/ballast.bin", io.BytesIO(os.urandom(4 << 20)))
        subprocess.run([str(COPSE), "volume", "export", "to-move", "--out", str(archive), *on_disk], check=True)
        data = archive.read_bytes()
        before = set(volumes.iterdir())

        def cut_short(name: str) -> subprocess.Popen:
            """An import fed half the archive, its stream left open."""
            fifo = tmp_path / name
            os.mkfifo(fifo)
            importer = subprocess.Popen([str(COPSE), "volume", "import", str(fifo), "--name", name, *on_disk])
            stream = open(fifo, "wb")
            streams.append(stream)
            stream.write(data[: len(data) // 2])
            stream.flush()
            deadline = time.monotonic() + 20
            while len(set(volumes.iterdir()) - before) < len(streams) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(set(volumes.iterdir()) - before) == len(streams), "the import never began"
            return importer

        dead = cut_short("dead")
        dead.kill()
        dead.wait(timeout=10)
        live = cut_short("live")
        assert len(list(claims.iterdir())) == 2

        gw.stop()
        gw.start(extra_args=crash_network)
        assert len(set(volumes.iterdir()) - before) == 1, "the dead import's volume is removed, the live one's kept"
        assert len(list(claims.iterdir())) == 1

        streams[-1].write(data[len(data) // 2 :])
        streams[-1].close()
        assert live.wait(timeout=60) == 0
        listed = {v.name: v.volume_id for v in Volume.list(api_key=API_KEY, api_url=gw.url)}
        assert "dead" not in listed and {"to-move", "live"} <= listed.keys(), listed
        assert list(claims.iterdir()) == []
        copy = Volume.connect(listed["live"], api_key=API_KEY, api_url=gw.url)
        assert copy.read_file("/ballast.bin", format="bytes") == vol.read_file("/ballast.bin", format="bytes")
    finally:
        for stream in streams:
            try:
                stream.close()
            except OSError:
                pass
        if gw.proc.poll() is None:
            gw.stop()


def check_invariants(c: Crashing, sid: str, op: str) -> None:
    assert c.db("SELECT id FROM journal") == [], "the journal is settled at start"
    listed = {s.sandbox_id: s for s in Sandbox.list(**c.env).next_items()}
    if op == "kill":
        assert sid not in listed, "a kill the journal saw begin is finished"
        with pytest.raises(SandboxNotFoundException):
            Sandbox.connect(sid, **c.env)
    else:
        assert sid in listed, f"the sandbox survives a crash in {op}"
    # Nothing listed as running is frozen on the host, and each answers.
    for other_id, info in listed.items():
        if info.state.value == "running":
            assert not frozen(c.data_dir, other_id), f"{other_id} is listed running but frozen"
    # Snapshot records and snapshot files are in step (files of a sandbox
    # paused on its files count as its record's).
    keys = {json.loads(r)["key"] for (r,) in c.db("SELECT record FROM team_snapshots")}
    for (r,) in c.db("SELECT record FROM sandboxes"):
        paused = json.loads(r).get("paused") or {}
        if paused.get("files_only"):
            keys.add(paused["files_only"])
    files = {p.stem for p in (c.data_dir / "snapshots").glob("*.json")} if (c.data_dir / "snapshots").exists() else set()
    assert keys == files, f"snapshot records {sorted(keys)} vs files {sorted(files)}"
    assert leakcheck.unnamed_layers(c.data_dir) == []
    leakcheck.assert_no_leaks(c.data_dir, listed, gateway_pid=c.gw.proc.pid)
    if op == "kill":
        return
    # Old state or new, with its files: connect resumes a paused one.
    again = Sandbox.connect(sid, timeout=120, **c.env)
    expected = {"v1", "v2"} if op == "rollback" else {"v1"}
    assert again.files.read(MARKER) in expected
    assert again.commands.run("echo ok", timeout=30).stdout == "ok\n"
    for other_id in listed:
        if other_id != sid:  # a fork's child that was handed over works too
            child = Sandbox.connect(other_id, timeout=120, **c.env)
            assert child.files.read(MARKER) == "v1"
    if op == "snapshot":
        for snap in Sandbox.list_snapshots(**c.env).next_items():
            child = Sandbox.create(template=snap.snapshot_id, timeout=60, **c.env)
            assert child.files.read(MARKER) == "v1", "a snapshot that survived has its files"
            child.kill()


def cleanup(c: Crashing) -> None:
    if c.gw.proc.poll() is None:
        try:
            for s in Sandbox.list(**c.env).next_items():
                Sandbox.kill(s.sandbox_id, **c.env)
            for s in Sandbox.list_snapshots(**c.env).next_items():
                Sandbox.delete_snapshot(s.snapshot_id, **c.env)
        finally:
            c.gw.stop()
    else:
        # Aborted and not restarted (a failed check): a normal start and
        # stop cleans what it left.
        c.gw.start(extra_args=c.network)
        c.gw.stop()
    leakcheck.assert_no_leaks(c.data_dir, [])


@pytest.fixture(scope="module", autouse=True)
def bounded():
    started = time.monotonic()
    yield
    elapsed = time.monotonic() - started
    print(f"crash loop over {len(POINTS)} fault points: {elapsed:.0f} s")
    assert elapsed < 240, f"the crash loop took {elapsed:.0f} s, over its 4 minute bound"
