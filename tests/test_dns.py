"""copse's resolver, through the official SDK: every sandbox's DNS, to
whatever server it names, lands at one resolver per network on the host.
It answers an air-gapped sandbox's allowed names only (NXDOMAIN for the
rest), answers the operator's static names (`--egress-hosts-file`) from its
table, and forwards other names to the sandbox's `dns_servers` (when
`allow_out` names hosts) or to the host's resolvers.

Test hosts: the `web` network namespace of test_egress_proxy
(203.0.113.0/24), where a dnsmasq serves as a tenant's DNS server. Only
names in the static table or in dnsmasq's are ever asked for, so no query
leaves this machine.
"""

import os
import socket
import subprocess
import time

import pytest
from e2b import InvalidArgumentException, Sandbox, SandboxException
from test_egress_proxy import OTHER, WEB, hosts_gateway, web  # noqa: F401 (a fixture)

HOSTS = f"{WEB} allowed.test denied.test\n"
# The host's own address on the web veth: where dnsmasq's rebinding answer
# points.
HOST_ADDR = "203.0.113.1"
# Nothing listens here: a query to it is answered by copse or by no one.
NOWHERE = "192.0.2.1"

# A DNS query from inside the sandbox, by hand (UDP or TCP) to any server;
# prints the response code, the answer count and the last answer's address.
QUERY = r"""
import random, socket, struct, sys
server, name, proto = sys.argv[1], sys.argv[2], sys.argv[3]
qid = random.randrange(65536)
q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
q += b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0" + struct.pack(">HH", 1, 1)
try:
    if proto == "tcp":
        s = socket.create_connection((server, 53), timeout=3)
        s.sendall(struct.pack(">H", len(q)) + q)
        data = b""
        while len(data) < 2 or len(data) < 2 + struct.unpack(">H", data[:2])[0]:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        r = data[2:]
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(3)
        s.sendto(q, (server, 53))
        r = s.recv(4096)
except OSError as e:
    print("error", type(e).__name__)
    sys.exit(0)
rid, flags, _, an = struct.unpack(">HHHH", r[:8])
assert rid == qid, "another query's answer"
print(flags & 0xF, an, socket.inet_ntoa(r[-4:]) if an else "-")
"""


def query(sbx, name: str, server: str = NOWHERE, proto: str = "udp") -> tuple:
    """(rcode, answer count, address) of a query the sandbox sends itself,
    or ("error", kind) when no answer came."""
    if not sbx.files.exists("/tmp/query.py"):
        sbx.files.write("/tmp/query.py", QUERY)
    out = sbx.commands.run(f"python3 /tmp/query.py {server} {name} {proto}", timeout=20).stdout.split()
    return (int(out[0]), int(out[1]), out[2]) if out[0] != "error" else tuple(out)


def resolve(sbx, name: str) -> str:
    """The first IPv4 address the sandbox's own resolver library finds, or ''."""
    out = sbx.commands.run(f"getent ahostsv4 {name} || true", timeout=20).stdout.split()
    return out[0] if out else ""


@pytest.fixture(scope="module")
def dns_gateway(gateway, web):  # noqa: F811 (the imported fixture)
    """A gateway with the test names in its static table; yields the SDK's
    connection arguments."""
    with hosts_gateway("dns", "d", 102, HOSTS) as (env, _):
        yield env


@pytest.fixture(scope="module")
def tenant_dns(web):  # noqa: F811 (the imported fixture)
    """A dnsmasq at WEB that knows fwd.test (-> OTHER) and rebind.test (->
    the host's own address), and nothing else (no upstream)."""
    proc = subprocess.Popen(["ip", "netns", "exec", web, "dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null",
                             "--no-resolv", "--no-hosts", "--pid-file=", "--bind-interfaces", f"--listen-address={WEB}",
                             "--port=53", f"--address=/fwd.test/{OTHER}", f"--address=/rebind.test/{HOST_ADDR}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.settimeout(0.2)
                # A bare header with no question: dnsmasq answers FORMERR.
                s.sendto(b"\x00\x01\x01\x00" + b"\x00" * 8, (WEB, 53))
                try:
                    s.recv(512)
                    break
                except OSError:
                    continue
        else:
            raise RuntimeError("dnsmasq did not start")
        yield WEB
    finally:
        proc.kill()
        proc.wait()


def air_gapped(allow, **network):
    return {"allow_out": allow, "deny_out": ["0.0.0.0/0"], **network}


def test_an_allow_list_resolves_its_names_only_whatever_server_is_asked(dns_gateway):
    sbx = Sandbox.create(template="base", network=air_gapped(["allowed.test"]), **dns_gateway)
    try:
        assert resolve(sbx, "allowed.test") == WEB
        assert resolve(sbx, "denied.test") == "", "a name off the allow-list resolved"
        # The sandbox names a server of its own: the answer is still copse's.
        for proto in ("udp", "tcp"):
            assert query(sbx, "allowed.test", NOWHERE, proto) == (0, 1, WEB), proto
            assert query(sbx, "denied.test", NOWHERE, proto) == (3, 0, "-"), proto
        assert query(sbx, "denied.test", "8.8.8.8") == (3, 0, "-")
    finally:
        sbx.kill()


def test_without_an_allow_list_names_resolve(dns_gateway):
    # allow_out alone denies nothing in E2B, so it filters no name either.
    for network in ({}, {"allow_out": ["allowed.test"]}):
        sbx = Sandbox.create(template="base", network=network, **dns_gateway)
        try:
            assert resolve(sbx, "denied.test") == WEB, network
            assert query(sbx, "allowed.test") == (0, 1, WEB), network
        finally:
            sbx.kill()


def test_a_deny_out_name_does_not_resolve(dns_gateway):
    sbx = Sandbox.create(template="base", network={"deny_out": ["denied.test"]}, **dns_gateway)
    try:
        assert query(sbx, "denied.test") == (3, 0, "-")
        assert resolve(sbx, "allowed.test") == WEB
    finally:
        sbx.kill()


def test_allowed_names_are_forwarded_to_the_sandboxes_dns_servers(dns_gateway, tenant_dns):
    sbx = Sandbox.create(template="base", network=air_gapped(["fwd.test"], dns_servers=[tenant_dns]), **dns_gateway)
    try:
        assert resolve(sbx, "fwd.test") == OTHER
        assert sbx.get_info().network["dns_servers"] == [tenant_dns]
        # No DNS server: allowed names outside the static table are refused.
        sbx.update_network(air_gapped(["fwd.test"], dns_servers=[]))
        assert query(sbx, "fwd.test") == (5, 0, "-")
        assert sbx.get_info().network["dns_servers"] == []
        # Left out: the default again, which info leaves out too.
        sbx.update_network(air_gapped(["fwd.test"]))
        assert "dns_servers" not in sbx.get_info().network
    finally:
        sbx.kill()


def test_bad_dns_servers_are_refused(dns_gateway):
    for servers in (["not-an-address"], ["2001:db8::53"], [f"192.0.2.{i}" for i in range(1, 12)]):
        with pytest.raises((InvalidArgumentException, SandboxException)) as refused:
            Sandbox.create(template="base", network=air_gapped(["allowed.test"], dns_servers=servers), **dns_gateway)
        assert "DNS server" in str(refused.value), servers
