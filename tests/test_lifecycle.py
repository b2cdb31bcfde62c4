"""Lifecycle through the official SDK: pause and resume (memory kept, or
files only), auto-pause on timeout with auto-resume, filesystem snapshots and
sandboxes created from them, full (memory) snapshots restored into new
sandboxes, fork, rollback (copse's own endpoint), deleting snapshots, and the
errors for unknown ids and unsupported modes."""

import http.client
import json
import os
import pathlib
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

import pytest
from e2b import Sandbox, SandboxNotFoundException

import leakcheck
from conftest import COPSE, second_data_dir
from test_leaks import live_ids, stop_gateway

# Renamed into place, so a reader never sees a half-written count.
COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done"


def api(gateway, method: str, path: str, body=None) -> tuple[int, dict | list | None]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{gateway.url}{path}",
        data=data,
        method=method,
        headers={"X-API-KEY": os.environ["E2B_API_KEY"], "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def cpu_ns(gateway, sandbox_id: str) -> int:
    """The sandbox's CPU time from the host's own cgroup accounting."""
    subtree = leakcheck.subtree_for(gateway.data_dir)
    v1 = leakcheck.CGROUP_ROOT / "cpuacct" / subtree / sandbox_id / "cpuacct.usage"
    if v1.exists():
        return int(v1.read_text())
    stat = (leakcheck.CGROUP_ROOT / subtree / sandbox_id / "cpu.stat").read_text()
    return int(dict(line.split() for line in stat.splitlines())["usage_usec"]) * 1000


def discard(source, children) -> None:
    """Kills a test's sandboxes and deletes the snapshots taken of the source."""
    for child in children:
        child.kill()
    source.kill()
    for s in Sandbox.list_snapshots(sandbox_id=source.sandbox_id).next_items():
        Sandbox.delete_snapshot(s.snapshot_id)


def state(sandbox_id: str) -> str:
    return Sandbox.get_info(sandbox_id).state


@pytest.mark.timeout(120, func_only=True)
def test_pause_freezes_processes_and_connect_resumes_them_in_place(gateway):
    sbx = Sandbox.create(timeout=120)
    try:
        sbx.files.write("/home/user/note", "kept")
        counter = sbx.commands.run(COUNTER, background=True, timeout=0)
        counter.disconnect()
        time.sleep(0.5)
        assert sbx.pause() is True
        assert state(sbx.sandbox_id) == "paused"
        # Paused means no CPU at all and a stopped clock for the counter.
        used = cpu_ns(gateway, sbx.sandbox_id)
        time.sleep(1.0)
        assert cpu_ns(gateway, sbx.sandbox_id) == used
        assert sbx.pause() is False, "pausing twice is E2B's 409, reported as False"

        resumed = Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert state(sbx.sandbox_id) == "running"
        first = int(resumed.commands.run("cat /tmp/count").stdout)
        # The loop ran ~0.5 s (≈10 ticks) before the pause and 1 s passed
        # while paused: a counter that kept going would be past 25.
        assert first < 25, first
        time.sleep(0.3)
        assert int(resumed.commands.run("cat /tmp/count").stdout) > first
        assert counter.pid in {p.pid for p in resumed.commands.list()}
        assert resumed.files.read("/home/user/note") == "kept"
    finally:
        sbx.kill()


@pytest.mark.timeout(120, func_only=True)
def test_pause_without_memory_keeps_files_and_restarts_processes(gateway):
    sbx = Sandbox.create(timeout=120)
    try:
        sbx.files.write("/home/user/note", "files only")
        sleeper = sbx.commands.run("sleep 4321", background=True, timeout=0)
        sleeper.disconnect()
        assert sbx.pause(mode="filesystem") is True
        assert state(sbx.sandbox_id) == "paused"
        # Nothing of it runs: no cgroup, no processes.
        assert not any(sid == sbx.sandbox_id for (_, sid) in leakcheck.cgroup_dirs())

        again = Sandbox.connect(sbx.sandbox_id)
        assert again.files.read("/home/user/note") == "files only"
        assert sleeper.pid not in {p.pid for p in again.commands.list()}
        assert again.commands.run("echo alive").stdout == "alive\n"
    finally:
        sbx.kill()


@pytest.mark.timeout(120, func_only=True)
def test_timeout_pauses_and_traffic_resumes_when_asked(gateway):
    sbx = Sandbox.create(timeout=2, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        sbx.files.write("/home/user/state", "before timeout")
        deadline = time.monotonic() + 15
        while state(sbx.sandbox_id) != "paused":
            assert time.monotonic() < deadline, "the sandbox did not auto-pause"
            time.sleep(0.2)
        assert Sandbox.get_info(sbx.sandbox_id).lifecycle["auto_resume"] is True
        # Traffic to it (the SDK's data plane) resumes it.
        assert sbx.files.read("/home/user/state") == "before timeout"
        assert state(sbx.sandbox_id) == "running"
        sbx.set_timeout(120)
    finally:
        sbx.kill()


@pytest.mark.timeout(120, func_only=True)
def test_paused_sandbox_without_auto_resume_refuses_traffic_until_connected(gateway):
    sbx = Sandbox.create(timeout=120)
    try:
        sbx.pause()
        with pytest.raises(Exception, match="paused"):
            sbx.commands.run("true")
        assert Sandbox.connect(sbx.sandbox_id).commands.run("echo ok").stdout == "ok\n"
    finally:
        sbx.kill()


def test_a_refusal_given_before_the_body_arrived_keeps_the_connection_usable(gateway):
    """A command for a paused sandbox is refused without reading its body
    (here sent 50 ms after the head). The gateway still reads that small
    body, so the connection stays good for the next call: left unread, the
    connection closed unannounced and a client's next call on it (the Python
    SDK's `Sandbox.connect` right after such a refusal) met a broken pipe."""
    sbx = Sandbox.create(timeout=120)
    try:
        sbx.pause()
        host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
        body = b'{"process": {"cmd": "/bin/true"}}'
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            for pause in (0.05, 0.0):
                conn.putrequest("POST", "/process.Process/Start")
                for name, value in (
                    ("E2b-Sandbox-Id", sbx.sandbox_id),
                    ("Content-Type", "application/json"),
                    ("Content-Length", str(len(body))),
                ):
                    conn.putheader(name, value)
                conn.endheaders()
                time.sleep(pause)
                conn.send(body)
                answer = conn.getresponse()
                assert answer.status == 409 and b"paused" in answer.read()
                assert not answer.will_close, answer.getheaders()
                if pause:
                    first = conn.sock
            assert conn.sock is first, "the second call went out on the same connection"
        finally:
            conn.close()
    finally:
        sbx.kill()


@pytest.mark.timeout(240, func_only=True)
def test_filesystem_snapshot_boots_new_sandboxes_and_survives_a_restart(gateway):
    sbx = Sandbox.create(timeout=240)
    children = []
    try:
        sbx.files.write("/home/user/data.txt", "from the snapshot")
        sbx.commands.run("rm /etc/debian_version && mkdir -p /opt/made && echo x > /opt/made/file", user="root")
        sleeper = sbx.commands.run("sleep 4321", background=True, timeout=0)
        sleeper.disconnect()
        snap = sbx.create_snapshot(mode="filesystem")
        assert snap.snapshot_id in [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()]
        # The source is untouched: still running, its process still there.
        assert sleeper.pid in {p.pid for p in sbx.commands.list()}

        stop_gateway(gateway)
        gateway.start()

        child = Sandbox.create(template=snap.snapshot_id, timeout=120)
        children.append(child)
        assert child.sandbox_id != sbx.sandbox_id
        assert child.files.read("/home/user/data.txt") == "from the snapshot"
        assert child.commands.run("cat /opt/made/file").stdout == "x\n"
        # A deletion is part of the snapshot too (a whiteout in its layer).
        assert child.commands.run("test ! -e /etc/debian_version").exit_code == 0
        assert not [p for p in child.commands.list() if "sleep" in p.cmd], "processes start fresh"
        # The child's writes are its own.
        child.files.write("/home/user/data.txt", "changed in child")
        assert Sandbox.create(template=snap.snapshot_id, timeout=60).files.read("/home/user/data.txt") == (
            "from the snapshot"
        )
    finally:
        discard(sbx, children)


@pytest.mark.timeout(240, func_only=True)
def test_full_snapshot_carries_running_processes_into_new_sandboxes(gateway):
    sbx = Sandbox.create(timeout=240)
    children = []
    try:
        sbx.files.write("/home/user/data.txt", "with memory")
        counter = sbx.commands.run(COUNTER, background=True, timeout=0)
        counter.disconnect()
        time.sleep(0.5)
        snap = sbx.create_snapshot()  # E2B's default mode: full
        # The source runs on, untouched.
        assert counter.pid in {p.pid for p in sbx.commands.list()}
        at_snapshot = int(sbx.commands.run("cat /tmp/count").stdout)
        time.sleep(0.2)
        assert int(sbx.commands.run("cat /tmp/count").stdout) > at_snapshot

        stop_gateway(gateway)  # the snapshot is durable; the source stops here
        gateway.start()

        child = Sandbox.create(template=snap.snapshot_id, timeout=120)
        children.append(child)
        # The counter runs on in the child: the same process, carried over.
        assert counter.pid in {p.pid for p in child.commands.list()}
        first = int(child.commands.run("cat /tmp/count").stdout)
        time.sleep(0.3)
        assert int(child.commands.run("cat /tmp/count").stdout) > first
        assert child.files.read("/home/user/data.txt") == "with memory"
        # Its identity is its own.
        assert child.commands.run("hostname").stdout.strip() == child.sandbox_id
        child.files.write("/home/user/data.txt", "child's")
        second = Sandbox.create(template=snap.snapshot_id, timeout=60)
        children.append(second)
        assert second.files.read("/home/user/data.txt") == "with memory"
    finally:
        discard(sbx, children)


HOLDER = (pathlib.Path(__file__).parent / "memory_holder.py").read_text()


def start_holder(sbx: Sandbox, mb: int) -> str:
    """Starts tests/memory_holder.py holding `mb` MiB in `sbx`; the digest
    of what it holds."""
    sbx.files.write("/tmp/memory_holder.py", HOLDER)
    sbx.commands.run(f"python3 /tmp/memory_holder.py {mb}", background=True, timeout=0).disconnect()
    deadline = time.monotonic() + 60
    while not sbx.files.exists("/tmp/holder.answer"):
        assert time.monotonic() < deadline, "the holder filled its memory"
        time.sleep(0.2)
    return sbx.files.read("/tmp/holder.answer")


def holders_digest(sbx: Sandbox) -> str:
    """Has the holder in `sbx` hash what it holds now."""
    out = sbx.commands.run("rm -f /tmp/holder.answer; touch /tmp/holder.ask; "
                           "for i in $(seq 600); do [ -f /tmp/holder.answer ] && break; sleep 0.05; done; "
                           "cat /tmp/holder.answer", timeout=60)
    return out.stdout.strip()


def pagers(sandbox_id: str) -> list[int]:
    """The `criu lazy-pages` serving sandbox `sandbox_id`'s restore."""
    found = []
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"lazy-pages" in args and any(a.endswith(f"sandboxes/{sandbox_id}/restore".encode()) for a in args):
            found.append(int(cmdline.parent.name))
    return found


def processes_end(sandbox_id: str, within_s: float):
    """Waits until the sandbox's cgroup holds no process any more."""
    cgroup = next(pathlib.Path("/sys/fs/cgroup/pids").glob(f"copse-*/{sandbox_id}"))
    deadline = time.monotonic() + within_s
    while (cgroup / "cgroup.procs").exists() and (cgroup / "cgroup.procs").read_text().split():
        assert time.monotonic() < deadline, "the sandbox's processes are killed"
        time.sleep(0.1)


@pytest.mark.timeout(300, func_only=True)
def test_a_large_memory_restores_lazily_with_every_byte_it_had(gateway):
    """A process holding 160 MiB of random bytes (above the 128 MiB from
    which a restore is lazy): a sandbox restored from a full snapshot of it
    is served by a pager, and holds the same bytes; so do a snapshot of
    that sandbox taken at once (the dump waits for the copy to end), the
    sandbox after a pause and resume, and a sandbox from that second
    snapshot."""
    sbx = Sandbox.create(timeout=300)
    children = []
    try:
        digest = start_holder(sbx, 160)
        snap = sbx.create_snapshot(mode="full")
        child = Sandbox.create(template=snap.snapshot_id, timeout=120)
        children.append(child)
        assert (gateway.data_dir / "sandboxes" / child.sandbox_id / "restore" / "lazy-pages.pid").exists(), \
            "the child's memory was restored lazily"
        again = child.create_snapshot(mode="full")
        assert holders_digest(child) == digest
        child.pause()
        child = Sandbox.connect(child.sandbox_id, timeout=120)
        assert holders_digest(child) == digest
        grandchild = Sandbox.create(template=again.snapshot_id, timeout=120)
        children.append(grandchild)
        assert holders_digest(grandchild) == digest
        assert grandchild.commands.run("echo started").stdout.strip() == "started"
    finally:
        discard(sbx, children)
        for c in children[:1]:
            for s in Sandbox.list_snapshots(sandbox_id=c.sandbox_id).next_items():
                Sandbox.delete_snapshot(s.snapshot_id)


@pytest.mark.timeout(300, func_only=True)
def test_a_lazily_restored_sandbox_whose_pager_dies_mid_copy_is_killed(gateway):
    """The pager of a sandbox restored from 384 MiB is killed right after
    the create, before it could copy everything: the sandbox's processes
    are killed rather than left to run on memory they never got back, and
    the gateway's log says why."""
    sbx = Sandbox.create(timeout=300)
    try:
        start_holder(sbx, 384)
        snap = sbx.create_snapshot(mode="full")
        sbx.kill()
        child = Sandbox.create(template=snap.snapshot_id, timeout=120)
        try:
            [pager] = pagers(child.sandbox_id)
            os.kill(pager, 9)
            processes_end(child.sandbox_id, within_s=10)
            assert b"copying a restored sandbox's memory failed" in (gateway.data_dir / "gateway.log").read_bytes()
        finally:
            child.kill()
    finally:
        sbx.kill()
        Sandbox.delete_snapshot(snap.snapshot_id)


@pytest.mark.timeout(300, func_only=True)
def test_code_interpreter_state_carries_into_forks_full_snapshots_and_rollback(gateway):
    from e2b_code_interpreter import Sandbox as CodeSandbox

    sbx = CodeSandbox.create(timeout=300)
    forks = []
    try:
        assert sbx.run_code("x = 41 + 1").error is None
        forks = [f for f in sbx.fork(count=2, timeout=120) if isinstance(f, CodeSandbox)]
        assert len(forks) == 2
        for fork in forks:
            assert fork.run_code("x").text == "42"
        forks[0].run_code("x = 0")
        assert forks[1].run_code("x").text == "42"

        snap = sbx.create_snapshot(mode="full")
        assert sbx.run_code("x = 7").error is None
        child = CodeSandbox.create(template=snap.snapshot_id, timeout=120)
        forks.append(child)
        assert child.run_code("x").text == "42"

        status, body = api(gateway, "POST", f"/copse/sandboxes/{sbx.sandbox_id}/rollback", {"snapshotID": snap.snapshot_id})
        assert status == 200, body
        assert sbx.run_code("x").text == "42"
    finally:
        discard(sbx, forks)


@pytest.mark.timeout(240, func_only=True)
def test_fork_gives_independent_children_and_leaves_the_source_running(gateway):
    source = Sandbox.create(timeout=240, metadata={"role": "source"})
    children = []
    try:
        source.files.write("/home/user/shared", "from source")
        results = source.fork(count=3, timeout=60)
        assert len(results) == 3
        children = [c for c in results if isinstance(c, Sandbox)]
        assert len(children) == 3, results
        ids = {c.sandbox_id for c in children}
        assert len(ids) == 3 and source.sandbox_id not in ids
        hostnames = {c.commands.run("hostname").stdout.strip() for c in children}
        assert len(hostnames) == 3
        for child in children:
            assert child.files.read("/home/user/shared") == "from source"
            assert Sandbox.get_info(child.sandbox_id).metadata == {"role": "source"}
        children[0].files.write("/home/user/shared", "child 0 only")
        assert children[1].files.read("/home/user/shared") == "from source"
        assert source.files.read("/home/user/shared") == "from source"
        assert state(source.sandbox_id) == "running"
        # E2B's bounds: 1 to 20.
        status, body = api(gateway, "POST", f"/sandboxes/{source.sandbox_id}/fork", {"count": 21})
        assert status == 400 and "count" in body["message"]
    finally:
        for child in children:
            child.kill()
        source.kill()


@pytest.mark.timeout(180, func_only=True)
def test_rollback_puts_a_snapshots_files_back_under_the_same_id(gateway):
    sbx = Sandbox.create(timeout=180)
    try:
        sbx.files.write("/home/user/doc", "version 1")
        snap = sbx.create_snapshot(name="rollback-v1")
        sbx.files.write("/home/user/doc", "version 2")
        sbx.files.write("/home/user/extra", "made after")

        status, body = api(gateway, "POST", f"/copse/sandboxes/{sbx.sandbox_id}/rollback", {"snapshotID": snap.snapshot_id})
        assert status == 200, body
        assert body["sandboxID"] == sbx.sandbox_id
        assert sbx.files.read("/home/user/doc") == "version 1"
        assert sbx.commands.run("test ! -e /home/user/extra").exit_code == 0

        status, body = api(gateway, "POST", f"/copse/sandboxes/{sbx.sandbox_id}/rollback", {"snapshotID": "nope"})
        assert status == 404 and "nope" in body["message"]
    finally:
        sbx.kill()
        Sandbox.delete_snapshot("rollback-v1")


@pytest.mark.timeout(120, func_only=True)
def test_deleted_snapshots_are_gone_and_unknown_ids_get_clear_errors(gateway):
    sbx = Sandbox.create(timeout=120)
    try:
        snap = sbx.create_snapshot(name="to-delete")
        assert snap.snapshot_id == "to-delete"
        assert Sandbox.delete_snapshot("to-delete") is True
        assert Sandbox.delete_snapshot("to-delete") is False
        assert "to-delete" not in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
        with pytest.raises(Exception, match="to-delete"):
            Sandbox.create(template="to-delete")

        # A sandbox paused without memory has no processes to keep.
        paused = Sandbox.create(timeout=60)
        paused.pause(mode="filesystem")
        status, body = api(gateway, "POST", f"/sandboxes/{paused.sandbox_id}/snapshots", {"memory": True})
        assert status == 409 and "resume" in body["message"]
        paused.kill()

        with pytest.raises(SandboxNotFoundException):
            Sandbox.pause("no-such-sandbox")
        with pytest.raises(SandboxNotFoundException):
            Sandbox.connect("no-such-sandbox")
        status, body = api(gateway, "POST", "/sandboxes/no-such-sandbox/snapshots", {})
        assert status == 404 and body["code"] == 404
        status, body = api(gateway, "POST", "/sandboxes/no-such-sandbox/fork", {"count": 1})
        assert status == 404
    finally:
        sbx.kill()


@pytest.mark.timeout(240, func_only=True)
def test_snapshot_exports_to_a_file_and_imports_as_another(gateway, tmp_path):
    sbx = Sandbox.create(timeout=120)
    try:
        sbx.files.write("/home/user/portable", "moves between hosts")
        sbx.create_snapshot(name="export-me")
    finally:
        sbx.kill()
    export = tmp_path / "snap.copse"
    data_dir = ["--data-dir", str(gateway.data_dir)]
    subprocess.run([str(COPSE), "snapshot", "export", "export-me", str(export), *data_dir], check=True)
    Sandbox.delete_snapshot("export-me")
    subprocess.run([str(COPSE), "snapshot", "import", str(export), "--name", "imported", *data_dir], check=True)
    bad = subprocess.run(
        [str(COPSE), "snapshot", "import", str(export), "--name", "imported", *data_dir], capture_output=True, text=True
    )
    assert bad.returncode != 0 and "exists already" in bad.stderr
    try:
        child = Sandbox.create(template="imported", timeout=60)
        assert child.files.read("/home/user/portable") == "moves between hosts"
        child.kill()
    finally:
        Sandbox.delete_snapshot("imported")


@pytest.mark.timeout(300, func_only=True)
def test_code_interpreter_variables_survive_pause_and_paused_sandboxes_survive_a_restart(gateway):
    from e2b_code_interpreter import Sandbox as CodeSandbox

    sbx = CodeSandbox.create(timeout=300)
    try:
        assert sbx.run_code("x = 41 + 1").error is None
        sbx.pause()
        stop_gateway(gateway)  # a graceful stop keeps paused sandboxes
        gateway.start()
        assert state(sbx.sandbox_id) == "paused"
        again = CodeSandbox.connect(sbx.sandbox_id)
        assert again.run_code("x").text == "42"
    finally:
        sbx.kill()


@pytest.mark.timeout(120, func_only=True)
def test_lifecycle_leaves_nothing_behind(gateway):
    before = leakcheck.baseline(gateway.data_dir)
    sbx = Sandbox.create(timeout=60)
    snap = sbx.create_snapshot()
    forks = [c for c in sbx.fork(count=2) if isinstance(c, Sandbox)]
    sbx.pause(mode="filesystem")
    frozen = Sandbox.create(timeout=60)
    frozen.commands.run("sleep 4321", background=True, timeout=0).disconnect()
    frozen.pause()
    for child in forks:
        child.kill()
    sbx.kill()
    frozen.kill()  # a frozen sandbox's processes die without being resumed first
    Sandbox.delete_snapshot(snap.snapshot_id)
    leakcheck.assert_no_leaks(gateway.data_dir, live_ids(), before, gateway.proc.pid)
    assert leakcheck.unnamed_layers(gateway.data_dir) == []


def test_criu_finds_its_kernel_feature_cache_where_run_is_no_tmpfs(gateway):
    """CRIU probes the kernel at every run unless /run/criu.kdat holds the
    answers, and keeps that file only where /run is a tmpfs. Elsewhere copse
    writes it, marked with the boot it belongs to; CRIU loads it."""
    sbx = Sandbox.create(timeout=120)
    try:
        snap = sbx.create_snapshot(mode="full")  # the gateway has found its CRIU by now
    finally:
        sbx.kill()
    Sandbox.delete_snapshot(snap.snapshot_id)
    cache = pathlib.Path("/run/criu.kdat")
    assert cache.is_file() and cache.stat().st_size > 0
    run_mounts = [line.split()[2] for line in open("/proc/mounts") if line.split()[1] == "/run"]
    if run_mounts[-1:] != ["tmpfs"]:
        boot = pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        assert pathlib.Path("/run/criu.kdat.copse-boot").read_text().strip() == boot
    log = pathlib.Path(tempfile.mkdtemp()) / "check.log"
    criu = shutil.which("criu") or "/usr/local/sbin/criu"
    subprocess.run([criu, "check", "-v4", "-o", str(log)], capture_output=True)
    assert "Loaded kdat cache from /run/criu.kdat" in log.read_text()


@pytest.mark.timeout(240, func_only=True)
def test_a_host_without_criu_says_so_and_refuses_only_what_needs_memory(gateway, tmp_path):
    """A gateway whose CRIU is missing logs one line naming it and how to
    install it, answers requests that need memory with E2B's 503 naming the
    cause (never a CRIU log), and serves everything else."""
    from conftest import Gateway

    # A memory snapshot taken where CRIU works, carried to the CRIU-less host.
    sbx = Sandbox.create(timeout=120)
    try:
        sbx.files.write("/home/user/note", "from a host with CRIU")
        sbx.create_snapshot(name="needs-criu", mode="full")
    finally:
        sbx.kill()
    export = tmp_path / "needs-criu.copse"
    subprocess.run([str(COPSE), "snapshot", "export", "needs-criu", str(export), "--data-dir", str(gateway.data_dir)],
                   check=True)
    Sandbox.delete_snapshot("needs-criu")

    data_dir = second_data_dir("no-criu")
    subprocess.run([str(COPSE), "snapshot", "import", str(export), "--name", "needs-criu", "--data-dir", str(data_dir)],
                   check=True)
    missing = "/nonexistent/criu"
    os.environ["COPSE_CRIU"] = missing
    bridge = "copsenc"
    other = Gateway(data_dir)
    try:
        other.start(extra_args=["--bridge", bridge, "--subnet", "10.91.0.0/16"])
    finally:
        del os.environ["COPSE_CRIU"]
    api_key = os.environ["E2B_API_KEY"]
    env = dict(api_key=api_key, api_url=other.url, sandbox_url=other.url)
    try:
        log = (data_dir / "gateway.log").read_text()
        lines = [line for line in log.splitlines() if "memory snapshots are unavailable" in line]
        assert lines and missing in lines[-1] and "scripts/criu" in lines[-1], log[-2000:]

        local = Sandbox.create(timeout=60, **env)
        try:
            local.files.write("/home/user/note", "files only")
            for path, body in ((f"/sandboxes/{local.sandbox_id}/snapshots", {"memory": True}),
                               (f"/sandboxes/{local.sandbox_id}/fork", {"count": 1, "memory": True})):
                status, error = api(other, "POST", path, body)
                assert status == 503, (path, status, error)
                assert error["code"] == 503 and missing in error["message"] and "scripts/criu" in error["message"]
                assert "Error (criu" not in error["message"]
            # Without a mode, E2B's default falls back to the files.
            snap = local.create_snapshot()
            child = Sandbox.create(template=snap.snapshot_id, timeout=60, **env)
            assert child.files.read("/home/user/note") == "files only"
            child.kill()
            Sandbox.delete_snapshot(snap.snapshot_id, **env)
        finally:
            local.kill()

        status, error = api(other, "POST", "/v2/sandboxes", {"templateID": "needs-criu", "timeout": 60})
        assert status == 503, (status, error)
        assert missing in error["message"] and "Error (criu" not in error["message"]
        assert Sandbox.list(**env).next_items() == [], "a refused create leaves no sandbox"
    finally:
        other.stop()
        subprocess.run(["nft", "delete", "table", "inet", f"copse_{bridge}"], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
