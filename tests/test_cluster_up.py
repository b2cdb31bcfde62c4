"""`scripts/cluster up|down` (`mise run cluster:up|down`): three nodes, each
`copse up` in a network namespace of its own, and two API fronts (`copse up
--no-sandboxes`, namespaces of their own too), on the PostgreSQL and
SeaweedFS the script starts. With the environment `up` prints (the fronts
are its gateways), the SDK's creates spread over the nodes, even a burst
through one gateway, and each sandbox is reached through either gateway;
`down` leaves nothing behind, even after a node was killed with -9."""

import os
import pathlib
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from e2b import Sandbox

from cluster_script import Cluster, cluster_up
from leakcheck import CGROUP_ROOT, subtree_for

HEARTBEAT_S = 2  # placement reads heartbeats


@pytest.fixture(scope="module")
def cluster():
    with cluster_up("copsetcl", "172.30.78", nodes=3) as three:
        yield three


def node_of(sbx: Sandbox) -> int:
    """Which node runs the sandbox: node N gives addresses from 10.(160+N)/16."""
    address = sbx.commands.run("hostname -I", timeout=10).stdout.split()[0]
    return int(address.split(".")[1]) - 160


def test_a_burst_of_creates_spreads_over_the_nodes_and_each_is_reached_through_either_gateway(cluster):
    """Three creates at once through one gateway, between two heartbeats:
    the gateway counts what it sent each node since its last heartbeat, so
    they land on three nodes, not where the last heartbeat showed room."""
    first, second = cluster.gateways
    assert cluster.gateways == [f"http://{cluster.front_address(n)}:3000" for n in (1, 2)]
    time.sleep(HEARTBEAT_S + 1)  # every node has reported its templates
    sandboxes = []
    try:
        with ThreadPoolExecutor(3) as pool:
            for made in pool.map(lambda _: Sandbox.create(timeout=120, **cluster.via(first)), range(3)):
                sandboxes.append(made)
        assert sorted(node_of(s) for s in sandboxes) == [1, 2, 3]
        for sbx in sandboxes:
            for gateway in (first, second):
                again = Sandbox.connect(sbx.sandbox_id, **cluster.via(gateway))
                assert again.commands.run(f"echo {sbx.sandbox_id}").stdout.strip() == sbx.sandbox_id
                again.files.write("/tmp/through", gateway)
                assert sbx.files.read("/tmp/through") == gateway
    finally:
        for sbx in sandboxes:
            sbx.kill()


def test_down_leaves_nothing_behind_after_a_node_was_killed(cluster):
    sbx = Sandbox.create(timeout=120, **cluster.via(cluster.gateways[0]))
    sbx.commands.run("sleep 4343", background=True)
    os.kill(cluster.node_pid(node_of(sbx)), signal.SIGKILL)
    time.sleep(0.5)
    assert leftovers(cluster, "sleep 4343"), "the killed node's sandbox runs on"
    subtrees = [subtree_for(cluster.dir / f"node{n}") for n in range(1, cluster.nodes + 1)]

    cluster.down()

    assert not cluster.dir.exists()
    assert cluster.namespaces() == []
    assert not cluster.host_link_exists()
    mounts = pathlib.Path("/proc/self/mounts").read_text()
    assert str(cluster.dir) not in mounts
    assert not [p for s in subtrees for p in [*CGROUP_ROOT.glob(s), *CGROUP_ROOT.glob(f"*/{s}")]]
    assert leftovers(cluster, "sleep 4343") == []


def leftovers(cluster: Cluster, sandbox_command: str) -> list[str]:
    """Processes of the cluster: a sandbox's, its servers' and its nodes'."""
    found = []
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            command = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # ended meanwhile
        if sandbox_command in command or str(cluster.dir) in command:
            found.append(command)
    return found
