"""Two gateways on one PostgreSQL (`copse up --database`), each a node with
its own data dir, bridge and subnet, forwarding to each other over the
cluster's mutual TLS: the SDK may talk to either about any sandbox, creates
are placed by room, one gateway's start, stop or crash never touches the
other's sandboxes, a node that stops heartbeating is reported lost, and a
drained node takes no new sandboxes. The nodes share an object store
(SeaweedFS): a snapshot moves through it to a node other than its own."""

import contextlib
import hashlib
import json
import pathlib
import io
import re
import secrets
import socket
import tarfile
import subprocess
import threading
import time

import httpx
import pytest
from e2b import RateLimitException, Sandbox, Template, Volume

from conftest import API_KEY, BRIDGE, COPSE, DATA_DIR, SUBNET, Gateway, free_port, second_data_dir
from object_store import object_store  # noqa: F401 (a fixture, used by name)
from oci_registry import Registry, layer, oci_layout, push, tiny_root, tree_members
from postgres_server import database_server, database_url  # noqa: F401 (fixtures, used by name)
from test_lifecycle import holders_digest, pagers, start_holder
from test_templates import build_logged, cached_steps, run_steps

LOST_AFTER_S = 10  # model/node.rs
HEARTBEAT_S = 2
NODE_TABLE_TTL_S = 0.5  # service/nodes.rs: a drain is seen this much later at most


def node_network(n: int) -> tuple[str, str]:
    return f"{BRIDGE[:9]}{n}", f"10.{(int(SUBNET.split('.')[1]) + 120 + 10 * n) % 256}.0.0/16"


def cluster_ca(directory) -> str:
    """A new cluster CA in `directory` (`copse tls cluster-ca`)."""
    subprocess.run([str(COPSE), "tls", "cluster-ca", "--out", str(directory)], check=True, capture_output=True)
    return str(directory)


def node_cert(ca: str, out) -> str:
    """A node certificate for 127.0.0.1 signed by `ca`, in `out`."""
    subprocess.run([str(COPSE), "tls", "node-cert", "--ca", ca, "--host", "127.0.0.1", "--out", str(out)],
                   check=True, capture_output=True)
    return str(out)


class Node(Gateway):
    def __init__(self, n: int, database: str, ca: str, objects):
        super().__init__(second_data_dir(f"node{n}"))
        self.bridge, subnet = node_network(n)
        self.ca = ca
        self.tls = node_cert(ca, self.data_dir / "cluster-tls")
        self.peer_port = free_port()
        self.args = ["--database", database, "--bridge", self.bridge, "--subnet", subnet,
                     "--cluster-tls", self.tls, "--cluster-listen", f"127.0.0.1:{self.peer_port}"]
        self.objects = objects

    def up(self):
        # The object store's URL and keys reach it in its environment.
        self.start(extra_args=self.args, env=self.objects.env())

    @property
    def id(self) -> str:
        return (self.data_dir / "node-id").read_text().strip()

    def env(self, api_key: str = API_KEY) -> dict:
        return dict(api_key=api_key, api_url=self.url, sandbox_url=self.url)

    def holds(self, sandbox_id: str) -> bool:
        return (self.data_dir / "sandboxes" / sandbox_id).exists()


# The nodes' private registry (`private.test`), for templates built from
# images: its login is the build's, never the nodes'.
REGISTRY_LOGIN = ("cluster", f"pw-{secrets.token_hex(8)}")


@pytest.fixture(scope="module")
def nodes(database_url, object_store, tmp_path_factory):
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(COPSE), "template", "build", "--data-dir", str(DATA_DIR)], check=True)
    work = tmp_path_factory.mktemp("cluster")
    ca = cluster_ca(work / "ca")
    registry = Registry(work / "registry", login=REGISTRY_LOGIN)
    pair = [Node(1, database_url, ca, object_store), Node(2, database_url, ca, object_store)]
    for node in pair:
        node.args += ["--registry-mirror", f"private.test=http://{registry.host}"]
        node.registry, node.work = registry, work
        node.up()
    yield pair
    registry.close()
    for node in pair:
        node.stop()
        subprocess.run(["nft", "delete", "table", "inet", f"copse_{node.bridge}"], capture_output=True)
        subprocess.run(["ip", "link", "del", node.bridge], capture_output=True)


def node_table(database: str) -> dict[str, str]:
    """`copse node ls`: each node's status."""
    out = subprocess.run([str(COPSE), "node", "ls", "--database", database],
                         check=True, capture_output=True, text=True).stdout
    return {m[1]: m[2] for m in re.finditer(r"^([a-z0-9]{20})\s+(\w+)", out, re.M)}


def create_after_heartbeat(via: Node, api_key: str = API_KEY) -> Sandbox:
    """A create once every node has reported the last one (placement reads
    heartbeats)."""
    time.sleep(HEARTBEAT_S + 1)
    return Sandbox.create(timeout=300, **via.env(api_key))


def drain(node: Node, database: str, draining: bool = True):
    subprocess.run([str(COPSE), "node", "drain" if draining else "undrain", node.id, "--database", database],
                   check=True)


def create_on(target: Node, nodes: list[Node], database: str, via: Node, api_key: str = API_KEY) -> Sandbox:
    """A sandbox placed on `target` (the others drained meanwhile), the
    create sent through `via`'s gateway."""
    others = [n for n in nodes if n is not target]
    for node in others:
        drain(node, database)
    try:
        sbx = create_after_heartbeat(via, api_key)
    finally:
        for node in others:
            drain(node, database, False)
    assert target.holds(sbx.sandbox_id)
    return sbx


def test_either_gateway_reaches_every_sandbox_and_creates_spread_by_room(nodes, database_url):
    one, two = nodes
    assert node_table(database_url) == {one.id: "active", two.id: "active"}
    made = []
    try:
        for via in (one, one, two, two):
            made.append(create_after_heartbeat(via))
        where = [(one.holds(s.sandbox_id), two.holds(s.sandbox_id)) for s in made]
        assert all(a != b for a, b in where), f"each sandbox is on exactly one node: {where}"
        assert sum(a for a, _ in where) == 2, f"the node with fewer sandboxes takes the next: {where}"
        for sbx in made:
            for via in nodes:
                again = Sandbox.connect(sbx.sandbox_id, **via.env())
                out = again.commands.run(f"echo {sbx.sandbox_id} > /tmp/at && cat /tmp/at")
                assert out.stdout.split()[0] == sbx.sandbox_id
                assert again.get_info().sandbox_id == sbx.sandbox_id
        listed = {s.sandbox_id for s in Sandbox.list(**two.env()).next_items()}
        assert {s.sandbox_id for s in made} <= listed, "one database: every gateway lists every sandbox"
        # A kill through the other gateway reaches the sandbox's own host.
        first = made.pop(0)
        holder, other = (one, two) if one.holds(first.sandbox_id) else (two, one)
        Sandbox.kill(first.sandbox_id, **other.env())
        assert not holder.holds(first.sandbox_id)
    finally:
        for sbx in made:
            sbx.kill()


def test_a_gateways_restart_leaves_the_other_nodes_sandboxes_alone(nodes, database_url):
    one, two = nodes
    kept = create_on(one, nodes, database_url, via=one)
    try:
        kept.files.write("/home/user/note", "on node one")
        # Before nodes, this stop killed every sandbox in the database and
        # the start forgot the ones its host did not have.
        two.stop()
        two.up()
        again = Sandbox.connect(kept.sandbox_id, **two.env())
        assert again.files.read("/home/user/note") == "on node one"
        assert kept.sandbox_id in {s.sandbox_id for s in Sandbox.list(**one.env()).next_items()}
    finally:
        kept.kill()



def listed(via: Node) -> set[str]:
    """Every sandbox id the API lists, page by page."""
    pages, ids = Sandbox.list(limit=100, **via.env()), set()
    while pages.has_next:
        ids |= {s.sandbox_id for s in pages.next_items()}
    return ids


def test_a_database_and_a_gateway_restarted_mid_load_lose_no_record_and_leave_no_stray(nodes, database_server):
    """Creates keep coming through node two while PostgreSQL restarts
    (every connection cut) and node one's gateway is killed with -9 and
    started again. Creates may fail meanwhile, with an error; every create
    that answered has its record (a dozen of them, spread over the run, are
    used through each gateway), and no sandbox on either host is without a
    record."""
    one, two = nodes
    before = listed(two)
    made, failed, stop = [], [], threading.Event()

    def load():
        while not stop.is_set():
            try:
                made.append(Sandbox.create(timeout=300, **two.env()).sandbox_id)
            except Exception as e:  # the restarts' window: refused, never half-made
                failed.append(str(e))
            time.sleep(0.2)  # steady load, not a flood: each sandbox is checked after

    workers = [threading.Thread(target=load) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        time.sleep(3)
        database_server.restart()
        time.sleep(2)
        one.crash()
        one.up()
        time.sleep(3)
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=120)
    now = listed(two)
    try:
        assert len(made) == len(set(made)) >= 4, (made, failed)
        assert set(made) <= now, f"answered creates without a record: {set(made) - now}"
        for sandbox_id in made[:: max(1, len(made) // 12)]:
            for via in nodes:
                back = Sandbox.connect(sandbox_id, **via.env())
                assert back.commands.run("echo here").stdout.strip() == "here"
        on_hosts = {p.name for node in nodes for p in (node.data_dir / "sandboxes").iterdir()}
        assert on_hosts <= now, f"sandboxes no record names: {on_hosts - now}"
        for via in nodes:
            Sandbox.create(timeout=60, **via.env()).kill()
    finally:
        for sandbox_id in listed(two) - before:
            Sandbox.kill(sandbox_id, **two.env())

def test_a_drained_node_takes_no_new_sandboxes(nodes, database_url):
    one, two = nodes
    drain(one, database_url)
    made = []
    try:
        assert node_table(database_url)[one.id] == "draining"
        for _ in range(2):
            made.append(create_after_heartbeat(one))
        assert all(two.holds(s.sandbox_id) for s in made), "creates through the drained node's gateway go elsewhere"
        drain(two, database_url)
        time.sleep(NODE_TABLE_TTL_S + 0.5)
        with pytest.raises(Exception, match="draining"):
            made.append(Sandbox.create(timeout=60, **one.env()))
    finally:
        for node in nodes:
            drain(node, database_url, False)
        for sbx in made:
            sbx.kill()
    assert set(node_table(database_url).values()) == {"active"}


def test_a_crashed_node_is_reported_lost_and_comes_back_with_its_sandboxes(nodes, database_url):
    one, two = nodes
    stranded = create_on(two, nodes, database_url, via=one)
    try:
        two.crash()
        time.sleep(LOST_AFTER_S + 1)
        assert node_table(database_url)[two.id] == "lost"
        with pytest.raises(Exception, match="lost"):
            Sandbox.connect(stranded.sandbox_id, **one.env()).commands.run("true")
        # It is still listed: lost is reported, never silently dropped.
        assert stranded.sandbox_id in {s.sandbox_id for s in Sandbox.list(**one.env()).next_items()}
        fresh = create_after_heartbeat(one)
        try:
            assert one.holds(fresh.sandbox_id), "a lost node takes no new sandboxes"
        finally:
            fresh.kill()
        # Back: it adopts what survived, and the other gateway reaches it.
        two.up()
        time.sleep(HEARTBEAT_S + 0.5)
        assert node_table(database_url)[two.id] == "active"
        out = Sandbox.connect(stranded.sandbox_id, **one.env()).commands.run("echo back")
        assert out.stdout.strip() == "back"
    finally:
        if two.proc.poll() is not None:
            two.up()
        stranded.kill()


def create_while_stored(snapshot: str, via: Node, deadline_s: float = 60) -> Sandbox:
    """A create from `snapshot` once its node has stored it: until then a
    node that must fetch it answers that it is not in the object store yet."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return Sandbox.create(snapshot, timeout=300, **via.env())
        except Exception as e:
            if "not in the object store yet" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_a_snapshot_starts_on_another_node_through_the_object_store(nodes, database_url, object_store):
    one, two = nodes
    name = f"moving-{time.monotonic_ns() % 10**9}"
    source = create_on(one, nodes, database_url, via=two)
    try:
        source.files.write("/home/user/note", "taken on node one")
        source.commands.run("sleep 4242", background=True)
        # The object store is down when the snapshot is taken: the snapshot
        # is taken all the same, and uploaded once the store is back.
        object_store.stop()
        source.create_snapshot(name=name, mode="full")
    finally:
        source.kill()
    try:
        drain(one, database_url)
        time.sleep(NODE_TABLE_TTL_S + 0.5)
        with pytest.raises(Exception, match="not in the object store yet"):
            Sandbox.create(name, timeout=60, **one.env())
        object_store.start()
        moved = create_while_stored(name, via=one)
        try:
            assert two.holds(moved.sandbox_id), "the drained node's snapshot starts on the other node"
            assert moved.files.read("/home/user/note") == "taken on node one"
            assert "sleep 4242" in moved.commands.run("ps -eo args").stdout, "its memory came along"
            assert mounted_lazily(two, f"snapshot {name}"), "its layers and its memory arrive as read"
            assert object_store.read(f"snapshots/default/{name}@memimage"), "the checkpoint is stored as an image"
        finally:
            moved.kill()
        # A second create finds the files already fetched.
        again = Sandbox.create(name, timeout=300, **two.env())
        again.kill()
    finally:
        drain(one, database_url, False)
        if object_store.proc.poll() is not None:
            object_store.start()
    assert object_store.read(f"snapshots/default/{name}"), "the manifest is in the bucket"
    key = snapshot_key(database_url, name)
    files = one.data_dir / "snapshots" / f"{key}.json"
    fetched = two.data_dir / "snapshots" / f"{key}.json"
    assert key and files.exists(), "the snapshot's files are on node one"
    assert fetched.exists(), "node two keeps the copy it fetched while the snapshot is there"
    Sandbox.delete_snapshot(name, **two.env())
    assert object_store.read(f"snapshots/default/{name}") is None, "a deleted snapshot leaves the bucket"
    assert object_store.read(f"snapshots/default/{name}@memimage") is None, "its checkpoint too"
    assert not files.exists(), "deleted through node two's gateway, on its own node"
    gone_within(fetched, "node two removes its fetched copy once no record names it")


def lazy_mounts(node: Node) -> list[str]:
    """The node's mounts of lazily fetched layers: each layer's image
    (erofs) and its server's file (fuse)."""
    with open("/proc/self/mounts") as mounts:
        return [line for line in mounts
                if line.split()[1].startswith(str(node.data_dir) + "/") and line.split()[2] in ("erofs", "fuse")]


def snapshot_key(database: str, name: str) -> str:
    """The key snapshot `name`'s files are kept under on its node."""
    query = f"SELECT record::jsonb ->> 'key' FROM team_snapshots WHERE id = '{name}' OR record::jsonb -> 'names' ? '{name}'"
    return subprocess.run(["psql", database, "-tAc", query], check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.timeout(300, func_only=True)
def test_a_large_memory_restores_on_another_node_as_its_pages_arrive(nodes, database_url, object_store):
    """A process holding 160 MiB of random bytes is snapshotted with its
    memory on node one, which stores an image of the checkpoint beside
    the layers' (`…@memimage`). With node one draining, node two serves
    that image from the object store and mounts it like a layer's, its
    checkpoint directory a link to it, and restores lazily (a pager copies
    each page as it is touched): the sandbox holds every byte it had.
    Deleting the snapshot ends the servers and unmounts the images."""
    one, two = nodes
    name = f"big-memory-{secrets.token_hex(4)}"
    source = create_on(one, nodes, database_url, via=one)
    try:
        digest = start_holder(source, 160)
        source.create_snapshot(name=name, mode="full")
    finally:
        source.kill()
    key = snapshot_key(database_url, name)
    drain(one, database_url)
    try:
        time.sleep(NODE_TABLE_TTL_S + 0.5)
        moved = create_while_stored(name, via=one, deadline_s=120)
        try:
            assert two.holds(moved.sandbox_id)
            assert pagers(moved.sandbox_id), "a restore of this size is lazy"
            checkpoint = two.data_dir / "checkpoints" / key
            assert checkpoint.is_symlink() and checkpoint.resolve().parent == two.data_dir / "layers", \
                "the checkpoint is the image served from the object store"
            assert any(line.split()[1] == str(checkpoint.resolve()) for line in lazy_mounts(two))
            assert holders_digest(moved) == digest, "every byte came through the object store"
        finally:
            moved.kill()
    finally:
        drain(one, database_url, False)
    assert object_store.read(f"snapshots/default/{name}@memimage")
    assert object_store.read(f"snapshots/default/{name}@memory") is None, "no checkpoint stream is sent beside it"
    Sandbox.delete_snapshot(name, **two.env())
    deadline = time.monotonic() + 5 * HEARTBEAT_S
    while lazy_mounts(two) or lazy_server_pids(two):
        assert time.monotonic() < deadline, f"node two let go of the memory's image: {lazy_mounts(two)}"
        time.sleep(0.5)
    assert not (two.data_dir / "checkpoints" / key).exists()


def mounted_lazily(node: Node, what: str) -> bool:
    """Whether the node's gateway logged mounting `what` ("snapshot NAME",
    "template NAME", "paused sandbox ID") from the object store as it
    arrives, rather than fetching it whole."""
    log = (node.data_dir / "gateway.log").read_text().splitlines()
    return any("to arrive as read" in line and what in line for line in log)


def lazy_server_pids(node: Node) -> dict[int, str]:
    """The `copse lazy-image` processes serving the node's layers, and the
    directory each serves."""
    found = {}
    for proc in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"lazy-image" in argv[1:2] and argv[2:3] and argv[2].decode().startswith(f"{node.data_dir}/"):
            found[int(proc.name)] = argv[2].decode()
    return found


def stored_lazy_layers(database: str, name: str, within_s: float = 60) -> list[str]:
    """The manifests' hashes of snapshot `name`'s layer images, once its
    node has stored it."""
    query = f"SELECT record::jsonb -> 'lazy' -> 'layers' FROM team_snapshots WHERE id = '{name}'"
    return polled_json(database, query, within_s, "the snapshot's layer images were stored")


def stored_lazy_image_layers(database: str, key: str, within_s: float = 60) -> list[str]:
    """The manifests' hashes of template image `key`'s layer images, once
    its node has stored it."""
    query = f"SELECT record::jsonb -> 'lazy_images' -> '{key}' -> 'layers' FROM template_labels"
    return polled_json(database, f"{query} WHERE record::jsonb -> 'lazy_images' ? '{key}'", within_s,
                       "the template image's layer images were stored")


def polled_json(database: str, query: str, within_s: float, why: str):
    """The JSON value `query` selects, once it selects one."""
    deadline = time.monotonic() + within_s
    while not (out := subprocess.run(["psql", database, "-tAc", query], check=True, capture_output=True,
                                     text=True).stdout.strip()):
        assert time.monotonic() < deadline, why
        time.sleep(0.5)
    return json.loads(out)


def test_a_files_snapshot_starts_on_another_node_as_its_layers_arrive(nodes, database_url, object_store):
    """Lazy fetch: node one stores a files-only snapshot's layers as EROFS
    images beside its stream, and the record keeps each image manifest's
    hash. Node two then fetches nothing before the boot: a `copse
    lazy-image` server per layer serves the image as it is read, the
    substrate mounts it as the layer, and the sandbox reads its files
    (a 48 MB one hashes as it did on node one); the rest arrives in the
    background. The servers outlive a crash of node two's gateway, so the
    sandbox it adopts again keeps reading. Deleting the snapshot unmounts
    both and ends the servers, and its images leave the bucket."""
    one, two = nodes
    name = f"lazy-{time.monotonic_ns() % 10**9}"
    source = create_on(one, nodes, database_url, via=two)
    try:
        source.files.write("/home/user/note", "read as it arrives")
        source.commands.run("touch -d '2001-02-03 04:05:06' /home/user/note")
        digest = source.commands.run("head -c 48M /dev/urandom > /home/user/big && sha256sum /home/user/big",
                                     timeout=120).stdout.split()[0]
        source.create_snapshot(name=name, mode="filesystem")
    finally:
        source.kill()
    layers = stored_lazy_layers(database_url, name)
    assert layers and object_store.read(f"snapshots/default/{name}@layer0"), "the top layer's image is stored"
    try:
        drain(one, database_url)
        time.sleep(NODE_TABLE_TTL_S + 0.5)
        moved = create_while_stored(name, via=two)
        try:
            assert two.holds(moved.sandbox_id)
            assert mounted_lazily(two, f"snapshot {name}"), "mounted, not fetched whole"
            assert len(lazy_server_pids(two)) == len(layers), lazy_server_pids(two)
            assert len(lazy_mounts(two)) == 2 * len(layers), lazy_mounts(two)
            assert moved.files.read("/home/user/note") == "read as it arrives"
            stamp = moved.commands.run("date -u -r /home/user/note +%FT%T").stdout.strip()
            assert stamp == "2001-02-03T04:05:06", "file times come along"
            # The servers are not the gateway's: they outlive its crash, and
            # the sandbox it adopts again still reads what had not arrived.
            two.crash()
            assert len(lazy_server_pids(two)) == len(layers), "a gateway crash leaves the servers running"
            two.up()
            got = moved.commands.run("sha256sum /home/user/big", timeout=120).stdout.split()[0]
            assert got == digest
            deadline = time.monotonic() + 60
            while not all((d / "complete").exists() for d in (two.data_dir / "lazy").iterdir()):
                assert time.monotonic() < deadline, "the rest of each image arrived in the background"
                time.sleep(0.5)
        finally:
            moved.kill()
    finally:
        drain(one, database_url, False)
    Sandbox.delete_snapshot(name, **two.env())
    deadline = time.monotonic() + 5 * HEARTBEAT_S
    while lazy_mounts(two) or lazy_server_pids(two) or any((two.data_dir / "lazy").iterdir()):
        assert time.monotonic() < deadline, f"node two let go of the lazy layers: {lazy_mounts(two)}"
        time.sleep(0.5)
    assert object_store.read(f"snapshots/default/{name}@layer0") is None, "its images leave the bucket"


def gone_within(path, why: str, within_s: float = 5 * HEARTBEAT_S):
    deadline = time.monotonic() + within_s
    while path.exists():
        assert time.monotonic() < deadline, why
        time.sleep(0.5)


def image_key(database: str, template: str) -> str:
    """The substrate snapshot holding the image of the default team's
    built template `template`."""
    query = (f"SELECT record::jsonb -> 'image' ->> 'snapshot_key' FROM built_templates "
             f"WHERE record::jsonb ->> 'name' = '{template}' AND record::jsonb ->> 'team' = 'default'")
    key = subprocess.run(["psql", database, "-tAc", query], check=True, capture_output=True, text=True).stdout.strip()
    assert key, f"template {template} has an image"
    return key


def stored_image(object_store, key: str, within_s: float = 60) -> bytes:
    """The manifest of the template image `key`, once its node stored it."""
    deadline = time.monotonic() + within_s
    while not (manifest := object_store.read(f"images/{key}")):
        assert time.monotonic() < deadline, "the template's node stored its image"
        time.sleep(0.5)
    return manifest


def test_a_built_template_starts_on_another_node_through_the_object_store(nodes, database_url, object_store):
    """A template built on node one (a file, an env, a server its start
    command runs, kept running in the image's memory) is stored in the
    object store, with its layers as images and its checkpoint alone, whose
    manifests' hashes its labels keep; while node one drains, a create of
    it through node one's gateway lands on node two, which fetches the
    checkpoint, mounts the layers as they are read, and starts it there,
    server up. A delete through node two's gateway removes the image on
    node one, its objects in the bucket, and node two's copy, mounts and
    servers."""
    one, two = nodes
    name = f"travelling-{secrets.token_hex(4)}"
    template = (Template().from_template("base")
                .run_cmd("echo built on node one > /home/user/where")
                .set_envs({"MODE": "travelling"})
                .set_start_cmd("python3 -m http.server 8080", ready_cmd="curl -sf localhost:8080 > /dev/null"))
    Template.build(template, alias=name, **one.env())
    key = image_key(database_url, name)
    built = one.data_dir / "snapshots" / f"{key}.json"
    fetched = two.data_dir / "snapshots" / f"{key}.json"
    assert built.exists() and not fetched.exists()
    stored_image(object_store, key)
    layers = stored_lazy_image_layers(database_url, key)
    assert layers and object_store.read(f"images/{key}@layer0") and object_store.read(f"images/{key}@memimage")
    drain(one, database_url)
    try:
        time.sleep(NODE_TABLE_TTL_S + 0.5)
        moved = Sandbox.create(name, timeout=120, **one.env())
        try:
            assert two.holds(moved.sandbox_id), "the drained node's template starts on the other node"
            out = moved.commands.run('cat /home/user/where; echo "$MODE"; curl -sf -o /dev/null -w "%{http_code}" localhost:8080')
            assert out.stdout.split("\n")[:3] == ["built on node one", "travelling", "200"], out.stdout
            assert mounted_lazily(two, f"template {name}"), "its layers and its memory arrive as read"
            assert len(lazy_server_pids(two)) == len(layers) + 1, lazy_server_pids(two)
        finally:
            moved.kill()
    finally:
        drain(one, database_url, False)
    assert fetched.exists(), "node two keeps its copy while the template is there"
    deleted = httpx.delete(f"{two.url}/templates/{name}", headers={"X-API-KEY": API_KEY}, timeout=60)
    assert deleted.status_code == 204, deleted.text
    assert not built.exists(), "deleted on the node that built it"
    assert object_store.read(f"images/{key}") is None, "a deleted template's image leaves the bucket"
    assert not any(object_store.read(f"images/{key}{suffix}") for suffix in ("@layer0", "@memimage")), "its objects too"
    gone_within(fetched, "node two removes its fetched copy once no record names it")
    deadline = time.monotonic() + 5 * HEARTBEAT_S
    while lazy_mounts(two) or lazy_server_pids(two):
        assert time.monotonic() < deadline, f"node two let go of the lazy layers: {lazy_mounts(two)}"
        time.sleep(0.5)


def layers_of(database: str, template: str) -> dict[str, bool]:
    """The build cache entries the default team's template `template`
    made or reused: key → whether it is in the object store."""
    query = ("SELECT l.record::jsonb ->> 'key', COALESCE((l.record::jsonb ->> 'in_object_store')::bool, false) "
             "FROM build_layers l, built_templates t "
             f"WHERE t.record::jsonb ->> 'name' = '{template}' AND t.record::jsonb ->> 'team' = 'default' "
             "AND l.record::jsonb -> 'templates' ? (t.record::jsonb ->> 'id')")
    rows = subprocess.run(["psql", database, "-tAF", " ", "-c", query], check=True, capture_output=True,
                          text=True).stdout.split("\n")
    return {key: stored == "t" for key, stored in (r.split() for r in rows if r.strip())}


def stored_layers(database: str, template: str, within_s: float = 60) -> list[str]:
    """The keys of `template`'s build cache entries, once its node stored
    them all."""
    deadline = time.monotonic() + within_s
    while not all((layers := layers_of(database, template)).values()) or not layers:
        assert time.monotonic() < deadline, f"the node stored {template}'s build cache entries: {layers}"
        time.sleep(0.5)
    return list(layers)


def test_a_build_on_another_node_stacks_on_the_layers_the_object_store_holds(nodes, database_url, object_store):
    """Templates built from one built template with the same step, through
    each node. Node one's cache entry for the step is stored in the object
    store: node two fetches its files and runs no step, and its template
    starts with them. An entry not stored (yet) is not stacked on: node two
    runs that step itself rather than boot files its host lacks."""
    one, two = nodes
    tag = secrets.token_hex(4)
    base = f"layered-base-{tag}"
    Template.build(Template().from_template("base").run_cmd("echo base > /home/user/base"), alias=base, **one.env())
    stored_image(object_store, image_key(database_url, base))
    step = Template().from_template(base).run_cmd("echo step >> /home/user/steps")
    # The SDK's builder changes itself: a second one for two steps.
    more = Template().from_template(base).run_cmd("echo step >> /home/user/steps").run_cmd(
        "echo more >> /home/user/steps")
    built = [f"layered-{n}-{tag}" for n in ("first", "again", "two", "more", "more-two")]
    try:
        first, _ = build_logged(step, built[0], **one.env())
        assert cached_steps(first) == [] and run_steps(first) == [1], first
        again, _ = build_logged(step, built[1], **one.env())
        assert cached_steps(again) == [1], again
        [entry] = stored_layers(database_url, built[0])
        assert object_store.read(f"layers/{entry}"), "the entry's files are in the bucket"
        elsewhere, _ = build_logged(step, built[2], **two.env())
        assert cached_steps(elsewhere) == [1] and run_steps(elsewhere) == [], elsewhere
        sbx = Sandbox.create(built[2], **two.env())
        try:
            assert two.holds(sbx.sandbox_id)
            assert sbx.commands.run("cat /home/user/base /home/user/steps").stdout.split() == ["base", "step"]
        finally:
            sbx.kill()

        # The second step's entry, stored, then marked as not stored yet.
        build_logged(more, built[3], **one.env())
        second = [k for k in stored_layers(database_url, built[3]) if k != entry]
        assert len(second) == 1
        subprocess.run(["psql", database_url, "-tAc",
                        "UPDATE build_layers SET record = (record::jsonb - 'in_object_store')::text "
                        f"WHERE id = '{second[0]}'"], check=True, capture_output=True)
        elsewhere, _ = build_logged(more, built[4], **two.env())
        assert cached_steps(elsewhere) == [1] and run_steps(elsewhere) == [2], elsewhere
        sbx = Sandbox.create(built[4], **two.env())
        try:
            assert sbx.commands.run("cat /home/user/steps").stdout.split() == ["step", "more"]
        finally:
            sbx.kill()
    finally:
        for name in [*built, base]:
            httpx.delete(f"{one.url}/templates/{name}", headers={"X-API-KEY": API_KEY}, timeout=60)
    deadline = time.monotonic() + 30
    while object_store.read(f"layers/{entry}"):
        assert time.monotonic() < deadline, "a collected entry leaves the bucket"
        time.sleep(0.5)
    left = subprocess.run(["psql", database_url, "-tAc", f"SELECT count(*) FROM build_layers WHERE id = '{entry}'"],
                          check=True, capture_output=True, text=True).stdout.strip()
    assert left == "0", "and the database"


def private_image(node: Node, repository: str) -> tuple[str, str, str]:
    """A tiny image with a new marker in /etc/image-marker, pushed to the
    nodes' private registry; its reference, its template's name and the
    marker."""
    marker = secrets.token_hex(4)
    root = node.work / f"root-{marker}"
    tiny_root(root, marker)
    layout = node.work / f"layout-{marker}"
    digest = oci_layout(layout, "1", [layer(tree_members(root))])
    push(layout, "1", node.registry, repository, login=REGISTRY_LOGIN)
    return f"private.test/{repository}:1", f"image-{digest.removeprefix('sha256:')[:16]}", marker


def built_from_private_image(node: Node, reference: str, name: str, line: str):
    """Builds `name` from `reference` through `node`, with the registry's
    login, writing `line` to /home/user/note."""
    template = from_private_image(reference)
    Template.build(template.run_cmd(f"echo {line} > /home/user/note"), alias=name, **node.env())


def ran_commands(messages: list[str]) -> list[str]:
    """The RUN steps a build ran (its image pull's progress lines are
    numbered too)."""
    return [m.split("] RUN ", 1)[1] for m in messages if m.startswith("[") and "] RUN " in m]


def from_private_image(reference: str) -> Template:
    return Template().from_image(reference, username=REGISTRY_LOGIN[0], password=REGISTRY_LOGIN[1])


def test_a_build_from_an_image_on_another_node_stacks_on_the_entries_stored_for_it(nodes, database_url,
                                                                                   object_store):
    """A template built on node one from an image in the private registry
    stores its step's cache entry, chained from the image's digest. The
    same definition built through node two pulls the image, fetches that
    entry and runs no step; its sandbox has the image's files and the
    step's. Both nodes collect the image's template once the templates are
    deleted."""
    one, two = nodes
    reference, image_template, marker = private_image(one, f"copse-test/cached-{secrets.token_hex(3)}")
    line = f"step-{secrets.token_hex(3)}"
    command = f"echo {line} > /home/user/note"
    names = [f"image-cached-{n}-{secrets.token_hex(3)}" for n in ("one", "two")]
    try:
        first, _ = build_logged(from_private_image(reference).run_cmd(command), names[0], **one.env())
        assert ran_commands(first) == [command], first
        [entry] = stored_layers(database_url, names[0])
        assert object_store.read(f"layers/{entry}"), "the entry on the image's template is stored"
        elsewhere, _ = build_logged(from_private_image(reference).run_cmd(command), names[1], **two.env())
        assert ran_commands(elsewhere) == [] and cached_steps(elsewhere) == [1], elsewhere
        assert list(layers_of(database_url, names[1])) == [entry]
        sbx = Sandbox.create(names[1], **two.env())
        try:
            assert two.holds(sbx.sandbox_id)
            out = sbx.commands.run("read -r m < /etc/image-marker; echo $m; read -r n < /home/user/note; echo $n")
            assert out.stdout.split() == [marker, line], out.stdout
        finally:
            sbx.kill()
    finally:
        for name in names:
            httpx.delete(f"{one.url}/templates/{name}", headers={"X-API-KEY": API_KEY}, timeout=60)
    gone_within(one.data_dir / "templates" / image_template, "node one collects the image's template")
    gone_within(two.data_dir / "templates" / image_template, "node two collects the one it pulled")


def test_an_image_template_its_snapshots_and_paused_sandboxes_start_on_another_node_without_its_registry(
        nodes, database_url, object_store):
    """A template built on node one from an image in a private registry
    (with the build's login), a snapshot of a sandbox of it and a sandbox
    of it paused on its files are each stored with the image's layer blobs
    beside their files. While node one drains, node two starts each of
    them: it makes the image's template from the blobs stored with that
    one (the template is deleted before the snapshot moves, and the
    snapshot before the paused sandbox does, so node two has collected
    the image's template each time), checks them against the digests the
    database keeps, and never asks the registry. The blobs leave the
    bucket with their files."""
    one, two = nodes
    repository = f"copse-test/travel-{secrets.token_hex(3)}"
    reference, image_template, marker = private_image(one, repository)
    name, snap = f"from-image-{secrets.token_hex(4)}", f"on-image-{secrets.token_hex(4)}"
    built_from_private_image(one, reference, name, "built-on-one")
    drain(two, database_url)
    try:
        time.sleep(NODE_TABLE_TTL_S + 0.5)
        source, paused = (Sandbox.create(name, timeout=120, **one.env()) for _ in range(2))
    finally:
        drain(two, database_url, False)
    assert one.holds(source.sandbox_id) and one.holds(paused.sandbox_id)
    source.files.write("/home/user/note", "snapshot")
    source.create_snapshot(name=snap, mode="filesystem")
    source.kill()
    paused.files.write("/home/user/note", "paused")
    assert paused.pause(mode="filesystem") is True
    key = image_key(database_url, name)
    stored_image(object_store, key)
    stored_paused(object_store, database_url, paused.sandbox_id)
    polled_json(database_url, f"SELECT record::jsonb -> 'oci' FROM team_snapshots WHERE id = '{snap}'", 60,
                "the snapshot is stored with its image's blobs")
    for files in (f"images/{key}", f"snapshots/default/{snap}", f"paused/default/{paused.sandbox_id}"):
        assert object_store.read(f"{files}@base0"), f"the image's layer is stored beside {files}"
        assert object_store.read(f"{files}@base1") is None, "one layer, one blob"
    assert (one.data_dir / "templates" / image_template).is_dir()
    requests = one.registry.requests()

    def on_two(create, note: str):
        assert not (two.data_dir / "templates" / image_template).exists()
        sbx = create()
        try:
            assert two.holds(sbx.sandbox_id), "what node one holds starts on the other node"
            out = sbx.commands.run("read -r m < /etc/image-marker; echo $m; read -r n < /home/user/note; echo $n")
            assert out.stdout.split() == [marker, note], out.stdout
            assert (two.data_dir / "templates" / image_template).is_dir(), "node two made the image's template"
        finally:
            sbx.kill()

    drain(one, database_url)
    try:
        time.sleep(NODE_TABLE_TTL_S + 0.5)
        on_two(lambda: Sandbox.create(name, timeout=120, **one.env()), "built-on-one")
        deleted = httpx.delete(f"{two.url}/templates/{name}", headers={"X-API-KEY": API_KEY}, timeout=60)
        assert deleted.status_code == 204, deleted.text
        assert object_store.read(f"images/{key}@base0") is None, "the blobs leave the bucket with the image"
        gone_within(two.data_dir / "templates" / image_template, "node two collects the image template it made")
        on_two(lambda: Sandbox.create(snap, timeout=120, **one.env()), "snapshot")
        Sandbox.delete_snapshot(snap, **two.env())
        assert object_store.read(f"snapshots/default/{snap}@base0") is None, "and with the snapshot"
        gone_within(two.data_dir / "templates" / image_template, "collected again once nothing stands on it")
        on_two(lambda: Sandbox.connect(paused.sandbox_id, timeout=120, **one.env()), "paused")
        assert object_store.read(f"paused/default/{paused.sandbox_id}@base0") is None, "and with the paused files"
    finally:
        drain(one, database_url, False)
    assert one.registry.requests() == requests, "node two never asked the registry"
    gone_within(one.data_dir / "templates" / image_template, "node one collects the image's template")
    gone_within(two.data_dir / "templates" / image_template, "node two collects the one it made")


def kill_quietly(sandboxes: list[Sandbox]):
    """Kills each (a cleanup: one already gone or unreachable is passed)."""
    for sbx in sandboxes:
        try:
            sbx.kill()
        except Exception:
            pass


def paused_field(database: str, sandbox_id: str, field: str) -> str:
    """A field of a sandbox record's `paused`, as the database holds it."""
    query = f"SELECT record::jsonb -> 'paused' ->> '{field}' FROM sandboxes WHERE id = '{sandbox_id}'"
    out = subprocess.run(["psql", database, "-tAc", query], check=True, capture_output=True, text=True)
    return out.stdout.strip()


def stored_paused(object_store, database: str, sandbox_id: str, within_s: float = 90, team: str = "default") -> bytes:
    """The manifest of a paused sandbox's files in the bucket, once its node
    has uploaded them and marked its record (`service/relocate.rs`)."""
    deadline = time.monotonic() + within_s
    while True:
        marked = paused_field(database, sandbox_id, "in_object_store")
        manifest = object_store.read(f"paused/{team}/{sandbox_id}")
        if manifest is not None and marked == "true":
            return manifest
        assert time.monotonic() < deadline, f"sandbox {sandbox_id}'s files never reached the object store"
        time.sleep(0.5)


def test_a_drain_that_moves_sandboxes_resumes_them_on_another_node(nodes, database_url, object_store):
    """`copse node drain --move-sandboxes`: the node pauses its running and
    frozen sandboxes into the object store with their memory, and uploads
    the one paused on its files (each with its layers as images); a
    connect through either gateway resumes each on the other node with its
    files, mounted as they arrive, and its processes where memory was kept
    (the checkpoint fetched whole first). Once running again, its files
    leave the bucket."""
    one, two = nodes
    running, frozen, on_files = made = [create_on(one, nodes, database_url, via=two) for _ in range(3)]
    try:
        for sbx in made:
            sbx.files.write("/home/user/note", f"written on node one in {sbx.sandbox_id}")
            sbx.commands.run("sleep 4243", background=True)
        assert frozen.pause() is True
        assert on_files.pause(mode="filesystem") is True
        subprocess.run([str(COPSE), "node", "drain", one.id, "--move-sandboxes", "--database", database_url],
                       check=True)
        for sbx in made:
            stored_paused(object_store, database_url, sbx.sandbox_id)
            assert not one.holds(sbx.sandbox_id), "paused to its files: nothing of it runs on node one"
        for sbx, via in [(running, one), (frozen, two), (on_files, one)]:
            back = Sandbox.connect(sbx.sandbox_id, timeout=120, **via.env())
            assert two.holds(sbx.sandbox_id), "resumed on the node that takes sandboxes"
            assert back.files.read("/home/user/note") == f"written on node one in {sbx.sandbox_id}"
            processes = back.commands.run("ps -eo args").stdout
            assert ("sleep 4243" in processes) == (sbx is not on_files), "memory came along where it was kept"
            assert object_store.read(f"paused/default/{sbx.sandbox_id}") is None, "its files left the bucket"
            assert object_store.read(f"paused/default/{sbx.sandbox_id}@layer0") is None, "its images too"
            assert mounted_lazily(two, f"paused sandbox {sbx.sandbox_id}"), "its layers arrive as read"
    finally:
        drain(one, database_url, False)
        kill_quietly(made)


def limited_team(database: str, prefix: str, *limits: str) -> tuple[str, str]:
    """A new team with `limits` (`copse teams set` flags), and a key of it."""
    def admin(*args) -> str:
        return subprocess.run([str(COPSE), *args, "--database", database],
                              check=True, capture_output=True, text=True).stdout

    team = f"{prefix}-{secrets.token_hex(4)}"
    admin("teams", "set", team, *limits)
    return team, admin("keys", "create", "--team", team).strip()


def test_a_sandbox_moved_away_stops_counting_and_leaves_no_files_on_its_old_node(nodes, database_url, object_store):
    """Once another node takes a paused sandbox over, its old node lets go
    of it within heartbeats, not at its next restart: the sandbox no longer
    counts against its team's limits there, and its files there are gone."""
    one, two = nodes
    team, key = limited_team(database_url, "moved", "--max-paused", "1")
    made = []
    try:
        moved = create_on(one, nodes, database_url, via=two, api_key=key)
        made.append(moved)
        assert moved.pause(mode="filesystem") is True
        files = one.data_dir / "snapshots" / f"{paused_field(database_url, moved.sandbox_id, 'files_only')}.json"
        assert files.exists(), "node one holds the paused sandbox's files"
        stored_paused(object_store, database_url, moved.sandbox_id, team=team)
        drain(one, database_url)
        try:
            time.sleep(NODE_TABLE_TTL_S + 0.5)
            Sandbox.connect(moved.sandbox_id, timeout=120, **one.env(key))
            assert two.holds(moved.sandbox_id), "resumed on the node that takes sandboxes"
        finally:
            drain(one, database_url, False)
        deadline = time.monotonic() + 5 * HEARTBEAT_S
        while files.exists():
            assert time.monotonic() < deadline, "node one kept the files of a sandbox node two took over"
            time.sleep(0.2)
        # Its team may keep one paused sandbox: the moved one runs on node
        # two, so node one must not count it as paused any more.
        second = create_on(one, nodes, database_url, via=one, api_key=key)
        made.append(second)
        try:
            assert second.pause() is True
        except RateLimitException as e:
            raise AssertionError(f"node one still counts the moved sandbox: {e}") from e
    finally:
        kill_quietly(made)


def on_one_seen_through_two(nodes, database: str, path: str, content: str) -> tuple[Sandbox, Sandbox]:
    """A sandbox on node one holding `content` at `path`, and the same
    sandbox as node two's gateway serves it (its links point there)."""
    one, two = nodes
    sbx = create_on(one, nodes, database, via=one)
    try:
        sbx.files.write(path, content)
        return sbx, Sandbox.connect(sbx.sandbox_id, **two.env())
    except Exception:
        sbx.kill()
        raise


def test_a_signed_link_works_through_the_gateway_of_any_node(nodes, database_url):
    """A signed `/files` link names no sandbox: the gateway of a node that
    does not hold its sandbox finds the signer among the other nodes'
    sandboxes (read from the database when its own index has none) and
    passes the link on, for a download and an upload alike."""
    two = nodes[1]
    sbx, elsewhere = on_one_seen_through_two(nodes, database_url, "/home/user/linked.txt", "read through node two")
    try:
        download = elsewhere.download_url("/home/user/linked.txt")
        assert download.startswith(two.url)
        assert httpx.get(download, timeout=30).text == "read through node two"
        upload = elsewhere.upload_url("/home/user/uploaded.txt")
        response = httpx.post(upload, files={"file": ("f", b"written through node two")}, timeout=30)
        assert response.status_code == 200, response.text
        assert sbx.files.read("/home/user/uploaded.txt") == "written through node two"
    finally:
        sbx.kill()


def test_metrics_of_many_sandboxes_come_from_every_node_through_either_gateway(nodes, database_url):
    """`GET /sandboxes/metrics?sandbox_ids=…` naming sandboxes on both nodes
    answers for all of them through either gateway (each node asked for its
    own, with the caller's key)."""
    one, two = nodes
    made = [create_on(one, nodes, database_url, via=two), create_on(two, nodes, database_url, via=one)]
    try:
        ids = [sbx.sandbox_id for sbx in made]
        query = {"sandbox_ids": ",".join([*ids, "nosuchsandbox0000000"])}
        for via in nodes:
            reply = httpx.get(f"{via.url}/sandboxes/metrics", params=query, headers={"x-api-key": API_KEY}, timeout=60)
            assert reply.status_code == 200, reply.text
            sandboxes = reply.json()["sandboxes"]
            assert sorted(sandboxes) == sorted(ids), sandboxes
            assert all(m["memTotal"] > 0 and m["cpuCount"] >= 1 for m in sandboxes.values()), sandboxes
    finally:
        kill_quietly(made)


def volume_file(via: Node, volume: Volume, path: str) -> httpx.Response:
    """A file of `volume` read through the content API of `via`'s gateway."""
    return httpx.get(f"{via.url}/volumecontent/{volume.volume_id}/file", params={"path": path},
                     headers={"Authorization": f"Bearer {volume.token}"}, timeout=60)


def test_a_volume_stays_on_its_node_and_either_gateway_reaches_it(nodes, database_url):
    """A volume's bytes live on the node that made it: a sandbox mounting it
    is created there whichever gateway is asked, its content API answers
    through either gateway, and a delete through the other gateway removes
    its bytes on its node."""
    one, two = nodes
    volume = Volume.create(f"vol-{secrets.token_hex(4)}", api_key=API_KEY, api_url=one.url)
    on_disk = one.data_dir / "disk" / ".volumes" / volume.volume_id
    assert on_disk.is_dir()
    made = []
    try:
        drain(one, database_url)
        try:
            # Placement by room alone would pick node two now: the volume
            # decides, and its node takes no new sandboxes.
            time.sleep(NODE_TABLE_TTL_S + 0.5)
            with pytest.raises(Exception, match="draining"):
                Sandbox.create(timeout=60, volume_mounts={"/mnt/data": volume}, **two.env())
        finally:
            drain(one, database_url, False)
        time.sleep(HEARTBEAT_S + 1)
        sbx = Sandbox.create(timeout=300, volume_mounts={"/mnt/data": volume}, **two.env())
        made.append(sbx)
        assert one.holds(sbx.sandbox_id), "created on the volume's node"
        sbx.files.write("/mnt/data/hello.txt", "written in the sandbox")
        for via in nodes:
            assert volume_file(via, volume, "/hello.txt").text == "written in the sandbox"
        put = httpx.put(f"{two.url}/volumecontent/{volume.volume_id}/file", params={"path": "/up.txt"},
                        content=b"written through node two",
                        headers={"Authorization": f"Bearer {volume.token}"}, timeout=60)
        assert put.status_code < 300, put.text
        assert sbx.files.read("/mnt/data/up.txt") == "written through node two"
        sbx.kill()
        made.clear()
        assert Volume.destroy(volume.volume_id, api_key=API_KEY, api_url=two.url) is True
        assert not on_disk.exists(), "deleted on its node"
        assert volume_file(one, volume, "/hello.txt").status_code == 404
    finally:
        kill_quietly(made)


def volume_move(database: str, volume_id: str) -> tuple[str, str]:
    """A volume record's node and move state ("" when it is not moving)."""
    query = (f"SELECT (record::jsonb ->> 'node') || ' ' || COALESCE(record::jsonb -> 'moved_out' ->> 'state', '') "
             f"FROM team_volumes WHERE id = '{volume_id}'")
    out = subprocess.run(["psql", database, "-tAc", query], check=True, capture_output=True, text=True)
    node, _, state = out.stdout.strip().partition(" ")
    return node, state


def stored_volume(object_store, database: str, volume_id: str, within_s: float = 90) -> bytes:
    """The manifest of a volume waiting in the bucket for its next node,
    once its node has uploaded it and marked its record."""
    deadline = time.monotonic() + within_s
    while True:
        manifest = object_store.read(f"volumes/default/{volume_id}")
        if manifest is not None and volume_move(database, volume_id)[1] == "stored":
            return manifest
        assert time.monotonic() < deadline, f"volume {volume_id} never reached the object store"
        time.sleep(0.5)


def test_a_drain_that_moves_sandboxes_takes_their_volumes_along(nodes, database_url, object_store):
    """`copse node drain --move-sandboxes` on the node holding a volume: its
    sandbox is paused into the object store, then the volume follows. A
    content call through the drained node's gateway brings the volume to
    the other node; the sandbox's connect resumes it there, beside its
    volume, with the files it wrote; a create mounting the volume lands
    there too; the drained node's copy and the bucket's go."""
    one, two = nodes
    volume = Volume.create(f"vol-{secrets.token_hex(4)}", api_key=API_KEY, api_url=one.url)
    on_one = one.data_dir / "disk" / ".volumes" / volume.volume_id
    on_two = two.data_dir / "disk" / ".volumes" / volume.volume_id
    made = []
    try:
        sbx = Sandbox.create(timeout=300, volume_mounts={"/mnt/data": volume}, **two.env())
        made.append(sbx)
        assert one.holds(sbx.sandbox_id), "created on the volume's node"
        sbx.files.write("/mnt/data/hello.txt", "written on node one")
        sbx.files.write("/home/user/note", "beside it")
        subprocess.run([str(COPSE), "node", "drain", one.id, "--move-sandboxes", "--database", database_url],
                       check=True)
        stored_paused(object_store, database_url, sbx.sandbox_id)
        stored_volume(object_store, database_url, volume.volume_id)
        assert volume_move(database_url, volume.volume_id) == (one.id, "stored")
        assert volume_file(one, volume, "/hello.txt").text == "written on node one"
        assert on_two.is_dir(), "the content call brought it to the node that takes work"
        assert volume_move(database_url, volume.volume_id) == (two.id, "")
        assert object_store.read(f"volumes/default/{volume.volume_id}") is None, "it left the bucket"
        back = Sandbox.connect(sbx.sandbox_id, timeout=120, **one.env())
        assert two.holds(sbx.sandbox_id), "resumed beside its volume"
        assert back.files.read("/mnt/data/hello.txt") == "written on node one"
        assert back.files.read("/home/user/note") == "beside it"
        back.files.write("/mnt/data/after.txt", "written on node two")
        assert volume_file(one, volume, "/after.txt").text == "written on node two"
        deadline = time.monotonic() + 5 * HEARTBEAT_S
        while on_one.exists():
            assert time.monotonic() < deadline, "node one kept its copy of a volume node two took over"
            time.sleep(0.2)
        drain(one, database_url, False)
        time.sleep(HEARTBEAT_S + 1)
        other = Sandbox.create(timeout=60, volume_mounts={"/mnt/v": volume}, **one.env())
        made.append(other)
        assert two.holds(other.sandbox_id), "created where the volume now is"
        assert other.files.read("/mnt/v/after.txt") == "written on node two"
    finally:
        drain(one, database_url, False)
        kill_quietly(made)
        Volume.destroy(volume.volume_id, api_key=API_KEY, api_url=one.url)


def test_a_template_build_spread_over_both_gateways_runs_on_the_node_that_took_it(nodes, database_url):
    """A load balancer may send each call of one `Template.build` to another
    gateway: the build requested through node one's gateway gets its copy
    step's upload link, its upload and its start through node two's, and
    all of it is passed to node one, where the build runs. The template then
    creates on node one through either gateway, and a delete through node
    two's gateway removes its image on node one."""
    one, two = nodes
    headers = {"X-API-KEY": API_KEY}
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        data = b"copied on node one"
        info = tarfile.TarInfo("app/hello.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    archive = archive.getvalue()
    name = f"spread-{secrets.token_hex(4)}"
    requested = httpx.post(f"{one.url}/v3/templates", json={"name": name}, headers=headers, timeout=30)
    assert requested.status_code == 202, requested.text
    template_id, build_id = requested.json()["templateID"], requested.json()["buildID"]
    made = []
    try:
        digest = hashlib.sha256(archive).hexdigest()
        link = httpx.get(f"{two.url}/templates/{template_id}/files/{digest}", headers=headers, timeout=30).json()
        assert link["url"].startswith(two.url) and not link["present"], link
        httpx.put(link["url"], content=archive, timeout=30).raise_for_status()
        copy = {"type": "COPY", "args": ["app", "/home/user/app/", "", ""], "filesHash": digest, "force": False}
        body = {"fromTemplate": "base", "steps": [copy]}
        started = httpx.post(f"{two.url}/v2/templates/{template_id}/builds/{build_id}", json=body,
                             headers=headers, timeout=30)
        assert started.status_code == 202, started.text
        deadline = time.monotonic() + 300
        while (status := httpx.get(f"{two.url}/templates/{template_id}/builds/{build_id}/status",
                                   headers=headers, timeout=30).json())["status"] not in ("ready", "error"):
            assert time.monotonic() < deadline, "the build did not finish"
            time.sleep(0.5)
        assert status["status"] == "ready", status
        query = f"SELECT record::jsonb -> 'image' ->> 'snapshot_key' FROM built_templates WHERE id = '{template_id}'"
        key = subprocess.run(["psql", database_url, "-tAc", query], check=True, capture_output=True,
                             text=True).stdout.strip()
        image = one.data_dir / "snapshots" / f"{key}.json"
        assert key and image.exists(), "the image is on node one"
        for via in nodes:
            sbx = Sandbox.create(name, timeout=120, **via.env())
            made.append(sbx)
            assert one.holds(sbx.sandbox_id)
            assert sbx.files.read("/home/user/app/hello.txt") == "copied on node one"
        kill_quietly(made)
        made.clear()
        deleted = httpx.delete(f"{two.url}/templates/{template_id}", headers=headers, timeout=60)
        assert deleted.status_code == 204, deleted.text
        assert not image.exists(), "its image left node one"
    finally:
        kill_quietly(made)
        httpx.delete(f"{one.url}/templates/{template_id}", headers=headers, timeout=60)


def test_a_worker_node_with_no_api_of_its_own_runs_what_the_gateways_place_there(nodes, database_url,
                                                                                   object_store):
    """`copse up --no-api`: a third node that serves only other nodes (its
    peer listener, mutual TLS) and binds no E2B API. With the other two
    drained, a create through node one's gateway lands on it, and commands
    and files reach its sandbox through either gateway; its --listen
    address takes no connection."""
    one, two = nodes
    worker = Node(3, database_url, one.ca, object_store)
    worker.args.append("--no-api")
    worker.ready_port = worker.peer_port
    worker.up()
    try:
        # Its peer listener is bound before it registers.
        deadline = time.monotonic() + 30
        while node_table(database_url).get(worker.id) != "active":
            assert time.monotonic() < deadline, "the worker node registered"
            time.sleep(0.2)
        assert "no E2B API of its own" in (worker.data_dir / "gateway.log").read_text()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", worker.port), timeout=1).close()
        drain(one, database_url)
        drain(two, database_url)
        try:
            time.sleep(NODE_TABLE_TTL_S + 0.5)
            sbx = Sandbox.create("base", timeout=120, **one.env())
        finally:
            drain(one, database_url, False)
            drain(two, database_url, False)
        try:
            assert worker.holds(sbx.sandbox_id), "placed on the only node taking sandboxes"
            assert sbx.commands.run("echo on the worker").stdout.strip() == "on the worker"
            via_two = Sandbox.connect(sbx.sandbox_id, **two.env())
            via_two.files.write("/home/user/note", "through node two")
            assert sbx.files.read("/home/user/note") == "through node two"
        finally:
            sbx.kill()
    finally:
        worker.stop()
        subprocess.run(["nft", "delete", "table", "inet", f"copse_{worker.bridge}"], capture_output=True)
        subprocess.run(["ip", "link", "del", worker.bridge], capture_output=True)
        forget_node(worker, database_url)


def forget_node(node: Node, database: str):
    """`copse node rm` on a node just stopped: refused while its last
    heartbeat is recent, done once it is lost."""
    rm = [str(COPSE), "node", "rm", node.id, "--database", database]
    refused = subprocess.run(rm, capture_output=True, text=True)
    assert refused.returncode != 0 and "stop it first" in refused.stderr, refused.stderr
    deadline = time.monotonic() + 30
    while (removed := subprocess.run(rm, capture_output=True, text=True)).returncode != 0:
        assert "stop it first" in removed.stderr, removed.stderr
        assert time.monotonic() < deadline, "the stopped node was lost in time"
        time.sleep(1)
    assert node.id not in node_table(database)



@contextlib.contextmanager
def api_front(nodes: list[Node], database: str, objects):
    """`copse up --no-sandboxes` on the nodes' database and CA, for the
    block; it removes its own node row as it stops."""
    front = Node(len(nodes) + 2, database, nodes[0].ca, objects)
    front.args.append("--no-sandboxes")
    front.up()
    try:
        yield front
    finally:
        front.stop()


def test_an_api_front_runs_no_sandboxes_and_passes_creates_builds_and_volumes_to_the_nodes(
        nodes, database_url, object_store):
    """`copse up --no-sandboxes`: a gateway with no substrate of its own (no
    bridge, no templates built, no pool) registers as an API front, which
    placement never picks. Through it the SDK lists the nodes' templates,
    creates a sandbox (placed on a node) and reaches its commands and files,
    builds a template (its steps run on a node) and creates from it, and
    makes a volume (on a node). With every node drained, a create through it
    says why it has nowhere to go."""
    one, two = nodes
    headers = {"X-API-KEY": API_KEY}
    made, template_id, volume = [], None, None
    with api_front(nodes, database_url, object_store) as front:
        try:
            assert "API only" in (front.data_dir / "gateway.log").read_text()
            listing = subprocess.run([str(COPSE), "node", "ls", "--database", database_url], check=True,
                                     capture_output=True, text=True).stdout
            assert re.search(rf"^{front.id}\s+active\s.*\(API only\)$", listing, re.M), listing
            assert subprocess.run(["ip", "link", "show", front.bridge], capture_output=True).returncode != 0, \
                "an API front makes no sandbox bridge"
            templates = httpx.get(f"{front.url}/templates", headers=headers, timeout=30).json()
            assert {"base", "code-interpreter-v1"} <= {t["templateID"] for t in templates}, templates

            sbx = Sandbox.create("base", timeout=120, **front.env())
            made.append(sbx)
            assert one.holds(sbx.sandbox_id) or two.holds(sbx.sandbox_id)
            assert sbx.commands.run("echo through the front").stdout.strip() == "through the front"
            sbx.files.write("/home/user/note", "written through the front")
            assert Sandbox.connect(sbx.sandbox_id, **one.env()).files.read("/home/user/note") == \
                "written through the front"

            name = f"front-{secrets.token_hex(4)}"
            build = Template().from_template("base").run_cmd("echo built on a node > /home/user/mark")
            messages, _ = build_logged(build, name, **front.env())
            assert run_steps(messages), messages
            template_id = httpx.get(f"{front.url}/templates/aliases/{name}", headers=headers,
                                    timeout=30).json()["templateID"]
            built = Sandbox.create(name, timeout=120, **front.env())
            made.append(built)
            assert built.files.read("/home/user/mark").strip() == "built on a node"

            volume = Volume.create(f"vol-{secrets.token_hex(4)}", api_key=API_KEY, api_url=front.url)
            assert any((n.data_dir / "disk" / ".volumes" / volume.volume_id).exists() for n in nodes)
            for kept in ("sandboxes", "snapshots", "disk"):
                assert not any((front.data_dir / kept).glob("*")), f"the front holds nothing in {kept}"

            drain(one, database_url)
            drain(two, database_url)
            try:
                time.sleep(NODE_TABLE_TTL_S + 0.5)
                with pytest.raises(Exception, match="draining or lost"):
                    Sandbox.create("base", timeout=60, **front.env())
            finally:
                drain(one, database_url, False)
                drain(two, database_url, False)
        finally:
            kill_quietly(made)
            if template_id:
                httpx.delete(f"{front.url}/templates/{template_id}", headers=headers, timeout=60)
            if volume:
                Volume.destroy(volume.volume_id, api_key=API_KEY, api_url=front.url)
    assert front.id not in node_table(database_url), "a stopped front leaves the node table"
