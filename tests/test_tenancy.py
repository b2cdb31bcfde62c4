"""Many teams on one gateway: keys made with `copse keys create` against
the running gateway's data dir, each team seeing only its own sandboxes
and snapshots (another team's are 404, never 403), per-team quotas
answered with E2B's 429 naming the limit, and a per-key request rate."""

import secrets
import subprocess
import time

import httpx
import pytest
from conftest import COPSE, DATA_DIR
from e2b import NotFoundException, RateLimitException, Sandbox, SandboxException


def copse(*args) -> str:
    done = subprocess.run([str(COPSE), *args, "--data-dir", str(DATA_DIR)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def new_team(prefix: str) -> str:
    """A team name no earlier run used (the suite's data dir persists)."""
    return f"{prefix}-{secrets.token_hex(4)}"


def new_key(team: str, *extra) -> str:
    key = copse("keys", "create", "--team", team, *extra).strip()
    assert key.startswith("e2b_") and len(key) == 44, key
    return key


def api(gateway, key: str, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, gateway.url + path, headers={"x-api-key": key}, timeout=60, **kwargs)


@pytest.fixture
def two_teams(gateway):
    """Team a's key, team b's key, and an admin key; their sandboxes and
    snapshots go when the test ends."""
    keys = (new_key(new_team("a")), new_key(new_team("b")), new_key(new_team("ops"), "--admin"))
    yield keys
    # Not with the admin key: that would reach every team's sandboxes.
    for key in keys[:2]:
        for info in Sandbox.list(api_key=key).next_items():
            Sandbox.kill(info.sandbox_id, api_key=key)
        for snap in Sandbox.list_snapshots(api_key=key).next_items():
            Sandbox.delete_snapshot(snap.snapshot_id, api_key=key)


def assert_404(response: httpx.Response):
    assert response.status_code == 404, (response.request.method, response.request.url, response.text)
    body = response.json()
    assert body["code"] == 404 and body["message"], body


def test_another_teams_key_gets_404_on_every_route_of_a_sandbox_it_does_not_own(gateway, two_teams):
    a, b, admin = two_teams
    mine = Sandbox.create(timeout=120, api_key=a)
    mine.files.write("/home/user/secret.txt", "team a's")
    snap = mine.create_snapshot(mode="filesystem")
    sid = mine.sandbox_id

    # Through the SDK, as team b.
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sid, api_key=b)
    with pytest.raises(NotFoundException):
        Sandbox.connect(sid, api_key=b)
    with pytest.raises(NotFoundException):
        Sandbox.set_timeout(sid, 60, api_key=b)
    with pytest.raises(NotFoundException):
        Sandbox.get_metrics(sid, api_key=b)
    with pytest.raises(SandboxException):
        Sandbox.create_snapshot(sid, api_key=b)
    with pytest.raises(SandboxException):
        Sandbox.fork(sid, api_key=b)
    assert Sandbox.kill(sid, api_key=b) is False
    assert sid not in [s.sandbox_id for s in Sandbox.list(api_key=b).next_items()]
    assert snap.snapshot_id not in [s.snapshot_id for s in Sandbox.list_snapshots(api_key=b).next_items()]
    with pytest.raises(SandboxException):
        Sandbox.create(snap.snapshot_id, api_key=b)

    # Every route, raw, as team b: 404 with E2B's body, never 403.
    for method, path, body in [
        ("GET", f"/sandboxes/{sid}", None),
        ("DELETE", f"/sandboxes/{sid}", None),
        ("POST", f"/sandboxes/{sid}/connect", {"timeout": 60}),
        ("POST", f"/v2/sandboxes/{sid}/connect", {"timeout": 60}),
        ("POST", f"/sandboxes/{sid}/pause", {}),
        ("POST", f"/sandboxes/{sid}/resume", {}),
        ("POST", f"/sandboxes/{sid}/timeout", {"timeout": 60}),
        ("POST", f"/sandboxes/{sid}/refreshes", {"duration": 60}),
        ("GET", f"/sandboxes/{sid}/metrics", None),
        ("PUT", f"/sandboxes/{sid}/network", {"allowOut": ["1.1.1.1"]}),
        ("POST", f"/sandboxes/{sid}/snapshots", {}),
        ("POST", f"/sandboxes/{sid}/fork", {"count": 1}),
        ("POST", f"/copse/sandboxes/{sid}/clone", {"count": 1}),
        ("POST", f"/copse/sandboxes/{sid}/rollback", {"snapshotID": snap.snapshot_id}),
        ("DELETE", f"/templates/{snap.snapshot_id}", None),
    ]:
        assert_404(api(gateway, b, method, path, json=body))
    assert api(gateway, b, "GET", f"/snapshots?sandboxID={sid}").json() == []

    # Nothing team b did reached team a's sandbox or snapshot.
    assert mine.is_running()
    assert mine.files.read("/home/user/secret.txt") == "team a's"
    assert snap.snapshot_id in [s.snapshot_id for s in Sandbox.list_snapshots(api_key=a).next_items()]
    # An operator's admin key sees every team.
    assert Sandbox.get_info(sid, api_key=admin).sandbox_id == sid
    assert sid in [s.sandbox_id for s in Sandbox.list(api_key=admin).next_items()]
    # The suite's own key (COPSE_API_KEY, the default team) sees none of it.
    assert sid not in [s.sandbox_id for s in Sandbox.list().next_items()]


def test_snapshot_names_are_per_team_and_templates_cannot_be_shadowed(gateway, two_teams):
    a, b, _ = two_teams
    for key, text in ((a, "from a"), (b, "from b")):
        sbx = Sandbox.create(timeout=120, api_key=key)
        sbx.files.write("/home/user/who.txt", text)
        assert sbx.create_snapshot(name="shared-name", mode="filesystem").snapshot_id == "shared-name"
        with pytest.raises(SandboxException) as refused:
            sbx.create_snapshot(name="base", mode="filesystem")
        assert "template" in str(refused.value)
    for key, text in ((a, "from a"), (b, "from b")):
        child = Sandbox.create("shared-name", timeout=60, api_key=key)
        assert child.files.read("/home/user/who.txt") == text
        # "base" still means the template for everyone.
        assert not Sandbox.create("base", timeout=60, api_key=key).files.exists("/home/user/who.txt")


def test_keys_made_or_revoked_beside_the_running_gateway_take_effect(gateway):
    team = new_team("k")
    key = new_key(team, "--name", "ci")
    # At once: no restart, no wait.
    assert Sandbox.list(api_key=key).next_items() == []
    listed = copse("keys", "list")
    line = next(line for line in listed.splitlines() if line.startswith(team))
    assert "ci" in line and key[:12] in line and key[12:] not in listed
    copse("keys", "revoke", key[:12])
    deadline = time.monotonic() + 5
    while api(gateway, key, "GET", "/sandboxes").status_code != 401:
        assert time.monotonic() < deadline, "a revoked key still works"
        time.sleep(0.1)
    assert api(gateway, key, "GET", "/sandboxes").json()["code"] == 401


def test_quotas_refuse_with_429_naming_the_limit_and_a_fork_counts_whole(gateway):
    team = new_team("q")
    copse("teams", "set", team, "--max-sandboxes", "2", "--max-paused", "1", "--max-snapshots", "1",
          "--max-sandbox-timeout", "600")
    key = new_key(team)
    try:
        first = Sandbox.create(timeout=120, api_key=key)
        with pytest.raises(SandboxException, match="max-sandbox-timeout"):
            Sandbox.create(timeout=601, api_key=key)
        with pytest.raises(SandboxException, match="max-sandbox-timeout"):
            first.set_timeout(601)
        # Two more would make three: refused whole, nothing booted.
        response = api(gateway, key, "POST", f"/sandboxes/{first.sandbox_id}/fork", json={"count": 2})
        assert response.status_code == 429, response.text
        assert response.json()["code"] == 429 and "max-sandboxes" in response.json()["message"]
        assert len(Sandbox.list(api_key=key).next_items()) == 1
        (child,) = first.fork(count=1, timeout=120)
        with pytest.raises(RateLimitException, match="max-sandboxes"):
            Sandbox.create(timeout=60, api_key=key)
        first.create_snapshot(mode="filesystem")
        with pytest.raises(RateLimitException, match="max-snapshots"):
            first.create_snapshot(mode="filesystem")
        first.pause()
        with pytest.raises(RateLimitException, match="max-paused"):
            child.pause()
        # A place freed is a place to use: the paused one no longer runs.
        Sandbox.create(timeout=60, api_key=key)
    finally:
        for info in Sandbox.list(api_key=key).next_items():
            Sandbox.kill(info.sandbox_id, api_key=key)
        for snap in Sandbox.list_snapshots(api_key=key).next_items():
            Sandbox.delete_snapshot(snap.snapshot_id, api_key=key)


def test_a_key_over_its_request_rate_gets_429_with_retry_after(gateway):
    team = new_team("r")
    copse("teams", "set", team, "--requests-per-second", "2")
    key, other = new_key(team), new_key(team)
    with httpx.Client(base_url=gateway.url, headers={"x-api-key": key}, timeout=30) as client:
        answers = [client.get("/sandboxes") for _ in range(6)]
    limited = [r for r in answers if r.status_code == 429]
    assert limited, [r.status_code for r in answers]
    assert answers[0].status_code == 200
    body = limited[0].json()
    assert body["code"] == 429 and "requests-per-second" in body["message"], body
    wait = int(limited[0].headers["retry-after"])
    assert wait >= 1
    # Each key has its own bucket; the limited one is let through after waiting.
    assert api(gateway, other, "GET", "/sandboxes").status_code == 200
    time.sleep(wait)
    assert api(gateway, key, "GET", "/sandboxes").status_code == 200


def test_a_sandbox_paused_past_its_teams_retention_is_deleted_with_its_files(gateway):
    team, other = new_team("ret"), new_team("keep")
    copse("teams", "set", team, "--paused-retention", "3s")
    key, other_key = new_key(team), new_key(other)
    before = {p.stem for p in (DATA_DIR / "snapshots").glob("*.json")}
    old = Sandbox.create(timeout=120, api_key=key)
    files = Sandbox.create(timeout=120, api_key=key)
    kept = Sandbox.create(timeout=120, api_key=other_key)
    try:
        old.pause()
        files.pause(mode="filesystem")
        kept.pause()
        stash = {p.stem for p in (DATA_DIR / "snapshots").glob("*.json")} - before
        assert len(stash) == 1, "a files-only pause keeps its files in a snapshot"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and Sandbox.list(api_key=key).next_items():
            time.sleep(0.5)
        assert Sandbox.list(api_key=key).next_items() == [], "both paused sandboxes outlived the retention"
        with pytest.raises(NotFoundException):
            Sandbox.connect(old.sandbox_id, api_key=key)
        assert not any((DATA_DIR / "snapshots" / f"{k}.json").exists() for k in stash), "its files went with it"
        # Another team, without a retention, keeps its paused sandbox.
        (info,) = Sandbox.list(api_key=other_key).next_items()
        assert info.sandbox_id == kept.sandbox_id and info.state.value == "paused"
        assert "paused-retention-s 3" in copse("teams", "list")
    finally:
        for k in (key, other_key):
            for info in Sandbox.list(api_key=k).next_items():
                Sandbox.kill(info.sandbox_id, api_key=k)
