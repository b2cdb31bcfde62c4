"""Moving files in and out of a sandbox through the official SDK's `files`
module, and through the signed links `download_url()`/`upload_url()`."""

import hashlib
import io
import os
import shlex
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

import pytest
from e2b import FileNotFoundException, FileType, FilesystemEventType, NotFoundException

HOME = "/home/user"


def sha256_inside(sandbox, path: str) -> str:
    return sandbox.commands.run(f"sha256sum {shlex.quote(path)}", timeout=60).stdout.split()[0]


def test_text_file_round_trip(sandbox):
    text = "hello from the SDK\nzweite Zeile: ünïcödé ✓\n"
    info = sandbox.files.write(f"{HOME}/hello.txt", text)
    assert info.path == f"{HOME}/hello.txt"
    assert info.name == "hello.txt"
    assert sandbox.files.read(f"{HOME}/hello.txt") == text
    assert sandbox.commands.run(f"cat {HOME}/hello.txt").stdout == text
    # Written as the default user, in its home.
    assert sandbox.commands.run(f"stat -c %U {HOME}/hello.txt").stdout == "user\n"


def test_five_megabyte_binary_round_trip_checked_inside_the_sandbox(sandbox):
    data = os.urandom(5 * 1024 * 1024)
    digest = hashlib.sha256(data).hexdigest()

    sandbox.files.write(f"{HOME}/blob.bin", data)  # multipart upload
    assert sha256_inside(sandbox, f"{HOME}/blob.bin") == digest
    assert sandbox.commands.run(f"stat -c %s {HOME}/blob.bin").stdout == f"{len(data)}\n"

    sandbox.files.write(f"{HOME}/blob-stream.bin", io.BytesIO(data))  # octet-stream upload
    assert sha256_inside(sandbox, f"{HOME}/blob-stream.bin") == digest

    back = sandbox.files.read(f"{HOME}/blob.bin", format="bytes")
    assert len(back) == len(data)
    assert hashlib.sha256(back).hexdigest() == digest

    streamed = b"".join(sandbox.files.read(f"{HOME}/blob-stream.bin", format="stream"))
    assert hashlib.sha256(streamed).hexdigest() == digest


def test_unicode_and_spaces_in_paths(sandbox):
    directory = f"{HOME}/dir with spaces/ünï код"
    path = f"{directory}/файл 文件 ✓.txt"
    sandbox.files.write(path, "content ✓")
    assert sandbox.files.read(path) == "content ✓"
    assert sandbox.files.exists(path)
    assert sandbox.commands.run(f"cat {shlex.quote(path)}").stdout == "content ✓"
    names = [e.name for e in sandbox.files.list(directory)]
    assert names == ["файл 文件 ✓.txt"]
    info = sandbox.files.get_info(path)
    assert info.name == "файл 文件 ✓.txt"
    assert info.path == path


def test_write_files_writes_several_files_at_once(sandbox):
    files = [
        {"path": f"{HOME}/multi/a.txt", "data": "alpha"},
        {"path": f"{HOME}/multi/b.bin", "data": b"\x00\x01\x02beta"},
        {"path": f"{HOME}/multi/sub/c.txt", "data": "gamma ✓"},
    ]
    infos = sandbox.files.write_files(files)
    assert sorted(i.path for i in infos) == sorted(f["path"] for f in files)
    assert sandbox.files.read(f"{HOME}/multi/a.txt") == "alpha"
    assert bytes(sandbox.files.read(f"{HOME}/multi/b.bin", format="bytes")) == b"\x00\x01\x02beta"
    assert sandbox.files.read(f"{HOME}/multi/sub/c.txt") == "gamma ✓"


def test_reading_a_missing_file_raises_file_not_found(sandbox):
    missing = f"{HOME}/does-not-exist.txt"
    with pytest.raises(FileNotFoundException):
        sandbox.files.read(missing)
    with pytest.raises(FileNotFoundException):
        sandbox.files.get_info(missing)
    with pytest.raises(FileNotFoundException):
        sandbox.files.list(f"{HOME}/no-such-dir")
    with pytest.raises(NotFoundException):
        sandbox.files.rename(missing, f"{HOME}/elsewhere.txt")


def test_exists_tells_files_and_directories_from_missing_paths(sandbox):
    sandbox.files.write(f"{HOME}/present.txt", "x")
    assert sandbox.files.exists(f"{HOME}/present.txt") is True
    assert sandbox.files.exists(HOME) is True
    assert sandbox.files.exists(f"{HOME}/absent.txt") is False


def test_make_dir_twice_reports_the_directory_already_exists(sandbox):
    path = f"{HOME}/new/nested/dir"
    assert sandbox.files.make_dir(path) is True
    assert sandbox.files.make_dir(path) is False
    assert sandbox.files.get_info(path).type == FileType.DIR
    assert sandbox.commands.run(f"test -d {path} && stat -c %U {path}").stdout == "user\n"


def test_list_shows_files_and_directories_with_their_types(sandbox):
    base = f"{HOME}/listing"
    sandbox.files.write(f"{base}/one.txt", "1")
    sandbox.files.write(f"{base}/two.txt", "22")
    sandbox.files.make_dir(f"{base}/sub")
    sandbox.files.write(f"{base}/sub/deep.txt", "333")

    entries = {e.name: e for e in sandbox.files.list(base)}
    assert set(entries) == {"one.txt", "two.txt", "sub"}
    assert entries["one.txt"].type == FileType.FILE
    assert entries["two.txt"].size == 2
    assert entries["sub"].type == FileType.DIR
    assert entries["one.txt"].path == f"{base}/one.txt"

    deep = {e.path for e in sandbox.files.list(base, depth=2)}
    assert f"{base}/sub/deep.txt" in deep


def test_get_info_reports_type_size_and_owner(sandbox):
    sandbox.files.write(f"{HOME}/info.txt", "12345")
    info = sandbox.files.get_info(f"{HOME}/info.txt")
    assert info.type == FileType.FILE
    assert info.size == 5
    assert info.name == "info.txt"
    assert info.path == f"{HOME}/info.txt"
    assert info.owner == "user"
    assert info.permissions.startswith("-")

    home = sandbox.files.get_info(HOME)
    assert home.type == FileType.DIR
    assert home.name == "user"


def test_rename_moves_a_file(sandbox):
    sandbox.files.write(f"{HOME}/old name.txt", "moving")
    entry = sandbox.files.rename(f"{HOME}/old name.txt", f"{HOME}/new name.txt")
    assert entry.path == f"{HOME}/new name.txt"
    assert entry.name == "new name.txt"
    assert sandbox.files.exists(f"{HOME}/old name.txt") is False
    assert sandbox.files.read(f"{HOME}/new name.txt") == "moving"


def test_remove_deletes_files_and_whole_directories(sandbox):
    sandbox.files.write(f"{HOME}/gone.txt", "x")
    sandbox.files.write(f"{HOME}/gone-dir/inner/file.txt", "y")
    sandbox.files.remove(f"{HOME}/gone.txt")
    sandbox.files.remove(f"{HOME}/gone-dir")
    assert sandbox.files.exists(f"{HOME}/gone.txt") is False
    assert sandbox.files.exists(f"{HOME}/gone-dir") is False


def test_watch_dir_reports_a_created_file(sandbox):
    watched = f"{HOME}/watched"
    sandbox.files.make_dir(watched)
    handle = sandbox.files.watch_dir(watched)
    try:
        sandbox.files.write(f"{watched}/created.txt", "hello")
        sandbox.commands.run(f"touch {watched}/touched.txt")
        seen = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seen.extend(handle.get_new_events())
            names = {(e.name, e.type) for e in seen}
            if ("created.txt", FilesystemEventType.CREATE) in names and (
                "touched.txt",
                FilesystemEventType.CREATE,
            ) in names:
                break
            time.sleep(0.2)
        names = {(e.name, e.type) for e in seen}
        assert ("created.txt", FilesystemEventType.CREATE) in names, seen
        assert ("touched.txt", FilesystemEventType.CREATE) in names, seen
    finally:
        handle.stop()


def test_signed_download_and_upload_links_work_without_headers(sandbox):
    content = f"signed {uuid.uuid4()} ✓".encode()
    sandbox.files.write(f"{HOME}/shared.txt", content)

    url = sandbox.download_url(f"{HOME}/shared.txt")
    assert "signature=" in url
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        assert response.read() == content

    upload = f"{HOME}/uploaded via link.bin"
    payload = os.urandom(256 * 1024)
    boundary = uuid.uuid4().hex
    body = (
        f"--{boundary}\r\n"
        f'Content-Disposition: form-data; name="file"; filename="upload.bin"\r\n'
        f"Content-Type: application/octet-stream\r\n\r\n"
    ).encode() + payload + f"\r\n--{boundary}--\r\n".encode()
    request = urllib.request.Request(
        sandbox.upload_url(upload),
        data=body,
        method="POST",
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert 200 <= response.status < 300
    assert sha256_inside(sandbox, upload) == hashlib.sha256(payload).hexdigest()


def test_tampered_or_mismatched_signed_links_are_refused(sandbox):
    sandbox.files.write(f"{HOME}/secret.txt", "secret")
    url = sandbox.download_url(f"{HOME}/secret.txt")

    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query))
    query["signature"] = query["signature"][:-2] + ("AA" if not query["signature"].endswith("AA") else "BB")
    tampered = urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(tampered, timeout=30)
    # Signed links carry no sandbox header: a signature that matches no
    # sandbox may fairly be "not found" rather than "unauthorized".
    assert caught.value.code in (401, 403, 404)
    assert b"secret" not in caught.value.read()

    # A link signed for one path does not open another.
    query = dict(urllib.parse.parse_qsl(parts.query))
    query["path"] = "/etc/shadow"
    other = urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(other, timeout=30)
    assert caught.value.code in (401, 403, 404)
