"""Sandbox networking (cubenet), through the official SDK: egress policies,
isolation between sandboxes and from the host, and clean teardown.

The "internet" is a network namespace this module creates: a veth routed
from the host to 198.51.100.0/24, with an HTTP server on two addresses.
Probes that need privileges the sandbox user lacks (ICMP, raw UDP checks)
run from the host *inside the sandbox's network namespace* (nsenter), so
they take exactly the sandbox's path through the bridge and the rules.
"""

import contextlib
import ipaddress
import os
import socket
import subprocess
import time

import pytest
from e2b import Sandbox

import leakcheck
from conftest import BRIDGE, DATA_DIR, SUBNET, netns_host_names, remove_netns_host

INTERNET = "198.51.100.10"
OTHER = "198.51.100.20"
PORT = 8080
HOST_ADDR = str(next(ipaddress.ip_network(SUBNET).hosts()))

SERVER = """
import http.server, socketserver
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"internet"
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
socketserver.ThreadingTCPServer.allow_reuse_address = True
socketserver.ThreadingTCPServer(("0.0.0.0", %d), H).serve_forever()
""" % PORT


def sh(*args, check=True):
    return subprocess.run(args, check=check, capture_output=True, text=True)


@pytest.fixture(scope="module")
def internet():
    ns, veth = netns_host_names("inet")
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "addr", "add", "198.51.100.1/24", "dev", veth)
        sh("ip", "link", "set", veth, "up")
        for addr in (INTERNET, OTHER):
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "route", "add", "default", "via", "198.51.100.1")
        server = subprocess.Popen(["ip", "netns", "exec", ns, "python3", "-c", SERVER])
        deadline = time.monotonic() + 10
        while not _tcp_ok(INTERNET, PORT) and time.monotonic() < deadline:
            time.sleep(0.05)
        yield ns
        server.kill()
        server.wait()
    finally:
        remove_netns_host(ns, veth)


def _tcp_ok(host, port, timeout=1.0):
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
        return True
    return False


def reaches(sbx, addr, port=PORT) -> bool:
    """An HTTP GET from inside the sandbox, as its user."""
    result = sbx.commands.run(
        f"curl -s -o /dev/null -w '%{{http_code}}' --connect-timeout 2 -m 3 http://{addr}:{port}/ || true"
    )
    return result.stdout.strip() == "200"


def netns_pid(sandbox_id: str) -> int:
    """A process of the sandbox, to enter its network namespace."""
    for (subtree, sid), dirs in leakcheck.cgroup_dirs().items():
        if sid == sandbox_id and subtree == leakcheck.subtree_for(DATA_DIR):
            for d in dirs:
                pids = (d / "cgroup.procs").read_text().split()
                if pids:
                    return int(pids[0])
    raise AssertionError(f"no process of {sandbox_id}")


PROBE = """
import socket, subprocess, sys
kind, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
source = (sys.argv[4], 0) if len(sys.argv) > 4 else None
try:
    if kind == "tcp":
        socket.create_connection((addr, port), timeout=2, source_address=source).close()
    elif kind == "udp":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
        s.sendto(b"ping", (addr, port)); s.recvfrom(16)
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); s.settimeout(2)
        s.sendto(bytes([8, 0, 0xf7, 0xff, 0, 0, 0, 0]), (addr, 0))
        while True:
            data, peer = s.recvfrom(64)
            if peer[0] == addr and data[20] == 0:
                break
    print("reached")
except OSError as e:
    print("blocked", e)
"""


def probe_from(sandbox_id: str, kind: str, addr: str, port: int = 0, source: str = "") -> bool:
    """TCP connect (from `source` if given), UDP echo or ICMP echo from the
    sandbox's netns."""
    args = [kind, addr, str(port)] + ([source] if source else [])
    out = sh("nsenter", f"--net=/proc/{netns_pid(sandbox_id)}/ns/net", "python3", "-c", PROBE, *args)
    return out.stdout.startswith("reached")


def sandbox_addr(sbx) -> str:
    # A UDP "connect" only looks the route up: the source it picks is eth0's.
    out = sbx.commands.run(
        "python3 -c \"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
        f"s.connect(('{INTERNET}', 9)); print(s.getsockname()[0])\""
    )
    return out.stdout.strip()


def test_default_egress_works_and_update_network_flips_it(gateway, internet):
    sbx = Sandbox.create(template="base")
    try:
        assert reaches(sbx, INTERNET)
        sbx.update_network({"deny_out": [f"{INTERNET}/32"]})
        assert not reaches(sbx, INTERNET), "a denied address is still reachable right after update_network"
        assert reaches(sbx, OTHER), "the deny list blocked more than it lists"
        sbx.update_network({})
        assert reaches(sbx, INTERNET), "clearing the rules did not restore egress"
        assert sbx.get_info().allow_internet_access
    finally:
        sbx.kill()


def test_no_internet_access_blocks_egress_and_an_allow_list_admits_only_its_targets(gateway, internet):
    closed = Sandbox.create(template="base", allow_internet_access=False)
    only = Sandbox.create(template="base", network={"allow_out": [OTHER], "deny_out": ["0.0.0.0/0"]})
    try:
        assert not closed.get_info().allow_internet_access
        assert not reaches(closed, INTERNET)
        assert reaches(only, OTHER)
        assert not reaches(only, INTERNET)
        closed.update_network({"allow_internet_access": True})
        assert reaches(closed, INTERNET)
    finally:
        closed.kill()
        only.kill()


def test_bad_network_rules_are_refused_with_e2b_errors(gateway):
    from e2b.exceptions import InvalidArgumentException, SandboxException

    with pytest.raises((InvalidArgumentException, SandboxException)) as err:
        Sandbox.create(template="base", network={"deny_out": ["10.0.0.0/33"]})
    assert "deny_out" in str(err.value)


def test_tightening_cuts_an_open_connection(gateway, internet):
    sbx = Sandbox.create(template="base")
    try:
        # One keep-alive connection, one request every 100 ms, printing
        # each outcome; the policy changes while it runs.
        script = (
            "import http.client, time\n"
            f"c = http.client.HTTPConnection('{INTERNET}', {PORT}, timeout=1)\n"
            "for i in range(40):\n"
            "    try:\n"
            "        c.request('GET', '/'); r = c.getresponse(); r.read(); print('ok', flush=True)\n"
            "    except Exception as e:\n"
            "        print('fail', flush=True); break\n"
            "    time.sleep(0.1)\n"
        )
        sbx.files.write("/tmp/loop.py", script)
        handle = sbx.commands.run("python3 /tmp/loop.py", background=True)
        time.sleep(1.0)
        sbx.update_network({"allow_internet_access": False})
        result = handle.wait()
        lines = result.stdout.split()
        assert "ok" in lines and lines[-1] == "fail", f"the open connection survived tightening: {lines}"
    finally:
        sbx.kill()


def test_sandboxes_cannot_reach_each_other_or_the_host(gateway, internet):
    a = Sandbox.create(template="base")
    b = Sandbox.create(template="base")
    listener = socket.create_server(("0.0.0.0", 0))
    try:
        b_addr = sandbox_addr(b)
        assert ipaddress.ip_address(b_addr) in ipaddress.ip_network(SUBNET)
        b.commands.run(
            "python3 -c \"import socket,threading\n"
            "u=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); u.bind(('0.0.0.0',9001))\n"
            "t=socket.create_server(('0.0.0.0',9000))\n"
            "threading.Thread(target=lambda: [t.accept() for _ in iter(int,1)], daemon=True).start()\n"
            "while True:\n    d,p=u.recvfrom(16); u.sendto(d,p)\" >/dev/null 2>&1",
            background=True,
        )
        # The listeners answer in B's own namespace: the probes can succeed.
        deadline = time.monotonic() + 5
        while not probe_from(b.sandbox_id, "tcp", b_addr, 9000) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert probe_from(b.sandbox_id, "udp", b_addr, 9001)
        assert probe_from(a.sandbox_id, "icmp", INTERNET), "ICMP egress to the internet should work"

        for kind, port in (("tcp", 9000), ("udp", 9001), ("icmp", 0)):
            assert not probe_from(a.sandbox_id, kind, b_addr, port), f"sandbox A reached B over {kind}"

        # The host: the bridge address, a service on all interfaces, the gateway.
        host_port = listener.getsockname()[1]
        assert _tcp_ok(HOST_ADDR, host_port), "the host listener should answer the host"
        assert not reaches(a, HOST_ADDR, host_port)
        assert not reaches(a, HOST_ADDR, gateway.port)
        assert not probe_from(a.sandbox_id, "icmp", HOST_ADDR)
        assert not probe_from(a.sandbox_id, "tcp", "169.254.169.254", 80)

        # Spoofing: even root in A's namespace cannot send as B.
        a_ns = f"--net=/proc/{netns_pid(a.sandbox_id)}/ns/net"
        sh("nsenter", a_ns, "ip", "addr", "add", f"{b_addr}/32", "dev", "eth0")
        assert probe_from(a.sandbox_id, "tcp", INTERNET, PORT), "A's own address should still work"
        assert not probe_from(a.sandbox_id, "tcp", INTERNET, PORT, source=b_addr), "A sent packets as B"
    finally:
        listener.close()
        a.kill()
        b.kill()
    # Teardown finishes after the kill answered: rules are removed in the
    # background and each veth goes with its sandbox's namespace.
    live = set(s.sandbox_id for s in Sandbox.list().next_items())
    deadline = time.monotonic() + 5
    while (leaks := leakcheck.network_leaks(BRIDGE, live)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leaks == []


# The host's neighbourhood: a private-range host and a metadata-like one, in
# a network namespace routed from the host like any LAN or link-local peer.
PRIVATE = "192.168.237.10"
METADATA = "169.254.169.254"


@pytest.fixture(scope="module")
def neighbours():
    ns, veth = netns_host_names("lan")
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "addr", "add", "192.168.237.1/24", "dev", veth)
        sh("ip", "link", "set", veth, "up")
        sh("ip", "-n", ns, "addr", "add", f"{PRIVATE}/24", "dev", "eth0")
        sh("ip", "-n", ns, "addr", "add", f"{METADATA}/32", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "route", "add", "default", "via", "192.168.237.1")
        sh("ip", "route", "add", f"{METADATA}/32", "via", PRIVATE)
        server = subprocess.Popen(["ip", "netns", "exec", ns, "python3", "-c", SERVER])
        deadline = time.monotonic() + 10
        while not (_tcp_ok(PRIVATE, PORT) and _tcp_ok(METADATA, PORT)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _tcp_ok(METADATA, PORT), "the host cannot reach its own metadata-like neighbour"
        yield ns
        server.kill()
        server.wait()
    finally:
        sh("ip", "route", "del", f"{METADATA}/32", check=False)
        remove_netns_host(ns, veth)


def test_the_hosts_neighbourhood_is_unreachable_and_no_tenant_policy_reopens_it(gateway, internet, neighbours):
    """Private ranges and link-local metadata are blocked by default; a
    tenant's explicit allow_out of them is not honoured (the operator's
    protection is not the tenant's to lift), while the internet stays
    reachable."""
    open_ = Sandbox.create(template="base")
    asking = Sandbox.create(template="base", network={"allow_out": [PRIVATE, METADATA, INTERNET],
                                                       "deny_out": ["0.0.0.0/0"]})
    try:
        assert reaches(open_, INTERNET)
        for sbx in (open_, asking):
            for addr in (PRIVATE, METADATA):
                assert not reaches(sbx, addr), f"{addr} is reachable from {sbx.sandbox_id}"
                assert not probe_from(sbx.sandbox_id, "tcp", addr, PORT), f"root reaches {addr}"
        assert reaches(asking, INTERNET), "the tenant's allow list admits its public target"
    finally:
        open_.kill()
        asking.kill()


def test_an_operator_opens_neighbourhood_ranges_and_tenant_policies_still_apply(gateway, internet, neighbours):
    """`copse up --allow-egress-range` opens a range to every sandbox of that
    gateway; each sandbox's own policy still narrows it."""
    from conftest import Gateway, second_data_dir

    data_dir = second_data_dir("opened")
    other = Gateway(data_dir)
    second = ipaddress.ip_network(SUBNET).network_address.packed[1]
    bridge = f"{BRIDGE[:9]}o"
    other.start(extra_args=["--bridge", bridge, "--subnet", f"10.{(second + 100) % 256}.0.0/16",
                            "--allow-egress-range", "192.168.237.0/24", "--allow-egress-range", METADATA])
    env = dict(api_key=os.environ["E2B_API_KEY"], api_url=other.url, sandbox_url=other.url)
    try:
        opened = Sandbox.create(template="base", **env)
        closed = Sandbox.create(template="base", allow_internet_access=False, **env)
        try:
            assert reaches(opened, PRIVATE) and reaches(opened, METADATA)
            assert not reaches(closed, PRIVATE) and not reaches(closed, METADATA)
            opened.update_network({"deny_out": [f"{METADATA}/32"]})
            assert not reaches(opened, METADATA) and reaches(opened, PRIVATE)
        finally:
            opened.kill()
            closed.kill()
    finally:
        other.stop()
        # A gateway keeps its bridge and table across restarts; this one's
        # network goes with the test.
        subprocess.run(["nft", "delete", "table", "inet", f"copse_{bridge}"], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def test_dns_servers_are_reachable_on_port_53_only(gateway, internet):
    """A caller's DNS server is admitted for DNS, not as a way to name any
    host: its other ports stay closed under an air-gapped policy. (Port 53
    itself lands at copse's resolver, which forwards there: test_dns.py.)"""
    listener = subprocess.Popen(["ip", "netns", "exec", internet, "python3", "-c",
                                 "import socket, time\ns = socket.create_server(('0.0.0.0', 53))\n"
                                 "while True: s.accept()[0].close()"])
    sbx = Sandbox.create(template="base", network={"allow_out": ["localhost"], "deny_out": ["0.0.0.0/0"],
                                                    "dns_servers": [INTERNET]})
    try:
        deadline = time.monotonic() + 10
        while not _tcp_ok(INTERNET, 53) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert probe_from(sbx.sandbox_id, "tcp", INTERNET, 53), "the DNS server is not reachable on port 53"
        assert not reaches(sbx, INTERNET), "the DNS server is reachable on a port other than 53"
        assert not reaches(sbx, OTHER)
    finally:
        sbx.kill()
        listener.kill()
        listener.wait()


def test_a_fork_of_an_air_gapped_sandbox_is_blocked_from_its_first_instant(gateway, internet):
    """A process connecting in a loop since before the snapshot never gets
    through in a fork: the fork's rules are in place before its restored
    processes can send a packet."""
    source = Sandbox.create(template="base", allow_internet_access=False, timeout=120)
    children = []
    try:
        # One long-lived process whose sockets live for microseconds (a
        # refused connect fails at once), so the snapshot rarely meets one.
        probe = (f"import socket, time\nwhile True:\n"
                 f"    try:\n        socket.create_connection(('{INTERNET}', {PORT}), timeout=1).close(); r = '200'\n"
                 f"    except OSError:\n        r = 'blocked'\n"
                 f"    with open('/tmp/probe.log', 'a') as f: f.write(r + '\\n')\n"
                 f"    time.sleep(0.5)\n")
        source.files.write("/tmp/probe.py", probe)
        source.commands.run("python3 /tmp/probe.py", background=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if source.files.exists("/tmp/probe.log") and source.files.read("/tmp/probe.log").strip():
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the probe loop is not running")
        children = [c for c in source.fork(count=1, timeout=60) if isinstance(c, Sandbox)]
        assert len(children) == 1
        child = children[0]
        before = len(child.files.read("/tmp/probe.log").splitlines())
        time.sleep(2)
        log = child.files.read("/tmp/probe.log").splitlines()
        assert len(log) > before, "the probe loop did not carry into the fork"
        assert "200" not in log, "a restored process reached the internet"
        # The probe itself works: opening the fork lets it through.
        child.update_network({"allow_internet_access": True})
        deadline = time.monotonic() + 10
        while "200" not in child.files.read("/tmp/probe.log").splitlines() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "200" in child.files.read("/tmp/probe.log").splitlines()
    finally:
        for sbx in [source, *children]:
            sbx.kill()


def test_a_second_gateway_on_a_bridge_in_use_is_refused_and_leaves_the_first_ones_sandboxes_alone(gateway):
    """Starting, a gateway rewrites its bridge's table for its own sandboxes
    and deletes the veths of any others: on a bridge another live gateway
    drives, that would cut every one of its sandboxes off."""
    from conftest import Gateway, second_data_dir

    sandbox = Sandbox.create(template="base")
    try:
        links = "ls /sys/class/net"
        before = sandbox.commands.run(links).stdout.split()
        assert [name for name in before if name != "lo"]
        intruder = Gateway(second_data_dir("intruder"))
        with pytest.raises(RuntimeError, match="exited"):
            intruder.start()
        assert f"bridge {BRIDGE} is in use by another copse process" in (
            intruder.data_dir / "gateway.log").read_text()
        assert sandbox.commands.run(links).stdout.split() == before
    finally:
        sandbox.kill()
