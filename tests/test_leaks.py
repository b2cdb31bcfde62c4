"""Nothing of a sandbox outlives it: not after many create/exec/kill cycles,
not after the gateway is killed with SIGKILL and started again, and not after
a graceful stop. Sandboxes the gateway should keep (crash, --keep-sandboxes)
are re-adopted and usable, or gone without a trace."""

import os
import signal
import sqlite3
import subprocess
import time
import uuid

import pytest
from e2b import Sandbox, SandboxNotFoundException, SandboxQuery

import leakcheck

CYCLES = 200


def live_ids() -> set[str]:
    paginator = Sandbox.list()
    ids = set()
    while paginator.has_next:
        ids |= {s.sandbox_id for s in paginator.next_items()}
    return ids


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.timeout(600, func_only=True)
def test_many_create_exec_kill_cycles_leave_nothing_behind(gateway):
    before = leakcheck.baseline(gateway.data_dir)
    fds_before = open_fds(gateway.proc.pid)
    ids = []
    start = time.monotonic()
    for i in range(CYCLES):
        sbx = Sandbox.create(timeout=60, metadata={"leak-cycle": str(i)})
        ids.append(sbx.sandbox_id)
        try:
            assert sbx.commands.run(f"echo {i}").stdout == f"{i}\n"
        finally:
            assert sbx.kill() is True
    elapsed = time.monotonic() - start
    print(f"{CYCLES} create/exec/kill cycles in {elapsed:.1f}s ({elapsed / CYCLES * 1000:.0f} ms each)")

    assert len(set(ids)) == CYCLES
    live = live_ids()
    assert not live & set(ids), f"killed sandboxes still listed: {sorted(live & set(ids))}"
    leakcheck.assert_no_leaks(gateway.data_dir, live, before, gateway.proc.pid)
    # The gateway itself does not accumulate descriptors per sandbox.
    fds_after = open_fds(gateway.proc.pid)
    assert fds_after <= fds_before + 20, f"gateway fds grew from {fds_before} to {fds_after} over {CYCLES} cycles"


@pytest.mark.timeout(300, func_only=True)
def test_sandboxes_survive_or_vanish_cleanly_when_the_gateway_is_killed(gateway):
    before = leakcheck.baseline(gateway.data_dir)
    tag = uuid.uuid4().hex
    sandboxes = [Sandbox.create(timeout=300, metadata={"crash": tag}) for _ in range(3)]
    ids = [s.sandbox_id for s in sandboxes]
    for s in sandboxes:
        s.files.write("/home/user/marker", s.sandbox_id)
    # One of them has a long-running process, which adoption must keep.
    sleeper = sandboxes[0].commands.run("sleep 4321", background=True, timeout=0)

    gateway.crash()
    gateway.start()

    adopted, cleaned, broken = [], [], {}
    for sid in ids:
        try:
            again = Sandbox.connect(sid)
        except SandboxNotFoundException:
            cleaned.append(sid)
            continue
        try:
            assert again.commands.run("cat /home/user/marker").stdout == sid
            assert again.files.read("/home/user/marker") == sid
            if sid == ids[0]:
                assert sleeper.pid in {p.pid for p in again.commands.list()}
            adopted.append(sid)
        except Exception as e:  # noqa: BLE001 - reported below
            broken[sid] = repr(e)
    print(f"after kill -9 and restart: adopted {adopted}, cleaned {cleaned}")

    try:
        assert not broken, f"sandboxes still known but unusable after restart: {broken}"
        listed = live_ids()
        assert set(adopted) <= listed, "adopted sandboxes missing from the list"
        assert not set(cleaned) & listed, "cleaned sandboxes still listed"
        crash_listed = {s.sandbox_id for s in _list(SandboxQuery(metadata={"crash": tag}))}
        assert crash_listed == set(adopted)
        # The cleaned ones are gone completely, right now.
        leakcheck.assert_no_leaks(gateway.data_dir, listed, before, gateway.proc.pid)
    finally:
        killed = {sid: Sandbox.kill(sid) for sid in ids}

    assert all(killed[sid] is True for sid in adopted), f"kill after adoption: {killed}"
    assert all(killed[sid] is False for sid in cleaned), f"kill of cleaned sandboxes: {killed}"
    leakcheck.assert_no_leaks(gateway.data_dir, live_ids(), before, gateway.proc.pid)


@pytest.mark.timeout(300, func_only=True)
def test_sandbox_that_expires_while_the_gateway_is_down_is_cleaned_on_restart(gateway):
    before = leakcheck.baseline(gateway.data_dir)
    sbx = Sandbox.create(timeout=3)
    assert sbx.commands.run("echo up").stdout == "up\n"
    gateway.crash()
    try:
        time.sleep(4)
    finally:
        gateway.start()
    deadline = time.monotonic() + 10
    while sbx.sandbox_id in live_ids():
        assert time.monotonic() < deadline, "sandbox that expired during the outage still listed 10 s after restart"
        time.sleep(0.25)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(sbx.sandbox_id)
    leakcheck.assert_no_leaks(gateway.data_dir, live_ids(), before, gateway.proc.pid)


def stop_gateway(gateway, within: float = 15) -> None:
    """SIGTERM, as a user's Ctrl-C or service manager does; a gateway that
    has not exited `within` seconds is killed and the test fails."""
    gateway.proc.send_signal(signal.SIGTERM)
    try:
        gateway.proc.wait(timeout=within)
    except subprocess.TimeoutExpired:
        gateway.crash()
        pytest.fail(f"copse up did not exit within {within:.0f} s of SIGTERM")


@pytest.mark.timeout(300, func_only=True)
def test_stopping_the_gateway_ends_its_sandboxes_and_leaves_nothing(gateway):
    before = leakcheck.baseline(gateway.data_dir)
    ids = [Sandbox.create(timeout=300).sandbox_id for _ in range(2)]
    try:
        stop_gateway(gateway)
        # No live sandboxes once `copse up` has exited on SIGTERM.
        leakcheck.assert_no_leaks(gateway.data_dir, set(), before)
    finally:
        gateway.start()
    for sid in ids:
        with pytest.raises(SandboxNotFoundException):
            Sandbox.connect(sid)
    assert not set(ids) & live_ids()


@pytest.mark.timeout(300, func_only=True)
def test_stopping_the_gateway_does_not_wait_for_attached_command_streams(gateway):
    sbx = Sandbox.create(timeout=300)
    # The SDK keeps the command's event stream open while the handle lives.
    attached = sbx.commands.run("sleep 4321", background=True, timeout=0)
    try:
        stop_gateway(gateway)
    finally:
        if gateway.proc.poll() is not None:
            gateway.start()
        attached.disconnect()
        Sandbox.kill(sbx.sandbox_id)


@pytest.mark.timeout(300, func_only=True)
def test_sandboxes_kept_across_a_graceful_restart_are_usable_again(gateway):
    before = leakcheck.baseline(gateway.data_dir)
    stop_gateway(gateway)
    gateway.start(keep_sandboxes=True)
    sbx = None
    try:
        sbx = Sandbox.create(timeout=300)
        sbx.files.write("/home/user/kept", "still here")
        sleeper = sbx.commands.run("sleep 4321", background=True, timeout=0)
        sleeper.disconnect()  # no stream attached while the gateway stops
        stop_gateway(gateway)  # --keep-sandboxes: they outlive this run
        gateway.start()
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.commands.run("cat /home/user/kept").stdout == "still here"
        assert sleeper.pid in {p.pid for p in again.commands.list()}
    finally:
        if gateway.proc.poll() is not None:
            gateway.start()
        if sbx is not None:
            assert sbx.kill() is True
    leakcheck.assert_no_leaks(gateway.data_dir, live_ids(), before, gateway.proc.pid)


def _list(query):
    paginator = Sandbox.list(query=query)
    items = []
    while paginator.has_next:
        items.extend(paginator.next_items())
    return items


@pytest.mark.timeout(120, func_only=True)
def test_an_unreadable_record_is_quarantined_and_never_stops_a_start(gateway):
    database = gateway.data_dir / "copse.db"
    stop_gateway(gateway)
    bad_id = "unreadable" + uuid.uuid4().hex[:10]
    with sqlite3.connect(database) as db:
        db.execute(
            "INSERT INTO sandboxes (id, end_at_ms, record) VALUES (?, 0, ?)",
            (bad_id, '{"id": "torn'),
        )
    gateway.start()
    sbx = Sandbox.create(timeout=60)
    try:
        assert bad_id not in {s.sandbox_id for s in _list(None)}
    finally:
        sbx.kill()
    with sqlite3.connect(database) as db:
        kept = db.execute("SELECT kind, record FROM quarantine WHERE id = ?", (bad_id,)).fetchall()
        left = db.execute("SELECT count(*) FROM sandboxes WHERE id = ?", (bad_id,)).fetchone()[0]
    assert kept == [("sandboxes", '{"id": "torn')]
    assert left == 0
    log = (gateway.data_dir / "gateway.log").read_text(errors="replace")
    assert bad_id in log and "quarantine" in log
