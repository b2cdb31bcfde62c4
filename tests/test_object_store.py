"""Snapshots through an S3-compatible object store (SeaweedFS on loopback,
tests/object_store.py): `copse snapshot push` on one host stores a snapshot
as content-addressed chunks and a manifest; `copse snapshot pull` on
another brings it back, and the official SDK creates sandboxes from it
there, memory included. The hostile side (tampered chunks and manifests)
is in test_hostile.py."""

import json
import re
import subprocess
import time
import uuid

import httpx
import pytest
from e2b import Sandbox
from object_store import copse_snapshot, object_store, snapshot_with_file  # noqa: F401 (a fixture)

from conftest import API_KEY, Gateway, second_data_dir

PUSHED = re.compile(r"pushed snapshot \S+: (\d+) chunks, (\d+) KiB, (\d+) KiB stored; "
                    r"sent (\d+) new chunks, (\d+) KiB, (\d+) KiB over the wire")


def push(store, name: str, data_dir) -> dict:
    out = copse_snapshot(store, "push", name, "--data-dir", str(data_dir)).stdout
    chunks, kib, stored_kib, new_chunks, new_kib, wire_kib = map(int, PUSHED.search(out).groups())
    return dict(chunks=chunks, kib=kib, stored_kib=stored_kib, new_chunks=new_chunks, new_kib=new_kib,
                wire_kib=wire_kib)


def chunk_key(chunk: dict) -> str:
    """Where a manifest's chunk is stored (`.lz4` when compressed)."""
    return f"chunks/{chunk['sha256']}" + (".lz4" if chunk.get("codec") == "lz4" else "")


@pytest.mark.timeout(300, func_only=True)
def test_a_snapshot_pushed_on_one_host_resumes_running_on_another(gateway, object_store):
    name = f"moved-{uuid.uuid4().hex[:8]}"
    sbx = Sandbox.create(timeout=120)
    try:
        sbx.files.write("/home/user/portable", "moved through S3")
        sbx.commands.run("sleep 4242", background=True, timeout=0).disconnect()
        sbx.create_snapshot(name=name, mode="full")
    finally:
        sbx.kill()
    sent = push(object_store, name, gateway.data_dir)
    assert sent["chunks"] >= 1 and sent["new_chunks"] == sent["chunks"], sent
    assert object_store.read(f"snapshots/default/{name}"), "the manifest is in the bucket"
    Sandbox.delete_snapshot(name)  # nothing of it is left on the first host

    data_dir = second_data_dir("objects-b")
    pulled = copse_snapshot(object_store, "pull", name, "--data-dir", str(data_dir)).stdout
    assert f"pulled snapshot {name}" in pulled, pulled
    bridge = "copseob"
    other = Gateway(data_dir)
    try:
        other.start(extra_args=["--bridge", bridge, "--subnet", "10.95.0.0/16"])
        env = dict(api_key=API_KEY, api_url=other.url, sandbox_url=other.url)
        child = Sandbox.create(template=name, timeout=60, **env)
        try:
            assert child.files.read("/home/user/portable") == "moved through S3"
            processes = child.commands.run("ps -eo args").stdout
            assert "sleep 4242" in processes, "the snapshot's memory came along: its process runs again"
        finally:
            child.kill()
        Sandbox.delete_snapshot(name, **env)
    finally:
        other.stop()
        subprocess.run(["nft", "delete", "table", "inet", f"copse_{bridge}"], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


@pytest.mark.timeout(300, func_only=True)
def test_compressible_files_are_stored_compressed_and_come_back_whole(gateway, object_store):
    """Chunks are stored LZ4-compressed where that makes them smaller: a
    snapshot of text goes over the wire in a fraction of its size, and
    comes back byte for byte; random bytes are stored as they are."""
    tag = uuid.uuid4().hex[:8]
    sbx = Sandbox.create(timeout=120)
    try:
        sbx.commands.run("yes 'a line of a log that repeats' | head -c 15000000 > /home/user/log")
        want = sbx.commands.run("sha256sum < /home/user/log").stdout.split()[0]
        sbx.create_snapshot(name=f"text-{tag}", mode="filesystem")
    finally:
        sbx.kill()
    sent = push(object_store, f"text-{tag}", gateway.data_dir)
    assert sent["kib"] > 14000 and sent["wire_kib"] * 3 < sent["kib"], sent
    manifest = json.loads(object_store.read(f"snapshots/default/text-{tag}"))
    assert manifest["format"] == "copse-chunks 2"
    assert any(c.get("codec") == "lz4" for c in manifest["chunks"]), manifest
    Sandbox.delete_snapshot(f"text-{tag}")
    copse_snapshot(object_store, "pull", f"text-{tag}", "--data-dir", str(gateway.data_dir))
    try:
        child = Sandbox.create(template=f"text-{tag}", timeout=60)
        try:
            assert child.commands.run("sha256sum < /home/user/log").stdout.split()[0] == want
        finally:
            child.kill()
    finally:
        Sandbox.delete_snapshot(f"text-{tag}")


@pytest.mark.timeout(300, func_only=True)
def test_a_second_snapshot_sends_only_the_chunks_that_changed(gateway, object_store):
    tag = uuid.uuid4().hex[:8]
    sbx = Sandbox.create(timeout=120)
    try:
        sbx.commands.run("head -c 12000000 /dev/urandom > /home/user/ballast")
        sbx.files.write("/home/user/note", "first")
        sbx.create_snapshot(name=f"v1-{tag}", mode="filesystem")
        sbx.files.write("/home/user/note", "second, a little longer")
        sbx.create_snapshot(name=f"v2-{tag}", mode="filesystem")
    finally:
        sbx.kill()
    first = push(object_store, f"v1-{tag}", gateway.data_dir)
    assert first["kib"] > 11000 and first["new_chunks"] == first["chunks"] >= 4, first
    assert first["stored_kib"] > 11000, "random bytes do not shrink, and are stored as they are"
    again = push(object_store, f"v1-{tag}", gateway.data_dir)
    assert again["new_chunks"] == 0 and again["chunks"] == first["chunks"], "an unchanged push sends nothing"
    second = push(object_store, f"v2-{tag}", gateway.data_dir)
    # The ballast's chunks are shared: only the chunks around what changed
    # (and the header with the snapshot's name) are new.
    assert second["new_kib"] < second["kib"] // 2, second
    assert second["new_chunks"] < second["chunks"], second

    for version in ("v1", "v2"):
        Sandbox.delete_snapshot(f"{version}-{tag}")
    copse_snapshot(object_store, "pull", f"v2-{tag}", "--name", f"back-{tag}", "--data-dir", str(gateway.data_dir))
    try:
        taken = copse_snapshot(object_store, "pull", f"v2-{tag}", "--name", f"back-{tag}", "--data-dir",
                               str(gateway.data_dir), check=False)
        assert taken.returncode != 0 and "exists already" in taken.stderr, taken.stderr[-2000:]
        child = Sandbox.create(template=f"back-{tag}", timeout=60)
        try:
            assert child.files.read("/home/user/note") == "second, a little longer"
            size = child.commands.run("stat -c %s /home/user/ballast").stdout.strip()
            assert size == "12000000"
        finally:
            child.kill()
    finally:
        Sandbox.delete_snapshot(f"back-{tag}")
    missing = copse_snapshot(object_store, "pull", f"never-{tag}", "--data-dir", str(gateway.data_dir), check=False)
    assert missing.returncode != 0 and f"has no snapshot never-{tag}" in missing.stderr, missing.stderr


@pytest.mark.timeout(300, func_only=True)
def test_an_object_store_that_is_down_is_a_clear_error_and_the_next_push_works(gateway, object_store):
    name = f"outage-{uuid.uuid4().hex[:8]}"
    snapshot_with_file(name, "/home/user/note", "waits for the store")
    object_store.stop()
    try:
        started = time.monotonic()
        down = copse_snapshot(object_store, "push", name, "--data-dir", str(gateway.data_dir), check=False)
        assert down.returncode != 0, down.stdout
        assert f"object store {object_store.url}" in down.stderr, down.stderr[-2000:]
        assert time.monotonic() - started < 60, "a store that does not answer fails within the retry bound"
        refused = copse_snapshot(object_store, "pull", name, "--name", f"{name}-b", "--data-dir",
                                 str(gateway.data_dir), check=False)
        assert refused.returncode != 0 and f"object store {object_store.url}" in refused.stderr
    finally:
        object_store.start()
    push(object_store, name, gateway.data_dir)
    copse_snapshot(object_store, "pull", name, "--name", f"{name}-b", "--data-dir", str(gateway.data_dir))
    try:
        child = Sandbox.create(template=f"{name}-b", timeout=60)
        assert child.files.read("/home/user/note") == "waits for the store"
        child.kill()
    finally:
        for snapshot in (name, f"{name}-b"):
            Sandbox.delete_snapshot(snapshot)


GC = re.compile(r"(\d+) manifests name (\d+) of (\d+) chunks; (?:removed|would remove) (\d+) unnamed chunks "
                r"\((\d+) KiB\); (\d+) unnamed chunks are younger")


def gc(store, *args) -> dict:
    out = copse_snapshot(store, "gc", *args).stdout
    found = GC.search(out)
    assert found, out
    manifests, named, chunks, removed, kib, young = map(int, found.groups())
    return dict(manifests=manifests, named=named, chunks=chunks, removed=removed, kib=kib, young=young, out=out)


@pytest.mark.timeout(300, func_only=True)
def test_gc_removes_only_old_chunks_that_no_manifest_names(gateway, object_store):
    """`copse snapshot gc`: once a manifest is gone, the chunks only it
    named are removed, but not before they are older than the minimum age
    (a push running meanwhile may be counting on them), never a chunk
    another manifest names, and a dry run removes nothing."""
    tag = uuid.uuid4().hex[:8]
    sbx = Sandbox.create(timeout=120)
    try:
        for version in ("keep", "drop"):
            sbx.commands.run("head -c 3000000 /dev/urandom > /home/user/ballast")
            sbx.create_snapshot(name=f"{version}-{tag}", mode="filesystem")
            push(object_store, f"{version}-{tag}", gateway.data_dir)
            Sandbox.delete_snapshot(f"{version}-{tag}")
    finally:
        sbx.kill()
    chunks = {version: {chunk_key(c) for c in json.loads(object_store.read(f"snapshots/default/{version}-{tag}"))["chunks"]}
              for version in ("keep", "drop")}
    only_dropped = chunks["drop"] - chunks["keep"]
    assert len(only_dropped) >= 2, "the second ballast is new bytes"
    httpx.delete(object_store.object_path(f"snapshots/default/drop-{tag}"), timeout=10).raise_for_status()

    young = gc(object_store)
    assert young["removed"] == 0 and young["young"] >= len(only_dropped), young["out"]
    dry = gc(object_store, "--min-age-hours", "0", "--dry-run")
    assert dry["removed"] >= len(only_dropped), dry["out"]
    assert all(object_store.read(key) is not None for key in only_dropped), "a dry run removes nothing"
    done = gc(object_store, "--min-age-hours", "0")
    assert done["removed"] == dry["removed"] and done["kib"] >= 2900, done["out"]
    assert all(object_store.read(key) is None for key in only_dropped)
    assert all(object_store.read(key) is not None for key in chunks["keep"])
    assert gc(object_store, "--min-age-hours", "0")["removed"] == 0, "nothing is left to collect"
    # Every chunk of the kept snapshot is checked again on its way back.
    copse_snapshot(object_store, "pull", f"keep-{tag}", "--name", f"kept-{tag}", "--data-dir", str(gateway.data_dir))
    Sandbox.delete_snapshot(f"kept-{tag}")
