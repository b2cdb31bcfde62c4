"""`network.rules` through the official SDK: the host's egress proxy sets a
rule's headers on plain HTTP requests to the rule's host, with
`${e2b.secrets.<name>}` placeholders resolved on the host, so the secret's
value reaches the server but never the sandbox.

The web is test_egress_proxy.py's network namespace (its fixtures), whose
HTTP server records every request it receives (`requests_to`).
allowed.test is the rule host, other.test another allowed host. HTTPS to a
host with rules is refused: the proxy does not terminate TLS yet.
"""

import time
import uuid

import pytest
from e2b import Sandbox, SandboxException, Secret

from leakcheck import sandbox_pids
from test_egress_proxy import OTHER, WEB, create, egress_gateway, fetch, requests_to, web  # noqa: F401


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def secret_of(env, value: str) -> str:
    name = unique("rule-key")
    Secret.create(name, value, api_key=env["api_key"], api_url=env["api_url"])
    return name


def destroy(env, name: str):
    Secret.destroy(name, api_key=env["api_key"], api_url=env["api_url"])


def bearer(name: str) -> dict:
    return {"allowed.test": [{"transform": {"headers": {"Authorization": "Bearer " + Secret.fill(name)}}}]}


def pattern(value: str) -> str:
    """A regex matching `value` whose own text does not contain it, so the
    command that searches for the value does not plant it."""
    return f"{value[0]}[{value[1]}]{value[2:]}"


def in_memory(sbx, value: str) -> list[int]:
    """Host pids of the sandbox's processes whose memory holds `value`,
    read from the host (as a dump would be): every readable mapping."""
    needle = value.encode()
    holding = []
    for pid in sandbox_pids(sbx.sandbox_id):
        try:
            with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
                for line in maps:
                    span, perms = line.split()[:2]
                    if not perms.startswith("r") or "[vsyscall]" in line or "[vvar]" in line:
                        continue
                    start, end = (int(x, 16) for x in span.split("-"))
                    try:
                        mem.seek(start)
                        if needle in mem.read(end - start):
                            holding.append(pid)
                            break
                    except (OSError, OverflowError, ValueError):
                        continue
        except OSError:
            continue
    return holding


def leaks(sbx, value: str) -> str:
    """Where in the sandbox `value` appears: its environment, any process's
    environment or memory, any file."""
    regex = pattern(value)
    found = sbx.commands.run(
        f"(env; cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n') | grep -E '{regex}' | head -3; "
        f"grep -rlsE '{regex}' / --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev 2>/dev/null | head -3; true",
        timeout=180,
    ).stdout.strip()
    dumped = [f"memory of pid {pid}" for pid in in_memory(sbx, value)]
    return "\n".join([found, *dumped]).strip()


@pytest.fixture
def env(egress_gateway):
    return egress_gateway[0]


def test_a_rule_sets_the_secret_header_on_its_host_only_and_the_sandbox_never_sees_it(env):
    value = f"s3cret-{uuid.uuid4().hex}"
    name = secret_of(env, value)
    sbx = create(env, allow_out=["allowed.test", "other.test"], deny_out=["0.0.0.0/0"], rules=bearer(name))
    try:
        first, second, other = (f"/{unique(p)}" for p in ("first", "second", "other"))
        # Two requests on what curl tries to keep one connection: each is
        # transformed (the proxy closes after one), and the caller's own
        # Authorization is replaced.
        got = sbx.commands.run(
            f"curl -s -o /dev/null -o /dev/null -w '%{{http_code}} ' -H 'Authorization: forged' "
            f"--resolve allowed.test:80:{WEB} http://allowed.test{first} http://allowed.test{second}"
        ).stdout.split()
        assert got == ["200", "200"], got
        for path in (first, second):
            (seen,) = requests_to(path)
            assert seen["headers"].get("Authorization") == f"Bearer {value}", seen
        assert fetch(sbx, f"http://other.test{other}", f"other.test:80:{OTHER}") == "200"
        (seen,) = requests_to(other)
        assert "Authorization" not in seen["headers"], seen
        assert value not in str(seen)

        assert fetch(sbx, "https://allowed.test/", f"allowed.test:443:{WEB}") == "000", "HTTPS is not intercepted yet"

        info = sbx.get_info()
        assert info.network["rules"] == bearer(name), info.network
        control = f"planted-{uuid.uuid4().hex}"
        sbx.files.write("/home/user/planted.txt", control)
        assert "/home/user/planted.txt" in leaks(sbx, control), "the search must find what is there"
        held = f"held-{uuid.uuid4().hex}"
        sbx.commands.run(
            f"python3 -c 'import time; x = bytes.fromhex(\"{held.encode().hex()}\"); time.sleep(120)'", background=True
        )
        for _ in range(50):  # the background process takes a moment to start
            if in_memory(sbx, held):
                break
            time.sleep(0.2)
        assert "memory of pid" in leaks(sbx, held), "the memory scan must find what a process holds"
        assert leaks(sbx, value) == ""
    finally:
        sbx.kill()
        destroy(env, name)


def test_a_rule_host_not_in_allow_out_stays_blocked(env):
    name = secret_of(env, "v")
    sbx = create(env, allow_out=["other.test"], deny_out=["0.0.0.0/0"], rules=bearer(name))
    try:
        path = f"/{unique('blocked')}"
        assert fetch(sbx, f"http://allowed.test{path}", f"allowed.test:80:{WEB}") == "000"
        assert requests_to(path) == []
        assert fetch(sbx, "http://other.test/", f"other.test:80:{OTHER}") == "200", "the control must pass"
    finally:
        sbx.kill()
        destroy(env, name)


def test_update_network_adds_and_removes_rules_on_a_running_sandbox(env):
    value = f"upd-{uuid.uuid4().hex}"
    name = secret_of(env, value)
    sbx = create(env, allow_out=["allowed.test"], deny_out=["0.0.0.0/0"])
    try:
        before, during, after = (f"/{unique(p)}" for p in ("before", "during", "after"))
        assert fetch(sbx, f"http://allowed.test{before}", f"allowed.test:80:{WEB}") == "200"
        sbx.update_network({"allow_out": ["allowed.test"], "deny_out": ["0.0.0.0/0"], "rules": bearer(name)})
        assert fetch(sbx, f"http://allowed.test{during}", f"allowed.test:80:{WEB}") == "200"
        sbx.update_network({"allow_out": ["allowed.test"], "deny_out": ["0.0.0.0/0"]})
        assert fetch(sbx, f"http://allowed.test{after}", f"allowed.test:80:{WEB}") == "200"
        headers = [requests_to(p)[0]["headers"].get("Authorization") for p in (before, during, after)]
        assert headers == [None, f"Bearer {value}", None], headers
    finally:
        sbx.kill()
        destroy(env, name)


@pytest.mark.parametrize(
    "headers, words",
    [
        ({"Bad Header": "v"}, "header name"),
        ({"X-Key": "a\r\nX-Injected: 1"}, "CR, LF or NUL"),
        ({"Host": "other.test"}, "header name"),
        ({"X-Key": "${e2b.identity.tokens.aws}"}, "workload identity is not supported"),
        ({"X-Key": "${e2b.secrets.no-such-secret-here}"}, "no-such-secret-here"),
    ],
)
def test_bad_rules_are_refused_on_create_and_update(env, headers, words):
    rules = {"allowed.test": [{"transform": {"headers": headers}}]}
    with pytest.raises(SandboxException) as caught:
        create(env, allow_out=["allowed.test"], rules=rules)
    assert getattr(caught.value, "status_code", None) == 400
    assert words in str(caught.value)
    sbx = create(env, allow_out=["allowed.test"])
    try:
        with pytest.raises(SandboxException) as caught:
            sbx.update_network({"allow_out": ["allowed.test"], "rules": rules})
        assert words in str(caught.value)
    finally:
        sbx.kill()


def test_a_bad_rule_host_is_refused(env):
    with pytest.raises(SandboxException) as caught:
        create(env, allow_out=["allowed.test"], rules={"*": [{"transform": {"headers": {"X-A": "b"}}}]})
    assert getattr(caught.value, "status_code", None) == 400
