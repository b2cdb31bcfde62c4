"""Sandbox lifecycle through the official SDK (create, info, list, timeout,
connect, kill, metrics, errors) and what a sandbox can and cannot see."""

import datetime
import json
import os
import socket
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxQuery,
)
from packaging.version import Version
from conftest import first_metrics


def list_all(query=None) -> list:
    paginator = Sandbox.list(query=query)
    items = []
    while paginator.has_next:
        items.extend(paginator.next_items())
    return items


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def test_create_with_metadata_and_envs_shows_them_in_info_and_commands(gateway):
    metadata = {"purpose": "conformance", "owner": "tests ✓"}
    before = now()
    sbx = Sandbox.create(timeout=120, metadata=metadata, envs={"GREETING": "hi there"})
    try:
        info = sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id
        assert "base" in (info.template_id, info.name)
        assert info.metadata == metadata
        assert info.state == "running"
        assert info.cpu_count >= 1
        assert info.memory_mb > 0
        assert Version(info.envd_version) >= Version("0.6.4")
        assert before - datetime.timedelta(seconds=5) <= info.started_at <= now() + datetime.timedelta(seconds=5)
        lifetime = (info.end_at - info.started_at).total_seconds()
        assert 115 <= lifetime <= 125, f"end_at - started_at = {lifetime}s for timeout=120"
        assert sbx.commands.run("echo $GREETING").stdout == "hi there\n"
        assert sbx.is_running()
    finally:
        sbx.kill()


def test_list_with_a_metadata_filter_finds_exactly_ours(gateway):
    tag = uuid.uuid4().hex
    ours = [
        Sandbox.create(timeout=120, metadata={"suite-tag": tag, "odd key &=": "a b&c=d"}),
        Sandbox.create(timeout=120, metadata={"suite-tag": tag, "odd key &=": "a b&c=d"}),
    ]
    other = Sandbox.create(timeout=120, metadata={"suite-tag": f"{tag}-other"})
    try:
        found = list_all(SandboxQuery(metadata={"suite-tag": tag}))
        assert sorted(s.sandbox_id for s in found) == sorted(s.sandbox_id for s in ours)
        assert all(s.metadata.get("suite-tag") == tag for s in found)
        assert all(s.state == "running" for s in found)

        # Keys and values that need URL encoding are matched exactly, too.
        found = list_all(SandboxQuery(metadata={"suite-tag": tag, "odd key &=": "a b&c=d"}))
        assert sorted(s.sandbox_id for s in found) == sorted(s.sandbox_id for s in ours)
        assert list_all(SandboxQuery(metadata={"suite-tag": tag, "odd key &=": "a b"})) == []

        everything = {s.sandbox_id for s in list_all()}
        assert {s.sandbox_id for s in ours} | {other.sandbox_id} <= everything
    finally:
        for s in [*ours, other]:
            s.kill()


def test_set_timeout_moves_the_end_time(sandbox):
    first = sandbox.get_info().end_at
    sandbox.set_timeout(600)
    second = sandbox.get_info().end_at
    expected = now() + datetime.timedelta(seconds=600)
    assert abs((second - expected).total_seconds()) < 10
    assert second > first
    sandbox.set_timeout(30)
    third = sandbox.get_info().end_at
    assert abs((third - (now() + datetime.timedelta(seconds=30))).total_seconds()) < 10


def test_sandbox_is_gone_once_its_timeout_expires(gateway):
    sbx = Sandbox.create(timeout=2)
    try:
        assert sbx.commands.run("echo up").stdout == "up\n"
        deadline = time.monotonic() + 12
        while sbx.sandbox_id in {s.sandbox_id for s in list_all()}:
            assert time.monotonic() < deadline, "sandbox still listed 12 s after a 2 s timeout"
            time.sleep(0.25)
        with pytest.raises(SandboxNotFoundException):
            Sandbox.connect(sbx.sandbox_id)
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info(sbx.sandbox_id)
        assert sbx.kill() is False
    finally:
        sbx.kill()


def test_second_client_connects_and_sees_the_same_sandbox(sandbox):
    sandbox.files.write("/home/user/from-first.txt", "written by client one")
    second = Sandbox.connect(sandbox.sandbox_id)
    assert second.sandbox_id == sandbox.sandbox_id
    assert second.commands.run("cat /home/user/from-first.txt").stdout == "written by client one"
    second.commands.run("echo back > /home/user/from-second.txt")
    assert sandbox.files.read("/home/user/from-second.txt") == "back\n"


def test_killing_twice_reports_false_the_second_time(gateway):
    sbx = Sandbox.create(timeout=60)
    assert sbx.kill() is True
    assert sbx.kill() is False
    assert Sandbox.kill(sbx.sandbox_id) is False
    assert sbx.sandbox_id not in {s.sandbox_id for s in list_all()}
    with pytest.raises(SandboxNotFoundException):
        sbx.get_info()


def test_info_of_an_unknown_sandbox_raises_not_found(gateway):
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info("nosuchsandbox0000000")
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect("nosuchsandbox0000000")
    with pytest.raises(SandboxNotFoundException):
        Sandbox.set_timeout("nosuchsandbox0000000", 30)


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/sandboxes/nosuchsandbox0000000"),
        ("DELETE", "/sandboxes/nosuchsandbox0000000"),
        ("POST", "/v2/sandboxes/nosuchsandbox0000000/connect"),
    ],
)
def test_unknown_sandbox_errors_are_json_with_code_and_message(gateway, method, path):
    # The SDK parses error bodies as {"code": int, "message": str}; anything
    # else crashes it before its own 404 handling, so check the shape raw.
    request = urllib.request.Request(
        gateway.url + path,
        method=method,
        data=b"{}" if method == "POST" else None,
        headers={"X-API-KEY": os.environ["E2B_API_KEY"], "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 404
    body = json.loads(caught.value.read())
    assert body["code"] == 404
    assert isinstance(body["message"], str) and body["message"]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/sandboxes", b'{"templateID": "base", "timeout": "soon"}'),
        ("/sandboxes", b"{not json"),
        ("/snapshots?limit=many", None),
    ],
)
def test_malformed_requests_get_json_errors(gateway, path, body):
    request = urllib.request.Request(
        gateway.url + path,
        method="POST" if body is not None else "GET",
        data=body,
        headers={"X-API-Key": os.environ["E2B_API_KEY"], "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 400
    error = json.loads(caught.value.read())
    assert error["code"] == 400 and error["message"]


def test_unknown_template_error_names_the_available_templates(gateway):
    with pytest.raises(SandboxException) as caught:
        Sandbox.create("no-such-template-xyz", timeout=30)
    assert getattr(caught.value, "status_code", None) == 400
    message = str(caught.value)
    assert "no-such-template-xyz" in message
    assert "base" in message


@pytest.mark.parametrize(
    "options, field",
    [
        # MCP servers need E2B's mcp-gateway image, which copse does not ship.
        ({"template": "base", "mcp": {"github": {"githubPersonalAccessToken": "x"}}}, "mcp"),
    ],
)
def test_asking_for_a_feature_copse_lacks_is_refused_by_name(gateway, options, field):
    marker = {"refused": uuid.uuid4().hex}
    with pytest.raises(SandboxException) as caught:
        Sandbox.create(timeout=30, metadata=marker, **options)
    assert getattr(caught.value, "status_code", None) == 400
    assert field in str(caught.value)
    assert list_all(SandboxQuery(metadata=marker)) == []


def test_a_cold_create_says_where_its_boot_went(gateway):
    """The create response's Server-Timing names the substrate's boot steps,
    so a slower boot can be taken apart from its own responses (bench:create
    records them); the top-level steps fit inside the boot they make up."""
    import httpx

    headers = {"X-API-KEY": os.environ["E2B_API_KEY"]}
    response = httpx.post(gateway.url + "/sandboxes", json={"templateID": "base", "timeout": 60}, headers=headers,
                          timeout=30)
    assert response.status_code == 201, response.text
    try:
        timing = {}
        for metric in response.headers["server-timing"].split(","):
            name, dur = metric.strip().split(";dur=")
            timing[name] = float(dur)
        wanted = {"boot_disk", "boot_cgroups", "boot_jail_spawn", "boot_jail_stage", "boot_jail_userns",
                  "boot_jail_unshare", "boot_jail_root", "boot_jail_mask", "boot_jail_agent", "boot_attach",
                  "boot_attach_rules", "boot_service"}
        assert wanted <= timing.keys(), timing
        # `attach_*` are the parts of `attach`.
        top = [v for k, v in timing.items() if k.startswith("boot_") and not k.startswith("boot_attach_")]
        assert sum(top) <= timing["boot"] + 0.001 * len(top), timing
        assert timing["boot_attach_rules"] <= timing["boot_attach"] + 0.001, timing
    finally:
        sandbox_id = response.json()["sandboxID"]
        httpx.delete(f"{gateway.url}/sandboxes/{sandbox_id}", headers=headers, timeout=30)


def test_wrong_api_key_is_rejected(gateway):
    with pytest.raises(AuthenticationException):
        Sandbox.create(timeout=30, api_key="not-the-key")
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="not-the-key").next_items()


def test_metrics_report_real_cpu_and_memory_figures(sandbox):
    sandbox.commands.run("head -c 20000000 /dev/zero > /tmp/ballast; sleep 0.2")
    m = first_metrics(sandbox, after=time.time())[-1]
    assert m.cpu_count >= 1
    assert m.mem_used > 0
    assert m.mem_total >= m.mem_used
    assert m.cpu_used_pct >= 0
    assert m.disk_total > 0
    assert m.disk_used > 0  # the 20 MB ballast lives in the sandbox's upper layer
    assert abs((m.timestamp - now()).total_seconds()) < 120


def test_sandboxes_cannot_see_each_others_files_or_processes(gateway):
    a = Sandbox.create(timeout=120)
    b = Sandbox.create(timeout=120)
    try:
        secret = uuid.uuid4().hex
        a.files.write(f"/tmp/secret-{secret}", "only in A")
        a.commands.run(f"echo {secret} > /home/user/also-secret")
        assert a.files.exists(f"/tmp/secret-{secret}")
        assert b.files.exists(f"/tmp/secret-{secret}") is False
        assert b.files.exists("/home/user/also-secret") is False
        assert b.commands.run(f"grep -rs {secret} /tmp /home || true", user="root").stdout == ""

        sleeper = a.commands.run("sleep 1234", background=True, timeout=0)
        try:
            assert "sleep 1234" in a.commands.run("ps -e -o args").stdout
            assert "sleep 1234" not in b.commands.run("ps -e -o args").stdout
            assert "sleep 1234" not in b.commands.run("ps -e -o args", user="root").stdout
        finally:
            a.commands.kill(sleeper.pid)
    finally:
        a.kill()
        b.kill()


def test_sandbox_sees_only_its_own_processes_and_hostname(sandbox):
    host_pid1 = open("/proc/1/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
    listing = sandbox.commands.run("ps -e -o pid=,args=", user="root").stdout
    pids = {}
    for line in listing.splitlines():
        pid, _, args = line.strip().partition(" ")
        pids[int(pid)] = args.strip()
    assert 1 in pids, listing
    # Nothing of the host: not its init, not this test run, not the gateway.
    assert len(pids) < 20, listing
    assert "pytest" not in listing
    assert "copse up" not in listing
    sandbox_pid1 = sandbox.commands.run("tr '\\0' ' ' < /proc/1/cmdline", user="root").stdout.strip()
    assert sandbox_pid1 != host_pid1 or host_pid1 == "", (sandbox_pid1, host_pid1)

    hostname = sandbox.commands.run("hostname").stdout.strip()
    assert hostname
    assert hostname != socket.gethostname()


def test_ten_sandboxes_created_in_parallel_all_work(gateway):
    tag = uuid.uuid4().hex
    created: list[Sandbox] = []
    errors: list[BaseException] = []

    def create(i: int) -> Sandbox:
        sbx = Sandbox.create(timeout=120, metadata={"parallel": tag, "i": str(i)})
        created.append(sbx)
        return sbx

    try:
        with ThreadPoolExecutor(max_workers=10) as pool:
            futures = [pool.submit(create, i) for i in range(10)]
            for f in futures:
                try:
                    f.result(timeout=120)
                except BaseException as e:  # noqa: BLE001 - collected and reported below
                    errors.append(e)
        assert not errors, f"{len(errors)} of 10 parallel creates failed: {errors!r}"
        assert len({s.sandbox_id for s in created}) == 10
        with ThreadPoolExecutor(max_workers=10) as pool:
            outputs = list(pool.map(lambda s: s.commands.run("echo $((40+2))").stdout, created, timeout=120))
        assert outputs == ["42\n"] * 10
        listed = list_all(SandboxQuery(metadata={"parallel": tag}))
        assert len(listed) == 10
    finally:
        with ThreadPoolExecutor(max_workers=10) as pool:
            killed = list(pool.map(lambda s: s.kill(), created, timeout=120))
    assert killed == [True] * len(created)
    assert list_all(SandboxQuery(metadata={"parallel": tag})) == []


# CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_FSETID, CAP_KILL, CAP_SETGID,
# CAP_SETUID, CAP_NET_BIND_SERVICE: a container root's own few.
ROOT_CAPABILITIES = 0x4FB


def test_sandbox_processes_cannot_mount_and_root_keeps_only_a_container_roots_capabilities(sandbox):
    for user, expected in (("root", ROOT_CAPABILITIES), ("user", 0)):
        with pytest.raises(CommandExitException):
            sandbox.commands.run("mount -t tmpfs x /mnt", user=user)
        status = sandbox.commands.run("cat /proc/self/status", user=user).stdout
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        for field in ("CapEff", "CapPrm"):
            assert int(fields[field].strip(), 16) == expected, f"{field} as {user}: {fields[field]}"
        assert int(fields["CapAmb"].strip(), 16) == 0, f"CapAmb as {user}"
        assert fields["NoNewPrivs"].strip() == "1", f"NoNewPrivs as {user}"
    assert " /mnt " not in sandbox.commands.run("cat /proc/mounts").stdout


def test_root_chowns_switches_users_and_binds_low_ports_as_in_a_container(sandbox):
    """What a Dockerfile's RUN lines and packages' maintainer scripts do as
    root works; the same as `user` is refused."""
    script = (
        "set -e; rm -rf /srv/x; mkdir -p /srv/x && chown user:user /srv/x && stat -c %U /srv/x; "
        "setpriv --reuid user --regid user --init-groups id -un; "
        "python3 -c \"import socket; s = socket.socket(); s.bind(('127.0.0.1', 81)); print('bound')\""
    )
    assert sandbox.commands.run(script, user="root").stdout.split() == ["user", "user", "bound"]
    with pytest.raises(CommandExitException):
        sandbox.commands.run("touch /tmp/mine && chown root /tmp/mine", user="user")
    with pytest.raises(CommandExitException):
        sandbox.commands.run("python3 -c \"import socket; socket.socket().bind(('127.0.0.1', 82))\"", user="user")
