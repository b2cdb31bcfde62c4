"""Persistent volumes through the official SDK's `Volume` class: the
control plane (`/volumes`, per team), mounts (`volume_mounts=` on create,
shared by every sandbox mounting the volume, kept across kill, pause and a
gateway restart) and the content API (`E2B_VOLUME_API_URL`, the volume's
own token), with or without a sandbox mounting the volume. Attacks through
a volume are in test_hostile.py."""

import io
import json
import os
import secrets
import subprocess
import tarfile

import httpx
import pytest
from conftest import API_KEY, COPSE, DATA_DIR
from e2b import (
    Sandbox,
    SandboxException,
    Volume,
    VolumeException,
    VolumeNotFoundException,
    VolumePathNotFoundException,
)
from e2b.volume.types import VolumeFileType
from test_leaks import stop_gateway


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(5)}"


def api(gateway, method: str, path: str, key: str = API_KEY, **kwargs) -> httpx.Response:
    return httpx.request(method, gateway.url + path, headers={"x-api-key": key}, timeout=60, **kwargs)


def copse(*args) -> str:
    done = subprocess.run([str(COPSE), *args, "--data-dir", str(DATA_DIR)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def volumes(gateway):
    """Makes volumes (the content API at the gateway) and deletes them
    after the test, with every sandbox the test made."""
    os.environ["E2B_VOLUME_API_URL"] = gateway.url
    made, sandboxes = [], []

    def make(name=None, **opts):
        vol = Volume.create(name or unique("vol"), **opts)
        made.append((vol, opts))
        return vol

    make.sandboxes = sandboxes
    make.made = made
    yield make
    for sbx in sandboxes:
        try:
            sbx.kill()
        except Exception:
            pass
    for vol, opts in made:
        Volume.destroy(vol.volume_id, **opts)


def mounted(volumes, vol, path="/mnt/data", **opts) -> Sandbox:
    sbx = Sandbox.create(timeout=180, volume_mounts={path: vol}, **opts)
    volumes.sandboxes.append(sbx)
    return sbx


def test_a_volume_is_created_listed_found_and_deleted(volumes, gateway):
    vol = volumes()
    assert vol.volume_id and vol.token and vol.name.startswith("vol-")
    assert vol.volume_id in {v.volume_id for v in Volume.list()}
    info = Volume.get_info(vol.volume_id)
    assert (info.name, info.token) == (vol.name, vol.token)
    again = Volume.connect(vol.volume_id)
    assert again.token == vol.token

    gone = Volume.create(unique("short-lived"))
    assert Volume.destroy(gone.volume_id) is True
    assert Volume.destroy(gone.volume_id) is False
    with pytest.raises(VolumeNotFoundException):
        Volume.get_info(gone.volume_id)


def test_bad_names_duplicates_and_unknown_fields_are_refused(volumes, gateway):
    vol = volumes()
    for bad in ["", "has space", "../up", "-dash", "x" * 64]:
        with pytest.raises(VolumeException):
            Volume.create(bad)
    duplicate = api(gateway, "POST", "/volumes", json={"name": vol.name})
    assert duplicate.status_code == 409, duplicate.text
    unknown = api(gateway, "POST", "/volumes", json={"name": unique("v"), "sizeGB": 5})
    assert unknown.status_code == 400 and "sizeGB" in unknown.json()["message"], unknown.text
    extra = api(gateway, "POST", "/sandboxes", json={"volumeMounts": [{"name": vol.name, "path": "/mnt", "x": 1}]})
    assert extra.status_code == 400, extra.text


def test_two_sandboxes_mounting_a_volume_see_each_others_writes(volumes):
    vol = volumes()
    a, b = mounted(volumes, vol), mounted(volumes, vol)
    a.commands.run("echo from-a > /mnt/data/a.txt")
    assert b.commands.run("cat /mnt/data/a.txt").stdout == "from-a\n"
    b.files.write("/mnt/data/b.txt", "from-b")
    assert a.files.read("/mnt/data/b.txt") == "from-b"
    # The content API sees the same files while they are mounted, and
    # sandboxes see what it writes.
    assert vol.read_file("/a.txt") == "from-a\n"
    vol.write_file("/api.txt", "from-api")
    assert a.commands.run("cat /mnt/data/api.txt").stdout == "from-api"
    listed = a.commands.run("stat -c '%U %a' /mnt/data /mnt/data/api.txt").stdout.split("\n")
    assert listed[:2] == ["user 755", "user 644"], listed
    assert vol.get_info("/a.txt").uid == 1000, "the sandbox's user wrote it"
    info = Sandbox.get_info(a.sandbox_id)
    assert info.volume_mounts == [{"name": vol.name, "path": "/mnt/data"}]

    # Deleting a mounted volume is refused, naming who mounts it.
    refused = httpx.delete(
        f"{os.environ['E2B_API_URL']}/volumes/{vol.volume_id}", headers={"x-api-key": API_KEY}, timeout=30
    )
    assert refused.status_code == 409 and a.sandbox_id in refused.json()["message"], refused.text
    a.kill()
    b.kill()
    assert vol.read_file("/b.txt") == "from-b", "the files outlive the sandboxes"


def test_the_content_api_works_without_a_sandbox(volumes):
    vol = volumes()
    stat = vol.write_file("/docs/readme.md", "# hello")
    assert (stat.type, stat.size, stat.path, stat.name) == (VolumeFileType.FILE, 7, "/docs/readme.md", "readme.md")
    assert vol.read_file("/docs/readme.md") == "# hello"
    assert vol.read_file("docs/readme.md", format="bytes") == b"# hello"

    # Streamed both ways: a 24 MiB body from a file object, read back in chunks.
    blob = secrets.token_bytes(1 << 20) * 24
    vol.write_file("/big.bin", io.BytesIO(blob))
    chunks = list(vol.read_file("/big.bin", format="stream"))
    assert len(chunks) > 1 and b"".join(chunks) == blob
    assert vol.get_info("/big.bin").size == len(blob)

    made = vol.make_dir("/a/b/c", force=True)
    assert made.type == VolumeFileType.DIRECTORY
    # Refused before a byte is written, a large upload still gets its
    # answer (the rest of the body is read and dropped), not a broken pipe.
    with pytest.raises(VolumeException, match="not a regular file"):
        vol.write_file("/a", io.BytesIO(blob * 2))
    with pytest.raises(VolumePathNotFoundException):
        vol.make_dir("/missing/parent/dir")
    top = {e.path for e in vol.list("/")}
    assert top == {"/docs", "/big.bin", "/a"}, top
    deep = {e.path for e in vol.list("/", depth=3)}
    assert {"/a/b", "/a/b/c", "/docs/readme.md"} <= deep, deep

    updated = vol.update_metadata("/docs/readme.md", mode=0o600, uid=0, gid=0)
    assert (updated.mode, updated.uid, updated.gid) == (0o600, 0, 0)
    assert vol.exists("/docs/readme.md") and not vol.exists("/nope")
    vol.remove("/docs")
    assert not vol.exists("/docs/readme.md")
    with pytest.raises(VolumePathNotFoundException):
        vol.read_file("/docs/readme.md")
    with pytest.raises(VolumePathNotFoundException):
        vol.remove("/docs")

    # The token is the credential: another volume's is answered as unknown.
    other = volumes()
    with pytest.raises(VolumePathNotFoundException):
        vol.read_file("/big.bin", token=other.token)
    unknown_query = httpx.get(
        f"{os.environ['E2B_VOLUME_API_URL']}/volumecontent/{vol.volume_id}/path",
        params={"path": "/a", "recursive": "1"},
        headers={"Authorization": f"Bearer {vol.token}"},
    )
    assert unknown_query.status_code == 400, unknown_query.text


@pytest.mark.timeout(300, func_only=True)
def test_a_volume_keeps_its_files_across_kill_pause_and_a_gateway_restart(volumes, gateway):
    vol = volumes()
    first = mounted(volumes, vol)
    first.commands.run("echo one > /mnt/data/kept.txt")
    first.kill()
    second = mounted(volumes, vol, path="/home/user/work")
    assert second.commands.run("cat /home/user/work/kept.txt").stdout == "one\n"

    second.pause()
    Sandbox.connect(second.sandbox_id)
    assert second.commands.run("cat /home/user/work/kept.txt").stdout == "one\n"
    # Paused without memory: it reboots from its files, the mount made again.
    second.pause(mode="filesystem")
    Sandbox.connect(second.sandbox_id)
    second.commands.run("echo two >> /home/user/work/kept.txt")
    assert vol.read_file("/kept.txt") == "one\ntwo\n"
    second.kill()

    stop_gateway(gateway)
    gateway.start(keep_sandboxes=True)
    try:
        kept = mounted(volumes, vol)
        kept.commands.run("echo three >> /mnt/data/kept.txt")
        stop_gateway(gateway)
        gateway.start()
        again = Sandbox.connect(kept.sandbox_id)
        assert again.commands.run("cat /mnt/data/kept.txt").stdout == "one\ntwo\nthree\n"
        assert Volume.get_info(vol.volume_id).token == vol.token
        assert vol.read_file("/kept.txt") == "one\ntwo\nthree\n"
    finally:
        if gateway.proc.poll() is not None:
            gateway.start()


def test_a_snapshot_records_the_mount_and_memory_is_refused(volumes):
    vol = volumes()
    sbx = mounted(volumes, vol)
    sbx.commands.run("echo in-volume > /mnt/data/v.txt && echo in-rootfs > /home/user/r.txt")
    with pytest.raises(SandboxException, match="volume mounts"):
        sbx.create_snapshot(mode="full")
    snap = sbx.create_snapshot(mode="filesystem")
    try:
        # Files only, and no volume: the child mounts what its create asks for.
        plain = Sandbox.create(template=snap.snapshot_id, timeout=60)
        volumes.sandboxes.append(plain)
        assert plain.commands.run("cat /home/user/r.txt").stdout == "in-rootfs\n"
        assert plain.commands.run("ls /mnt/data").stdout == "", "a snapshot is not a copy of the volume"
        child = Sandbox.create(template=snap.snapshot_id, timeout=60, volume_mounts={"/mnt/data": vol})
        volumes.sandboxes.append(child)
        assert child.commands.run("cat /mnt/data/v.txt").stdout == "in-volume\n"
    finally:
        Sandbox.delete_snapshot(snap.snapshot_id)


def test_mount_paths_and_unknown_volumes_are_refused(volumes, gateway):
    vol = volumes()
    for path in ["relative", "/", "/mnt/../etc", "/.copse", "/.copse/run/x", "/proc/x", "/dev", "/etc", "/usr/lib/x"]:
        response = api(gateway, "POST", "/sandboxes", json={"templateID": "base", "volumeMounts": [{"name": vol.name, "path": path}]})
        assert response.status_code == 400, (path, response.text)
    nested = [{"name": vol.name, "path": "/mnt/a"}, {"name": vol.name, "path": "/mnt/a/b"}]
    assert api(gateway, "POST", "/sandboxes", json={"templateID": "base", "volumeMounts": nested}).status_code == 400
    with pytest.raises(SandboxException, match="not found"):
        Sandbox.create(volume_mounts={"/mnt/data": "no-such-volume"})


def test_another_team_neither_sees_nor_mounts_a_volume(volumes, gateway):
    team_a, team_b = unique("va"), unique("vb")
    key_a = copse("keys", "create", "--team", team_a).strip()
    key_b = copse("keys", "create", "--team", team_b).strip()
    vol = volumes("shared-name", api_key=key_a)
    for method, path in [("GET", f"/volumes/{vol.volume_id}"), ("DELETE", f"/volumes/{vol.volume_id}")]:
        response = api(gateway, method, path, key=key_b)
        assert response.status_code == 404, (method, response.text)
    assert vol.volume_id not in {v.volume_id for v in Volume.list(api_key=key_b)}
    with pytest.raises(SandboxException, match="not found"):
        Sandbox.create(volume_mounts={"/mnt/data": "shared-name"}, api_key=key_b)
    # Names are per team.
    theirs = volumes("shared-name", api_key=key_b)
    assert theirs.volume_id != vol.volume_id
    listed = copse("volume", "ls")
    assert vol.volume_id in listed and theirs.volume_id in listed and team_a in listed
    assert "deleted volume" in copse("volume", "rm", "shared-name", "--team", team_b)
    assert Volume.destroy(theirs.volume_id, api_key=key_b) is False
    assert Volume.get_info(vol.volume_id, api_key=key_a).name == "shared-name"


@pytest.mark.timeout(240, func_only=True)
def test_a_volume_holds_no_more_than_its_teams_max_disk_gb(volumes):
    team = unique("vq")
    key = copse("keys", "create", "--team", team).strip()
    copse("teams", "set", team, "--max-disk-gb", "1")
    vol = volumes(api_key=key)
    sbx = mounted(volumes, vol, api_key=key)
    fill = sbx.commands.run(
        "dd if=/dev/urandom of=/mnt/data/fill bs=1M count=1300 conv=fsync 2>&1; echo rc=$?", timeout=200
    ).stdout
    assert "Disk quota exceeded" in fill and "rc=0" not in fill, fill
    with pytest.raises(VolumeException, match="507"):
        vol.write_file("/more.bin", secrets.token_bytes(64 << 20))


def tar_member(name: str, data: bytes = b"", size=None, **fields) -> bytes:
    """One raw tar member (header, then its data padded to 512 bytes), for
    archives `tarfile` would not write: a size with no data behind it,
    names it would clean up."""
    info = tarfile.TarInfo(name)
    info.size = len(data) if size is None else size
    for key, value in fields.items():
        setattr(info, key, value)
    return info.tobuf(format=tarfile.GNU_FORMAT) + data + b"\0" * (-len(data) % 512)


def volume_manifest(name: str, team: str = "default") -> bytes:
    return json.dumps(
        {"format": "copse-volume 1", "id": "x", "name": name, "team": team,
         "created_at_ms": 1, "quota_bytes": 1, "exported_at_ms": 1}
    ).encode()


def imported(volumes, output: str) -> Volume:
    """The volume `copse volume import` reported, deleted after the test."""
    volume_id = output.split()[2]
    vol = Volume.connect(volume_id)
    volumes.made.append((vol, {}))
    return vol


def test_an_exported_volume_imports_under_a_new_name_with_the_same_files(volumes, tmp_path):
    vol = volumes()
    vol.write_file("/docs/readme.md", "# hello")
    blob = secrets.token_bytes(3 << 20)
    vol.write_file("/data/blob.bin", io.BytesIO(blob))
    vol.update_metadata("/docs/readme.md", mode=0o600, uid=0, gid=0)
    sbx = mounted(volumes, vol)
    sbx.commands.run("cd /mnt/data && ln -s docs/readme.md link && mkdir -p empty/deeper")

    # Exported while the gateway runs and a sandbox mounts it.
    archive = tmp_path / "vol.tar"
    copse("volume", "export", vol.name, "--out", str(archive))
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        manifest = json.load(tar.extractfile("copse-volume.json"))
    assert members[0].name == "copse-volume.json"
    assert (manifest["name"], manifest["team"], manifest["id"]) == (vol.name, "default", vol.volume_id)
    assert manifest["quota_bytes"] > 0 and manifest["created_at_ms"] > 0
    assert vol.token not in archive.read_bytes().decode("latin-1"), "the token never leaves the host"
    link = next(m for m in members if m.name == "data/link")
    assert link.issym() and link.linkname == "docs/readme.md"

    copy = imported(volumes, copse("volume", "import", str(archive), "--name", unique("copy")))
    assert copy.volume_id != vol.volume_id and copy.token != vol.token
    assert copy.read_file("/docs/readme.md") == "# hello"
    assert copy.read_file("/data/blob.bin", format="bytes") == blob
    readme = copy.get_info("/docs/readme.md")
    assert (readme.mode, readme.uid, readme.gid) == (0o600, 0, 0)
    listed = {e.name: e for e in copy.list("/", depth=2)}
    assert listed["link"].type == VolumeFileType.SYMLINK and listed["link"].target == "docs/readme.md"
    assert listed["deeper"].type == VolumeFileType.DIRECTORY
    # Mounted, the copy reads as the original did.
    reader = mounted(volumes, copy)
    assert reader.commands.run("cat /mnt/data/link", user="root").stdout == "# hello"

    # The same name again is refused; stdin works.
    again = subprocess.run(
        [str(COPSE), "volume", "import", str(archive), "--name", copy.name, "--data-dir", str(DATA_DIR)],
        capture_output=True,
        text=True,
    )
    assert again.returncode != 0 and "already" in again.stderr, again.stderr
    piped = subprocess.run(
        [str(COPSE), "volume", "import", "-", "--name", unique("piped"), "--data-dir", str(DATA_DIR)],
        input=archive.read_bytes(),
        capture_output=True,
    )
    assert piped.returncode == 0, piped.stderr
    assert imported(volumes, piped.stdout.decode()).read_file("/docs/readme.md") == "# hello"


def test_an_import_larger_than_the_teams_volume_quota_is_refused_whole(volumes, tmp_path):
    team = unique("vqi")
    copse("keys", "create", "--team", team)
    copse("teams", "set", team, "--max-disk-gb", "1")
    name = unique("too-big")
    # The header claims 2 GiB; the refusal comes before any byte is read.
    archive = tmp_path / "big.tar"
    archive.write_bytes(
        tar_member("copse-volume.json", volume_manifest(name, team))
        + tar_member("data/small.txt", b"small")
        + tar_member("data/huge.bin", size=2 << 30)
    )
    done = subprocess.run(
        [str(COPSE), "volume", "import", str(archive), "--data-dir", str(DATA_DIR)], capture_output=True, text=True
    )
    assert done.returncode != 0 and "quota" in done.stderr, done.stderr
    assert name not in copse("volume", "ls"), "nothing of a refused import is kept"
