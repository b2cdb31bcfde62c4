"""`network.rules` through the official SDK: the host's egress proxy sets a
rule's headers on HTTP and HTTPS requests to the rule's host, with
`${e2b.secrets.<name>}` placeholders resolved on the host, so the secret's
value reaches the server but never the sandbox. HTTPS to a rule's host is
terminated by the proxy with a leaf of the copse egress CA, which the
sandbox trusts, and sent on over TLS the proxy verifies.

The web is test_egress_proxy.py's network namespace (its fixtures), whose
HTTP and HTTPS servers record every request they receive (`requests_to`);
its HTTPS certificate is signed by a test CA the module's gateway trusts
for upstreams (`--egress-upstream-ca`), and badcert.test is not in it.
allowed.test is the rule host, other.test another allowed host.
"""

import time
import uuid

import pytest
from e2b import Sandbox, SandboxException, Secret

from leakcheck import sandbox_pids
from test_egress_proxy import OTHER, WEB, WEB_CA_NAME, create, egress_gateway, fetch, requests_to, web  # noqa: F401
from test_egress_socks import front_log, socks_world, tls_front, tls_proxy  # noqa: F401


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
        # Two requests on what curl keeps one connection: each is
        # transformed, and the caller's own Authorization is replaced.
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


# The sandbox's own view of the web's names (its resolver may not know them).
ETC_HOSTS = f"echo '{WEB} allowed.test badcert.test' >> /etc/hosts; echo '{OTHER} other.test' >> /etc/hosts"

PYTHON_GET = """
import sys, urllib.request
from pip._vendor import requests  # pip's own copy, with certifi's roots unless told otherwise
url, client = sys.argv[1], sys.argv[2]
if client == "urllib":
    print(urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": "forged"})).status)
else:
    print(requests.get(url, headers={"Authorization": "forged"}).status_code)
"""


def issuer(sbx, url: str, resolve: str) -> str:
    """The issuer of the certificate a curl in the sandbox is shown."""
    out = sbx.commands.run(f"curl -skv -o /dev/null --resolve {resolve} {url} 2>&1 | grep -i 'issuer:' || true")
    return out.stdout.strip()


def test_https_to_a_rule_host_is_intercepted_for_curl_and_python_and_the_sandbox_never_sees_the_secret(env):
    value = f"tls-{uuid.uuid4().hex}"
    name = secret_of(env, value)
    sbx = create(env, allow_out=["allowed.test", "other.test"], deny_out=["0.0.0.0/0"], rules=bearer(name))
    try:
        sbx.commands.run(ETC_HOSTS, user="root")
        sbx.files.write("/tmp/get.py", PYTHON_GET)
        paths = {client: f"/{unique(client)}" for client in ("curl", "urllib", "requests")}
        # No -k: curl verifies the proxy's leaf against the trust store the
        # agent installed the egress CA into.
        got = sbx.commands.run(
            f"curl -s -o /dev/null -w '%{{http_code}}' -H 'Authorization: forged' https://allowed.test{paths['curl']}"
        ).stdout
        assert got == "200", got
        for client in ("urllib", "requests"):
            got = sbx.commands.run(f"python3 /tmp/get.py https://allowed.test{paths[client]} {client}").stdout
            assert got.strip() == "200", (client, got)
        for client, path in paths.items():
            (seen,) = requests_to(path)
            assert seen["headers"].get("Authorization") == f"Bearer {value}", (client, seen)
            assert seen["to"] == WEB, seen

        assert "copse egress CA" in issuer(sbx, "https://allowed.test/", f"allowed.test:443:{WEB}")
        env_out = sbx.commands.run("env").stdout
        for var in ("SSL_CERT_FILE=", "REQUESTS_CA_BUNDLE=", "NODE_EXTRA_CA_CERTS="):
            assert var in env_out, env_out
        control = f"planted-{uuid.uuid4().hex}"
        sbx.files.write("/home/user/planted.txt", control)
        assert "/home/user/planted.txt" in leaks(sbx, control), "the search must find what is there"
        assert leaks(sbx, value) == ""
    finally:
        sbx.kill()
        destroy(env, name)


def test_https_over_http2_to_a_rule_host_has_every_stream_transformed(env):
    """A client that picks HTTP/2 (ALPN) is served it by the proxy; each of
    its streams goes upstream as an HTTP/1.1 request with the rule applied
    and the Host its :authority named."""
    value = f"h2-{uuid.uuid4().hex}"
    name = secret_of(env, value)
    sbx = create(env, allow_out=["allowed.test"], deny_out=["0.0.0.0/0"], rules=bearer(name))
    try:
        sbx.commands.run(ETC_HOSTS, user="root")
        paths = [f"/{unique('h2')}" for _ in range(2)]
        # Two transfers on one connection (the second makes no new one).
        got = sbx.commands.run(
            "curl -s --http2 -o /dev/null -o /dev/null -w '%{http_version} %{http_code} %{num_connects}\\n' "
            f"-H 'Authorization: forged' https://allowed.test{paths[0]} https://allowed.test{paths[1]}"
        ).stdout
        assert got.split() == ["2", "200", "1", "2", "200", "0"], got
        for path in paths:
            (seen,) = requests_to(path)
            assert seen["headers"].get("Authorization") == f"Bearer {value}", seen
            assert seen["headers"].get("Host") == "allowed.test", seen
        assert leaks(sbx, value) == ""
    finally:
        sbx.kill()
        destroy(env, name)


# Two requests on ONE connection, with `auto_open` off so http.client
# cannot quietly reconnect: a second request that met a closed connection
# fails here instead of being retried.
KEEPALIVE = """
import http.client, json, sys
scheme, paths = sys.argv[1], sys.argv[2:]
kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
conn = kind("allowed.test", timeout=10)
conn.connect()
conn.auto_open = 0
local = conn.sock.getsockname()
got = []
for path in paths:
    conn.request("GET", path, headers={"Authorization": "forged"})
    response = conn.getresponse()
    got.append([response.status, response.read().decode()])
print(json.dumps({"got": got, "same_socket": conn.sock is not None and conn.sock.getsockname() == local}))
"""


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_every_request_on_a_kept_alive_connection_gets_the_rule(env, scheme):
    import json

    value = f"ka-{uuid.uuid4().hex}"
    name = secret_of(env, value)
    sbx = create(env, allow_out=["allowed.test"], deny_out=["0.0.0.0/0"], rules=bearer(name))
    try:
        sbx.commands.run(ETC_HOSTS, user="root")
        sbx.files.write("/tmp/keepalive.py", KEEPALIVE)
        paths = [f"/{unique(p)}" for p in ("first", "second", "third")]
        out = sbx.commands.run(f"python3 /tmp/keepalive.py {scheme} {' '.join(paths)}").stdout
        result = json.loads(out)
        assert result == {"got": [[200, "web"]] * 3, "same_socket": True}, result
        seen = [requests_to(path) for path in paths]
        assert all(len(s) == 1 for s in seen), f"each request arrived once (no retry): {seen}"
        for (request,) in seen:
            assert request["headers"].get("Authorization") == f"Bearer {value}", request
        ports = {request["port"] for (request,) in seen}
        assert len(ports) == 1, f"one upstream connection carried all three: {ports}"
    finally:
        sbx.kill()
        destroy(env, name)


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_rules_apply_inside_a_tls_egress_proxy_tunnel(env, socks_world, tls_front, scheme):
    """The rule host is reached through the sandbox's SOCKS5 upstream over
    TLS: the request is still served (HTTP) or intercepted (HTTPS, its TLS
    to the host inside the tunnel's) and gets the rule."""
    import json

    user, password = socks_world
    ca, _, log = tls_front
    tunnels = front_log(log).count("tunnel")
    value = f"tun-{uuid.uuid4().hex}"
    name = secret_of(env, value)
    sbx = create(env, allow_out=["allowed.test"], deny_out=["0.0.0.0/0"], rules=bearer(name),
                 egress_proxy=tls_proxy(user, password, ca_cert=ca))
    try:
        sbx.commands.run(ETC_HOSTS, user="root")
        sbx.files.write("/tmp/keepalive.py", KEEPALIVE)
        paths = [f"/{unique(p)}" for p in ("first", "second")]
        result = json.loads(sbx.commands.run(f"python3 /tmp/keepalive.py {scheme} {' '.join(paths)}").stdout)
        assert result == {"got": [[200, "web"]] * 2, "same_socket": True}, result
        for path in paths:
            (request,) = requests_to(path)
            assert request["headers"].get("Authorization") == f"Bearer {value}", request
        assert front_log(log).count("tunnel") == tunnels + 1, "one connection, through the TLS upstream"
    finally:
        sbx.kill()
        destroy(env, name)


def test_tls_to_an_allowed_host_without_rules_is_not_intercepted(env):
    name = secret_of(env, "v")
    sbx = create(env, allow_out=["allowed.test", "other.test"], deny_out=["0.0.0.0/0"], rules=bearer(name))
    try:
        path = f"/{unique('other')}"
        shown = issuer(sbx, f"https://other.test{path}", f"other.test:443:{OTHER}")
        assert WEB_CA_NAME in shown and "copse" not in shown.replace(WEB_CA_NAME, ""), shown
        (seen,) = requests_to(path)
        assert "Authorization" not in seen["headers"], seen
        # The sandbox does not trust the web's own CA: without -k, only the
        # intercepted host verifies.
        assert fetch(sbx, "https://other.test/", f"other.test:443:{OTHER}").startswith("200")
        out = sbx.commands.run(f"curl -s -o /dev/null -w '%{{http_code}}' --resolve other.test:443:{OTHER} "
                               f"https://other.test/ || true").stdout
        assert out == "000", out
    finally:
        sbx.kill()
        destroy(env, name)


def test_an_upstream_whose_certificate_does_not_verify_gets_the_sandbox_an_error(env):
    value = f"bad-{uuid.uuid4().hex}"
    name = secret_of(env, value)
    rules = {"badcert.test": bearer(name)["allowed.test"]}
    sbx = create(env, allow_out=["badcert.test"], deny_out=["0.0.0.0/0"], rules=rules)
    try:
        path = f"/{unique('badcert')}"
        got = sbx.commands.run(
            f"curl -s -w '\n%{{http_code}}' --resolve badcert.test:443:{WEB} https://badcert.test{path} || true"
        ).stdout
        body, _, status = got.rpartition("\n")
        assert status == "502", got
        assert "certificate" in body.lower(), body
        assert requests_to(path) == [], "the request never reaches an unverified server"
        plain = f"/{unique('plain')}"
        assert fetch(sbx, f"http://badcert.test{plain}", f"badcert.test:80:{WEB}") == "200", "the control must pass"
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
        # Created without rules: the CA arrived with them (no -k).
        tls = f"/{unique('tls')}"
        got = sbx.commands.run(f"curl -s -o /dev/null -w '%{{http_code}}' --resolve allowed.test:443:{WEB} "
                               f"https://allowed.test{tls} || true").stdout
        assert got == "200", got
        assert requests_to(tls)[0]["headers"].get("Authorization") == f"Bearer {value}"
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
