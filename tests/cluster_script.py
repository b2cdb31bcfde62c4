"""A cluster started by the project's own `scripts/cluster` (what `mise run
cluster:up|down` runs): nodes in network namespaces of their own, with the
PostgreSQL and SeaweedFS the script starts. Named apart from a cluster an
operator may run on the same host (its own state dir, namespaces, bridge
and link subnet)."""

import contextlib
import os
import re
import subprocess

from conftest import COPSE, DATA_DIR, ROOT

SCRIPT = ROOT / "scripts" / "cluster"


class Cluster:
    def __init__(self, name: str, net: str, nodes: int):
        self.name, self.net, self.nodes = name, net, nodes
        self.dir = DATA_DIR / name
        self.settings = dict(COPSE_CLUSTER_DIR=str(self.dir), COPSE_CLUSTER_NAME=name, COPSE_CLUSTER_NET=net,
                             COPSE_CLUSTER_NODES=str(nodes), COPSE_CLUSTER_TEMPLATES=str(DATA_DIR / "templates"),
                             COPSE_BIN=str(COPSE))
        self.env: dict[str, str] = {}

    def run(self, command: str) -> subprocess.CompletedProcess:
        done = subprocess.run([str(SCRIPT), command], env=dict(os.environ, **self.settings), capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, f"scripts/cluster {command}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done

    def up(self):
        subprocess.run([str(COPSE), "template", "build", "--data-dir", str(DATA_DIR)], check=True)
        self.run("down")  # what an interrupted earlier run left
        try:
            printed = self.run("up").stdout
        except BaseException:
            self.run("down")
            raise
        self.env = dict(re.findall(r"^([A-Z0-9_]+)=(.*)$", printed, re.M))
        assert {"E2B_API_URL", "E2B_API_KEY", "COPSE_GATEWAYS", "COPSE_DATABASE"} <= self.env.keys(), printed

    def down(self):
        self.run("down")

    @property
    def gateways(self) -> list[str]:
        return self.env["COPSE_GATEWAYS"].split(",")

    def via(self, gateway: str) -> dict:
        """Sandbox.create/connect arguments for one of the gateways."""
        return dict(api_key=self.env["E2B_API_KEY"], api_url=gateway, sandbox_url=gateway)

    def node_address(self, n: int) -> str:
        return f"{self.net}.{10 + n}"

    def front_address(self, n: int) -> str:
        return f"{self.net}.{20 + n}"

    def node_pid(self, n: int) -> int:
        return int((self.dir / f"node{n}.pid").read_text())

    def namespaces(self) -> list[str]:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        return [line.split()[0] for line in listed.splitlines()
                if line.startswith((f"{self.name}-node", f"{self.name}-front"))]

    def host_link_exists(self) -> bool:
        return subprocess.run(["ip", "link", "show", self.name], capture_output=True).returncode == 0


@contextlib.contextmanager
def cluster_up(name: str, net: str, nodes: int):
    """A cluster up for the block, down after it whatever happened."""
    cluster = Cluster(name, net, nodes)
    cluster.up()
    try:
        yield cluster
    finally:
        cluster.down()


def reachable(sbx, host: str, port: int) -> bool:
    """Whether a TCP connection from inside the sandbox to host:port opens."""
    probe = sbx.commands.run(f"timeout 3 bash -c 'echo > /dev/tcp/{host}/{port}' && echo open || echo closed",
                             timeout=10)
    return probe.stdout.strip() == "open"

