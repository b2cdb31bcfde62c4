"""The official JavaScript SDKs (`e2b`, `@e2b/code-interpreter`, pinned in
tests/js/package.json and installed by bootstrap) against the session's
gateway: each tests/js/*.test.mjs file runs under `node --test`, and the
suites that need a fixture of this suite (the netns "internet", the
domain-mode gateway) run small scripts from tests/js/driven."""

import json
import os
import pathlib
import subprocess

import pytest

from conftest import API_KEY
from test_domain_tls import domain_mode  # noqa: F401 (a fixture)
from test_network import INTERNET, OTHER, PORT, internet  # noqa: F401 (a fixture)

JS = pathlib.Path(__file__).parent / "js"
SUITES = sorted(p.name for p in JS.glob("*.test.mjs"))


def node(args, env, timeout):
    return subprocess.run(["node", *args], cwd=JS, env=env, capture_output=True, text=True, timeout=timeout)


def gateway_env(gateway) -> dict:
    return dict(os.environ, E2B_API_URL=gateway.url, E2B_SANDBOX_URL=gateway.url, E2B_API_KEY=API_KEY)


@pytest.mark.timeout(900, func_only=True)
@pytest.mark.parametrize("suite", SUITES)
def test_js_suite(gateway, suite):
    done = node(["--test", "--test-reporter=spec", suite], gateway_env(gateway), timeout=840)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]


def test_js_network_policies(gateway, internet):  # noqa: F811
    env = dict(gateway_env(gateway), INTERNET=INTERNET, OTHER=OTHER, PORT=str(PORT))
    done = node(["driven/network.mjs"], env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "open": True, "closed": False, "closedInfo": False, "onlyOther": True, "onlyInternet": False,
        "deniedAfterUpdate": False, "otherAfterUpdate": True, "reopened": True,
    }


def test_js_sdk_with_only_a_domain(domain_mode):  # noqa: F811
    env = {k: v for k, v in os.environ.items() if k not in ("E2B_API_URL", "E2B_SANDBOX_URL")}
    env.update(E2B_DOMAIN=domain_mode["domain"], NODE_EXTRA_CA_CERTS=str(domain_mode["ca"]), E2B_API_KEY=API_KEY)
    # The same private, loopback-only resolv.conf as the Python SDK's run.
    isolated = ["unshare", "--mount", "sh", "-c", 'mount --bind "$0" /etc/resolv.conf && exec "$@"',
                str(domain_mode["resolv_conf"]), "node"]

    def step(*args):
        done = subprocess.run([*isolated, "driven/domain.mjs", *args], cwd=JS, env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    created = step("create")
    domain = domain_mode["domain"]
    assert created["hosts"] == [f"49983-{created['id']}.{domain}", f"49999-{created['id']}.{domain}"]
    domain_mode["hosts"].add(*created["hosts"])
    assert step("use", created["id"]) == {
        "stdout": "over 42 tls\n", "file": "read back over TLS", "code": [["streamed\n"], "42"],
    }
