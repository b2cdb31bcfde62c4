"""Nothing of a sandbox outlives it: not after many create/exec/kill cycles,
and not after the gateway is killed with SIGKILL and started again."""

import os
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


def _list(query):
    paginator = Sandbox.list(query=query)
    items = []
    while paginator.has_next:
        items.extend(paginator.next_items())
    return items
