"""Templates from OCI images: an image built here, pushed to a real local
registry, pulled by `copse image pull` through `--registry-mirror`, and a
sandbox created from it through the SDK."""

import subprocess
import tarfile
import uuid

import pytest
from e2b import Sandbox
from oci_registry import (
    Registry,
    copse_pull,
    layer,
    member,
    oci_layout,
    push,
    remove_template,
    tiny_root,
    tree_members,
)

from conftest import COPSE, DATA_DIR


@pytest.fixture
def registry(tmp_path):
    reg = Registry(tmp_path)
    yield reg
    reg.close()


@pytest.mark.timeout(300, func_only=True)
def test_an_image_from_a_mirror_becomes_a_template_sandboxes_run_in(gateway, registry, tmp_path):
    # A marker of this run: the template cannot be a leftover of another.
    marker = f"from-an-oci-image-{uuid.uuid4().hex[:8]}"
    root = tmp_path / "root"
    tiny_root(root, marker)
    (root / "etc" / "removed").write_text("lower layer\n")
    (root / "opt" / "data").mkdir(parents=True)
    (root / "opt" / "data" / "old").write_text("lower layer\n")
    base = layer(tree_members(root) + [member("etc/marker-link", kind=tarfile.LNKTYPE, link="etc/image-marker")])
    # The upper layer deletes a file (whiteout), replaces a directory's
    # contents (opaque) and adds a file.
    upper = layer(
        [
            member("etc/.wh.removed"),
            member("opt/data", kind=tarfile.DIRTYPE),
            member("opt/data/.wh..wh..opq"),
            # The marker makes this layer's digest new too, so a blob cache
            # a previous run left in the data dir holds none of them.
            member("opt/data/new", f"upper layer {marker}\n".encode()),
        ]
    )
    digest = oci_layout(tmp_path / "layout", "1", [base, upper], env=["MODE=oci"])
    push(tmp_path / "layout", "1", registry, "copse-test/tiny")
    name = f"oci-tiny-{uuid.uuid4().hex[:6]}"
    try:
        first = copse_pull("docker.io/copse-test/tiny:1", name, registry)
        assert first.returncode == 0, first.stderr
        assert f"template {name} from docker.io/copse-test/tiny:1 ({digest})" in first.stdout
        assert "3 blob(s) downloaded, 0 from the cache" in first.stdout
        fetched = registry.blob_gets("copse-test/tiny")
        assert fetched == 3  # config and two layers

        sbx = Sandbox.create(name, timeout=60)
        try:
            run = sbx.commands.run('read -r x < /etc/image-marker; echo "$x"; echo "$UID"')
            assert run.stdout.split()[0] == marker
            assert run.stdout.split()[1] == "1000", "commands run as the account copse added"
            seen = sbx.commands.run(
                '[ -e /etc/removed ] && echo present || echo gone; echo /opt/data/*; read -r y < /etc/marker-link; echo "$y"'
            ).stdout.split("\n")
            assert seen[0] == "gone"
            assert seen[1] == "/opt/data/new"
            assert seen[2] == marker
        finally:
            sbx.kill()

        # Again: every blob comes from the cache, none from the registry.
        second = copse_pull("docker.io/copse-test/tiny:1", name, registry)
        assert second.returncode == 0, second.stderr
        assert "0 blob(s) downloaded, 3 from the cache" in second.stdout
        assert registry.blob_gets("copse-test/tiny") == fetched
    finally:
        remove_template(name)


def test_a_registry_that_is_not_a_named_mirror_is_never_reached_over_plain_http(gateway, registry, tmp_path):
    root = tmp_path / "root"
    tiny_root(root, "x")
    oci_layout(tmp_path / "layout", "1", [layer(tree_members(root))])
    push(tmp_path / "layout", "1", registry, "copse-test/plain")
    # Named directly, not through a mirror: copse speaks HTTPS to it, which
    # the plain-HTTP registry cannot answer.
    out = subprocess.run(
        [str(COPSE), "image", "pull", f"{registry.host}/copse-test/plain:1", "--name", "oci-plain",
         "--data-dir", str(DATA_DIR)],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode != 0
    assert registry.blob_gets("copse-test/plain") == 0
    assert not (DATA_DIR / "templates" / "oci-plain").exists()


def test_a_built_in_template_cannot_be_replaced_by_an_image(gateway, registry):
    out = copse_pull("docker.io/copse-test/tiny:1", "base", registry)
    assert out.returncode != 0
    assert "built-in" in out.stderr
