"""Warm pools: a code-interpreter sandbox is handed out already booted, with
its Python kernel started, and the pool refills and drains cleanly."""

import contextlib
import json
import os
import time
import urllib.request

import pytest

import leakcheck
from test_code_interpreter import server_ready_at
from test_leaks import live_ids


def resident_ids(gateway) -> set[str]:
    return {p.name for p in (gateway.data_dir / "sandboxes").iterdir()}


def pooled_ids(gateway) -> set[str]:
    return resident_ids(gateway) - live_ids()


def pools(gateway) -> list[dict]:
    request = urllib.request.Request(f"{gateway.url}/copse/pools", headers={"X-API-KEY": os.environ["E2B_API_KEY"]})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def wait_for_pool(gateway, size: int, seconds: float = 90) -> set[str]:
    """Waits until the pool holds `size` ready sandboxes; returns their ids."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if [p["ready"] for p in pools(gateway)] == [size]:
            pooled = pooled_ids(gateway)
            assert len(pooled) == size, pooled
            return pooled
        time.sleep(0.2)
    raise AssertionError(f"pool did not reach {size} within {seconds} s: {pools(gateway)}")


@contextlib.contextmanager
def restarted_with_pools(gateway, pools: str):
    """Runs the gateway with `pools` for the block; on the way out, a stop
    must drain every pooled sandbox without a trace."""
    before = leakcheck.baseline(gateway.data_dir)
    gateway.stop()
    gateway.start(pools=pools)
    try:
        yield
    finally:
        gateway.stop()
        # The suite's gateway comes back even when the check fails, so one
        # leak fails one test, not every test after it.
        try:
            leakcheck.assert_no_leaks(gateway.data_dir, set(), before)
        finally:
            gateway.start()


@pytest.mark.timeout(400, func_only=True)
def test_code_interpreter_sandboxes_come_from_the_pool_with_a_warm_kernel(gateway):
    from e2b_code_interpreter import Sandbox as CodeSandbox

    with restarted_with_pools(gateway, "code-interpreter-v1=1"):
        pooled = wait_for_pool(gateway, 1)
        # A pooled sandbox is on the host but belongs to no one yet.
        assert not pooled & live_ids()

        asked_at = time.time()
        sbx = CodeSandbox.create(timeout=120)
        try:
            assert sbx.sandbox_id in pooled
            # The kernel was ready before anyone asked for the sandbox (its
            # process may be younger: a pool refill restores the template's
            # warm memory snapshot where the host has them).
            assert server_ready_at(sbx) < asked_at
            assert sbx.run_code("1+1").text == "2"
        finally:
            sbx.kill()

        # Handing one out makes the pool boot a replacement.
        refilled = wait_for_pool(gateway, 1)
        assert sbx.sandbox_id not in refilled


@pytest.mark.timeout(400, func_only=True)
def test_an_air_gapped_caller_never_gets_a_kernel_that_started_with_open_egress(gateway):
    """A pooled code-interpreter sandbox started its kernel under open
    egress (what an empty create asks for). A caller asking for less gets a
    sandbox booted under their policy, its kernel started after the policy
    was in place; the pooled one waits for a caller it suits."""
    from e2b_code_interpreter import Sandbox as CodeSandbox

    with restarted_with_pools(gateway, "code-interpreter-v1=1"):
        pooled = wait_for_pool(gateway, 1)

        asked_at = time.time()
        sbx = CodeSandbox.create(timeout=120, allow_internet_access=False)
        try:
            assert sbx.sandbox_id not in pooled
            assert not sbx.get_info().allow_internet_access
            # The kernel process started after the caller asked: its age from
            # its start time in /proc (clock ticks since boot; /proc/<pid>'s
            # ctime would only say when the inode was first looked at).
            kernel_age = sbx.run_code(
                "import os\n"
                "start = int(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19]) / os.sysconf('SC_CLK_TCK')\n"
                "float(open('/proc/uptime').read().split()[0]) - start"
            )
            assert kernel_age.error is None
            assert float(kernel_age.text) < time.time() - asked_at
            assert sbx.run_code("1+1").text == "2"
        finally:
            sbx.kill()

        assert wait_for_pool(gateway, 1) == pooled


@pytest.mark.timeout(300, func_only=True)
def test_stopping_while_the_pool_boots_leaves_nothing_behind(gateway):
    with restarted_with_pools(gateway, "code-interpreter-v1=2"):
        # Stop while the pool's first sandbox is still starting its kernel.
        deadline = time.monotonic() + 30
        while not resident_ids(gateway) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert resident_ids(gateway), "the pool never started booting"
