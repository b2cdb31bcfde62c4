"""What an operator and a caller can observe: `/metrics` on the operator
listener (parsed with the Prometheus project's own parser, values checked
against known actions), the gateway's JSON log lines, each sandbox's own
log through E2B's logs routes (durable across a restart), and metrics as a
series and for many sandboxes at once, all through the official SDK.

Every test here talks to a gateway of its own (fresh data dir, its own
bridge), so no other test's sandboxes move its counters."""

import ipaddress
import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from e2b import Sandbox
from e2b.api import ApiClient
from e2b.api.client.api.sandboxes import (
    get_sandboxes_metrics,
    get_sandboxes_sandbox_id_logs,
    get_v_2_sandboxes_sandbox_id_logs,
)
from e2b.api.client.models import LogLevel, LogsDirection
from e2b.connection_config import ConnectionConfig
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from conftest import API_KEY, BRIDGE, SUBNET, Gateway, free_port, second_data_dir


@pytest.fixture(scope="module")
def observed(gateway):
    """A gateway with the operator listener and JSON logs."""
    data_dir = second_data_dir("obs")
    other = Gateway(data_dir)
    other.metrics_url = f"http://127.0.0.1:{free_port()}/metrics"
    second = ipaddress.ip_network(SUBNET).network_address.packed[1]
    other.bridge = f"{BRIDGE[:9]}m"
    other.args = ["--bridge", other.bridge, "--subnet", f"10.{(second + 110) % 256}.0.0/16",
                  "--metrics-listen", other.metrics_url.removeprefix("http://").removesuffix("/metrics"),
                  "--log-format", "json"]
    other.start(extra_args=other.args)
    other.env = dict(api_key=API_KEY, api_url=other.url, sandbox_url=other.url)
    yield other
    other.stop()
    subprocess.run(["nft", "delete", "table", "inet", f"copse_{other.bridge}"], capture_output=True)
    subprocess.run(["ip", "link", "del", other.bridge], capture_output=True)


def scrape(gw) -> dict:
    """Every sample of `/metrics`, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(gw.metrics_url, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("application/openmetrics-text")
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def api(gw, path: str, key: str | None = API_KEY) -> tuple[int, object]:
    headers = {"X-API-KEY": key} if key else {}
    request = urllib.request.Request(f"{gw.url}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def api_post(gw, path: str, body: dict) -> tuple[int, object]:
    request = urllib.request.Request(f"{gw.url}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"X-API-KEY": API_KEY, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def client(gw) -> ApiClient:
    return ApiClient(ConnectionConfig(**gw.env))


def test_metrics_move_by_exactly_what_was_done(observed):
    before = scrape(observed)
    a = Sandbox.create(template="base", timeout=120, **observed.env)
    b = Sandbox.create(template="base", timeout=120, **observed.env)
    b.kill()
    a.commands.run("true")
    a.commands.run("true")
    a.pause()
    Sandbox.connect(a.sandbox_id, **observed.env)
    after = scrape(observed)
    try:
        base_ok = dict(template="base", source="boot", outcome="ok")
        assert value(after, "copse_sandbox_creates_total", **base_ok) - value(
            before, "copse_sandbox_creates_total", **base_ok) == 2
        killed = dict(reason="request", outcome="ok")
        assert value(after, "copse_sandbox_kills_total", **killed) - value(
            before, "copse_sandbox_kills_total", **killed) == 1
        assert value(after, "copse_sandboxes", template="base", state="running") == 1
        assert value(after, "copse_sandboxes", template="base", state="paused") == 0
        assert value(after, "copse_sandbox_create_seconds_count", template="base") - value(
            before, "copse_sandbox_create_seconds_count", template="base") == 2
        # Two commands, one first exec.
        assert value(after, "copse_sandbox_first_exec_seconds_count", template="base") - value(
            before, "copse_sandbox_first_exec_seconds_count", template="base") == 1
        memory_ok = dict(kind="memory", outcome="ok")
        assert value(after, "copse_sandbox_pauses_total", **memory_ok) - value(
            before, "copse_sandbox_pauses_total", **memory_ok) == 1
        assert value(after, "copse_sandbox_resumes_total", outcome="ok") - value(
            before, "copse_sandbox_resumes_total", outcome="ok") == 1
        assert value(after, "copse_network_attaches_total", outcome="ok") - value(
            before, "copse_network_attaches_total", outcome="ok") == 2
        assert value(after, "copse_network_detaches_total", outcome="ok") - value(
            before, "copse_network_detaches_total", outcome="ok") == 1
        # No pool on this gateway: nothing waits, nothing was missed.
        assert value(after, "copse_pool_misses_total", template="base") == 0
        assert ("copse_reaper_queue", ()) in after
    finally:
        a.kill()
    assert value(scrape(observed), "copse_sandboxes", template="base", state="running") == 0


def test_checkpoints_and_restores_are_timed(observed):
    """A snapshot with memory is a CRIU dump; a sandbox made from it, a
    restore: each is counted in its histogram, with the snapshot and the
    create that used it."""
    before = scrape(observed)
    sbx = Sandbox.create(template="base", timeout=120, **observed.env)
    try:
        snap = sbx.create_snapshot()
        child = Sandbox.create(template=snap.snapshot_id, timeout=60, **observed.env)
        child.kill()
        Sandbox.delete_snapshot(snap.snapshot_id, **observed.env)
    finally:
        sbx.kill()
    after = scrape(observed)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("copse_snapshots_total", kind="memory", outcome="ok") == 1
    assert moved("copse_checkpoint_dump_seconds_count", outcome="ok") == 1
    assert moved("copse_checkpoint_restore_seconds_count", outcome="ok") == 1
    assert moved("copse_sandbox_creates_total", template="base", source="snapshot", outcome="ok") == 1
    assert moved("copse_sandbox_kills_total", reason="request", outcome="ok") == 2


def test_a_callers_template_name_never_becomes_a_label(observed):
    """Each label value is a series kept for the gateway's life: creates of
    made-up templates are counted under `unknown`, or a caller could grow
    `/metrics` (and the gateway's memory) without bound."""
    before = scrape(observed)
    for i in range(3):
        status, body = api_post(observed, "/v2/sandboxes", {"templateID": f"made-up-{i}-{time.time_ns()}"})
        assert status == 400 and body["code"] == 400, body
    after = scrape(observed)
    unknown = dict(template="unknown", source="boot", outcome="error")
    assert value(after, "copse_sandbox_creates_total", **unknown) - value(
        before, "copse_sandbox_creates_total", **unknown) == 3
    assert not [key for key in after if "made-up" in repr(key)]


def test_metrics_are_never_served_on_the_public_listener(observed):
    for key in (API_KEY, None):
        status, body = api(observed, "/metrics", key)
        assert status in (401, 404), status
        assert set(body) == {"code", "message"} and "copse_" not in json.dumps(body)
    # The operator listener serves nothing else.
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(observed.metrics_url.replace("/metrics", "/v2/sandboxes"), timeout=10)
    assert refused.value.code == 404


def json_lines(gw) -> list[dict]:
    """The gateway's JSON log lines (its stdout banner, in the same file,
    is plain text)."""
    lines = []
    for raw in (gw.data_dir / "gateway.log").read_text().splitlines():
        if raw.startswith("{"):
            lines.append(json.loads(raw))
    return lines


def span_fields(line: dict) -> dict:
    merged = {}
    for span in line.get("spans", []):
        merged.update(span)
    return merged


def test_json_log_lines_name_the_request_and_the_sandbox(observed):
    sbx = Sandbox.create(template="base", timeout=120, **observed.env)
    sbx.commands.run("true")
    sbx.kill()
    lines = json_lines(observed)
    assert lines, "no JSON log lines"
    for line in lines:
        assert {"timestamp", "level", "fields", "target"} <= set(line), line
    about = [line for line in lines if sbx.sandbox_id in json.dumps(line)]
    assert about, f"no line about {sbx.sandbox_id}"
    for line in about:
        ids = {line["fields"].get("sandbox_id"), span_fields(line).get("sandbox_id")}
        assert sbx.sandbox_id in ids, line
    created = [line for line in about if line["fields"].get("message") == "sandbox created (booted)"]
    assert len(created) == 1, about
    request_id = span_fields(created[0]).get("request_id", "")
    assert re.fullmatch(r"[0-9a-f]{16}", request_id), created[0]
    killed = [line for line in about if line["fields"].get("message") == "sandbox killed"]
    assert len(killed) == 1 and span_fields(killed[0]).get("request_id") not in (None, request_id), killed


def messages(entries) -> list[str]:
    return [e.message for e in entries]


def test_sandbox_logs_page_filter_and_survive_a_restart(observed):
    sbx = Sandbox.create(template="base", timeout=120, **observed.env)
    sbx.commands.run("true")
    sbx.files.write("/tmp/note", "x")
    sbx.kill()
    api_client = client(observed)

    def v2(**query):
        res = get_v_2_sandboxes_sandbox_id_logs.sync_detailed(sbx.sandbox_id, client=api_client, **query)
        assert res.status_code == 200, res.content
        return res.parsed.logs

    everything = v2()
    assert messages(everything)[0] == "sandbox created (booted)"
    assert "process started" in messages(everything)
    assert "file uploaded" in messages(everything)
    assert messages(everything)[-1] == "sandbox killed"
    assert [e.fields["path"] for e in everything if e.message == "file uploaded"] == ["/tmp/note"]
    stamps = [e.timestamp for e in everything]
    assert stamps == sorted(stamps)

    assert messages(v2(limit=2)) == messages(everything)[:2]
    assert messages(v2(direction=LogsDirection.BACKWARD, limit=1)) == ["sandbox killed"]
    assert messages(v2(search="process")) == ["process started"]
    assert all(e.level.value in ("warn", "error") for e in v2(level=LogLevel.WARN))
    # Forward from the last entry's millisecond: the entries from then on.
    last_ms = int(everything[-1].timestamp.timestamp() * 1000)
    assert messages(v2(cursor=last_ms))[-1] == "sandbox killed"
    assert len(v2(cursor=last_ms)) < len(everything)

    old = get_sandboxes_sandbox_id_logs.sync_detailed(sbx.sandbox_id, client=api_client)
    assert old.status_code == 200
    assert [e.message for e in old.parsed.log_entries] == messages(everything)
    assert old.parsed.logs[0].line.startswith("sandbox created (booted) ")

    observed.stop()
    observed.start(extra_args=observed.args)
    assert messages(v2()) == messages(everything), "logs are durable across a restart"

    missing = get_v_2_sandboxes_sandbox_id_logs.sync_detailed("nosuchsandbox0000000", client=api_client)
    assert missing.status_code == 404 and missing.parsed.code == 404


def test_bad_log_and_metrics_queries_get_e2b_errors(observed):
    sbx = Sandbox.create(template="base", timeout=60, **observed.env)
    try:
        for path in (f"/v2/sandboxes/{sbx.sandbox_id}/logs?direction=sideways",
                     f"/v2/sandboxes/{sbx.sandbox_id}/logs?level=loud",
                     f"/v2/sandboxes/{sbx.sandbox_id}/logs?limit=1001",
                     f"/v2/sandboxes/{sbx.sandbox_id}/logs?cursor=soon",
                     f"/v2/sandboxes/{sbx.sandbox_id}/logs?search={'x' * 257}",
                     f"/sandboxes/{sbx.sandbox_id}/metrics?start=10&end=5",
                     f"/sandboxes/{sbx.sandbox_id}/metrics?start=yesterday",
                     "/sandboxes/metrics",
                     "/sandboxes/metrics?sandbox_ids=" + ",".join(f"s{i}" for i in range(101))):
            status, body = api(observed, path)
            assert status == 400, (path, status, body)
            assert body["code"] == 400 and body["message"], (path, body)
    finally:
        sbx.kill()


def test_metrics_come_as_a_series_and_for_many_sandboxes_at_once(observed):
    a = Sandbox.create(template="base", timeout=120, **observed.env)
    b = Sandbox.create(template="base", timeout=120, **observed.env)
    try:
        # Each read takes a sample once the newest is a second old, and the
        # reaper adds one every 5 s: the series grows.
        deadline = time.monotonic() + 30
        while len(series := a.get_metrics()) < 3 and time.monotonic() < deadline:
            time.sleep(1.1)
        assert len(series) >= 3, series
        stamps = [m.timestamp for m in series]
        assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
        assert all(m.mem_total > 0 and m.cpu_count >= 1 for m in series)
        # A window of the history (whole seconds, as the SDK sends them):
        # only the samples inside it.
        second = lambda m: int(m.timestamp.timestamp())  # noqa: E731
        first = a.get_metrics(start=series[0].timestamp, end=series[0].timestamp)
        assert first and all(second(m) == second(series[0]) for m in first), first
        assert series[-1].timestamp not in [m.timestamp for m in first]
        recent = a.get_metrics(start=series[-1].timestamp)
        assert recent and all(second(m) >= second(series[-1]) for m in recent), recent
        assert series[0].timestamp not in [m.timestamp for m in recent]

        res = get_sandboxes_metrics.sync_detailed(
            client=client(observed), sandbox_ids=[a.sandbox_id, b.sandbox_id, "nosuchsandbox0000000"])
        assert res.status_code == 200, res.content
        got = res.parsed.sandboxes
        assert set(got) == {a.sandbox_id, b.sandbox_id}
        assert all(m["memTotal"] > 0 and "timestampUnix" in m for m in got.values())
    finally:
        a.kill()
        b.kill()
