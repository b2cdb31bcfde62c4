"""Offline checks of patches/: the manifest names every file the diffs touch,
the diffs parse, and their checksums match the manifest. Needs neither a
gateway nor FreeBSD sources (patches/check-apply does the apply check)."""

import hashlib
import pathlib
import re
import shutil
import subprocess

import pytest

PATCHES = pathlib.Path(__file__).resolve().parent.parent / "patches"
MANIFEST = PATCHES / "base-manifest.txt"


def manifest():
    rev, files, diffs = None, {}, {}
    for line in MANIFEST.read_text().splitlines():
        f = line.split()
        if not f or f[0].startswith("#"):
            continue
        if f[0] == "revision":
            rev = f[1]
        elif f[0] == "file":
            files[f[1]] = (f[2], f[3])
        elif f[0] == "diff":
            diffs[f[1]] = f[2]
    return rev, files, diffs


def touched(diff: pathlib.Path):
    return set(re.findall(r"^diff --git a/(\S+) b/", diff.read_text(), re.M))


def test_manifest_pins_a_full_revision():
    rev, files, diffs = manifest()
    assert rev and re.fullmatch(r"[0-9a-f]{40}", rev)
    for path, (blob, _src) in files.items():
        assert blob == "-" or re.fullmatch(r"[0-9a-f]{40}", blob), path


def test_manifest_lists_every_diff_and_touched_file():
    _, files, diffs = manifest()
    on_disk = {p.name for p in PATCHES.glob("*.diff")}
    assert set(diffs) == on_disk
    for name in diffs:
        missing = touched(PATCHES / name) - set(files)
        assert not missing, f"{name} touches files the manifest does not name: {missing}"


def test_diff_checksums_match_manifest():
    _, _, diffs = manifest()
    for name, want in diffs.items():
        have = hashlib.sha256((PATCHES / name).read_bytes()).hexdigest()
        assert have == want, f"{name} changed: update patches/base-manifest.txt ({have})"


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_diffs_parse():
    _, _, diffs = manifest()
    for name in diffs:
        r = subprocess.run(["git", "apply", "--stat", str(PATCHES / name)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert touched(PATCHES / name), name
        assert "excerpt gap" not in (PATCHES / name).read_text()
