"""Templates from OCI images: an image built here, pushed to a real local
registry, pulled by `copse image pull` through `--registry-mirror`, and a
sandbox created from it through the SDK; and `Template.build` from such
images (mirrored and private registries)."""

import ipaddress
import os
import shutil
import subprocess
import tarfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from e2b import Sandbox, Template
from e2b.exceptions import BuildException
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

from conftest import API_KEY, BRIDGE, COPSE, DATA_DIR, SUBNET, Gateway, second_data_dir


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


BLOBS = DATA_DIR / "images" / "blobs" / "sha256"
DAY_S = 86_400


def aged(path, days: float):
    """`path`, last written `days` ago."""
    then = time.time() - days * DAY_S
    os.utime(path, (then, then))
    return path


@pytest.mark.timeout(300, func_only=True)
def test_a_pull_removes_the_blobs_no_pull_used_for_a_week_and_keeps_the_ones_it_used(gateway, registry, tmp_path):
    marker = f"blob-collection-{uuid.uuid4().hex[:8]}"
    tiny_root(tmp_path / "root", marker)
    oci_layout(tmp_path / "layout", "1", [layer(tree_members(tmp_path / "root"))])
    push(tmp_path / "layout", "1", registry, "copse-test/aging")
    BLOBS.mkdir(parents=True, exist_ok=True)
    stale = BLOBS / uuid.uuid4().hex.ljust(64, "0")
    stale.write_bytes(b"a layer nobody pulled for eight days")
    aged(stale, 8)
    young = BLOBS / uuid.uuid4().hex.ljust(64, "1")
    young.write_bytes(b"a layer pulled six days ago")
    aged(young, 6)
    leftover = BLOBS / f"{uuid.uuid4().hex.ljust(64, '2')}.partial-99999"
    leftover.write_bytes(b"half a download")
    name = f"oci-aging-{uuid.uuid4().hex[:6]}"
    try:
        first = copse_pull("docker.io/copse-test/aging:1", name, registry)
        assert first.returncode == 0, first.stderr
        assert "2 blob(s) downloaded, 0 from the cache" in first.stdout
        assert not stale.exists() and not leftover.exists()
        assert young.exists(), "a blob used within the week stays"
        # The image's own blobs, unused for eight days, are used again by
        # the next pull: they stay, stamped as used now.
        pushed = (tmp_path / "layout" / "blobs" / "sha256").iterdir()
        own = [BLOBS / p.name for p in pushed if (BLOBS / p.name).exists()]
        assert len(own) == 2, "the config and the layer"
        for blob in own:
            aged(blob, 8)
        second = copse_pull("docker.io/copse-test/aging:1", name, registry)
        assert second.returncode == 0, second.stderr
        assert "0 blob(s) downloaded, 2 from the cache" in second.stdout
        assert all(time.time() - blob.stat().st_mtime < 3600 for blob in own)
    finally:
        young.unlink(missing_ok=True)
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
    # Nor can an operator's pull take a name of the templates builds
    # unpack images into: those are collected once unused.
    out = copse_pull("docker.io/copse-test/tiny:1", "image-0123456789abcdef", registry)
    assert out.returncode != 0
    assert "collected once unused" in out.stderr


# Builds through the SDK's `Template.build` from images: a gateway of its own
# whose Docker Hub mirror is a test registry, and a second, private registry
# (htpasswd login) mirrored as `private.test`.

LOGIN = ("builder", f"pw-{uuid.uuid4().hex}")


@pytest.fixture(scope="module")
def builder(gateway, tmp_path_factory):
    work = tmp_path_factory.mktemp("image-builds")
    public = Registry(work / "public")
    private = Registry(work / "private", login=LOGIN)
    gw = Gateway(second_data_dir("image-builds"))
    second = ipaddress.ip_network(SUBNET).network_address.packed[1]
    gw.bridge = f"{BRIDGE[:9]}i"
    gw.start(
        extra_args=[
            "--bridge", gw.bridge, "--subnet", f"10.{(second + 130) % 256}.0.0/16",
            "--registry-mirror", f"docker.io=http://{public.host}",
            "--registry-mirror", f"private.test=http://{private.host}",
        ]
    )
    gw.env = dict(api_key=API_KEY, api_url=gw.url, sandbox_url=gw.url)
    gw.public, gw.private, gw.work = public, private, work
    yield gw
    gw.stop()
    public.close()
    private.close()
    for template in (gw.data_dir / "templates").glob("image-*"):
        shutil.rmtree(template, ignore_errors=True)
    subprocess.run(["nft", "delete", "table", "inet", f"copse_{gw.bridge}"], capture_output=True)
    subprocess.run(["ip", "link", "del", gw.bridge], capture_output=True)


def image_with(gw, registry: Registry, repository: str, login=None, tag="1", **config) -> str:
    """A tiny image of a new marker pushed to `registry`; its digest."""
    marker = uuid.uuid4().hex[:8]
    root = gw.work / f"root-{marker}"
    tiny_root(root, marker)  # bash alone: steps and commands use its builtins
    (root / "srv" / "app").mkdir(parents=True)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\nsvc:x:1500:1500::/srv:/bin/bash\n")
    layout = gw.work / f"layout-{marker}"
    digest = oci_layout(layout, tag, [layer(tree_members(root))], **config)
    push(layout, tag, registry, repository, login=login)
    return digest


def drop(gw, name: str):
    httpx.delete(f"{gw.url}/templates/{name}", headers={"x-api-key": API_KEY}, timeout=60)


@pytest.mark.timeout(600, func_only=True)
def test_a_template_built_from_an_image_runs_its_steps_with_the_images_env_and_workdir(builder):
    repository = f"copse-test/app-{uuid.uuid4().hex[:6]}"
    image_with(builder, builder.public, repository, env=["MODE=oci", "PATH=/usr/bin:/bin"], workdir="/srv/app",
               cmd=["/bin/false"])
    name, again = f"from-image-{uuid.uuid4().hex[:6]}", f"from-image-{uuid.uuid4().hex[:6]}"
    lines = []
    try:
        template = Template().from_image(f"{repository}:1").run_cmd("echo built-$MODE > ~/marker")
        Template.build(template, alias=name, on_build_logs=lines.append, **builder.env)
        messages = [e.message for e in lines]
        assert any("through the mirror http://" + builder.public.host in m for m in messages), messages
        assert any("not run" in m and "/bin/false" in m for m in messages), messages
        assert any("unpacking the image into template image-" in m for m in messages), messages
        fetched = builder.public.blob_gets(repository)
        assert fetched == 2  # config and layer

        sbx = Sandbox.create(name, timeout=60, **builder.env)
        try:
            run = sbx.commands.run('echo "$MODE"; pwd; read -r m < ~/marker; echo "$m"; echo "$UID"')
            assert run.stdout.split() == ["oci", "/srv/app", "built-oci", "1000"]
        finally:
            sbx.kill()

        # Another template of the same image: nothing is downloaded or unpacked again.
        lines.clear()
        Template.build(Template().from_image(f"{repository}:1").run_cmd("true"), alias=again,
                       on_build_logs=lines.append, **builder.env)
        messages = [e.message for e in lines]
        assert any("already holds this image: not unpacked again" in m for m in messages), messages
        assert not any("unpacking the image" in m for m in messages), messages
        assert builder.public.blob_gets(repository) == fetched
    finally:
        drop(builder, name)
        drop(builder, again)


@pytest.mark.timeout(600, func_only=True)
def test_an_image_template_goes_with_the_last_template_and_sandbox_standing_on_it(builder):
    repository = f"copse-test/gc-{uuid.uuid4().hex[:6]}"
    digest = image_with(builder, builder.public, repository)
    unpacked = builder.data_dir / "templates" / f"image-{digest.removeprefix('sha256:')[:16]}"
    first, second = f"gc-{uuid.uuid4().hex[:6]}", f"gc-{uuid.uuid4().hex[:6]}"
    sbx = None
    try:
        for name in (first, second):
            Template.build(Template().from_image(f"{repository}:1").run_cmd("echo $RANDOM > /tmp/x"), alias=name,
                           **builder.env)
        assert unpacked.is_dir()
        sbx = Sandbox.create(first, timeout=120, **builder.env)
        drop(builder, first)
        assert unpacked.is_dir(), "the second template still stands on it"
        drop(builder, second)
        # No template uses it; the sandbox still runs on it.
        assert unpacked.is_dir()
        assert sbx.commands.run("read -r m < /etc/image-marker && read -r x < /tmp/x").exit_code == 0
        sbx.kill()
        sbx = None
        assert not unpacked.exists(), "collected once its last sandbox went"
        assert not list(unpacked.parent.glob(f".{unpacked.name}.*")), "nothing of it left aside"

        # A new build of that image unpacks it again and runs.
        lines = []
        Template.build(Template().from_image(f"{repository}:1").run_cmd("true"), alias=first,
                       on_build_logs=lines.append, **builder.env)
        assert any("unpacking the image into template image-" in e.message for e in lines), lines
        again = Sandbox.create(first, timeout=60, **builder.env)
        try:
            assert again.commands.run("read -r m < /etc/image-marker").exit_code == 0
        finally:
            again.kill()
        assert unpacked.is_dir(), "the template still stands on it"
    finally:
        if sbx is not None:
            sbx.kill()
        drop(builder, first)
        drop(builder, second)
    assert not unpacked.exists()


@pytest.mark.timeout(600, func_only=True)
def test_an_images_user_is_the_templates_default_user_when_it_has_that_account(builder):
    repository = f"copse-test/svc-{uuid.uuid4().hex[:6]}"
    image_with(builder, builder.public, repository, user="svc")
    name = f"image-user-{uuid.uuid4().hex[:6]}"
    try:
        Template.build(Template().from_image(f"{repository}:1").run_cmd("echo $UID > /tmp/builder"), alias=name,
                       **builder.env)
        sbx = Sandbox.create(name, timeout=60, **builder.env)
        try:
            assert sbx.commands.run('read -r b < /tmp/builder; echo "$b"; echo "$UID"').stdout.split() == ["1500", "1500"]
        finally:
            sbx.kill()
    finally:
        drop(builder, name)


@pytest.mark.timeout(600, func_only=True)
def test_concurrent_builds_of_one_image_pull_and_unpack_it_once(builder):
    repository = f"copse-test/twice-{uuid.uuid4().hex[:6]}"
    image_with(builder, builder.public, repository)
    names = [f"twice-{uuid.uuid4().hex[:6]}" for _ in range(2)]
    logs = {name: [] for name in names}
    try:
        with ThreadPoolExecutor(2) as pool:
            done = [
                pool.submit(Template.build, Template().from_image(f"{repository}:1").run_cmd("true"), alias=name,
                            on_build_logs=logs[name].append, **builder.env)
                for name in names
            ]
            for future in done:
                future.result()
        unpacked = [name for name in names if any("unpacking the image" in e.message for e in logs[name])]
        assert len(unpacked) == 1, {n: [e.message for e in logs[n]] for n in names}
        assert builder.public.blob_gets(repository) == 2
    finally:
        for name in names:
            drop(builder, name)


@pytest.mark.timeout(600, func_only=True)
def test_a_private_registry_needs_the_builds_username_and_password(builder):
    repository = "copse-test/secret"
    image_with(builder, builder.private, repository, login=LOGIN)
    image = f"private.test/{repository}:1"
    name = f"private-{uuid.uuid4().hex[:6]}"
    try:
        with pytest.raises(BuildException) as refused:
            Template.build(Template().from_image(image).run_cmd("true"), alias=name, **builder.env)
        assert f"pulling {image}" in str(refused.value), str(refused.value)
        with pytest.raises(BuildException):
            Template.build(Template().from_image(image, username=LOGIN[0], password="wrong").run_cmd("true"),
                           alias=name, **builder.env)
        assert builder.private.blob_gets(repository) == 0

        lines = []
        Template.build(Template().from_image(image, username=LOGIN[0], password=LOGIN[1]).run_cmd("true"),
                       alias=name, on_build_logs=lines.append, **builder.env)
        assert builder.private.blob_gets(repository) == 2
        assert not any(LOGIN[1] in e.message for e in lines)
        sbx = Sandbox.create(name, timeout=60, **builder.env)
        try:
            assert sbx.commands.run("read -r m < /etc/image-marker").exit_code == 0
        finally:
            sbx.kill()
        # The password is nowhere the gateway keeps things: store, logs.
        kept = [builder.data_dir / "gateway.log", *builder.data_dir.glob("copse.db*"),
                *(builder.data_dir / "logs").glob("*")]
        for path in kept:
            if path.is_file():
                assert LOGIN[1].encode() not in path.read_bytes(), path
    finally:
        drop(builder, name)


@pytest.mark.timeout(600, func_only=True)
def test_debian_images_are_pulled_once_docker_hub_is_mirrored_and_the_log_says_so(builder):
    image_with(builder, builder.public, "library/debian", tag="bookworm", env=["FROM_MIRROR=yes"])
    name = f"debian-{uuid.uuid4().hex[:6]}"
    lines = []
    try:
        Template.build(Template().from_debian_image("bookworm").run_cmd("true"), alias=name,
                       on_build_logs=lines.append, **builder.env)
        messages = [e.message for e in lines]
        assert any("docker.io/library/debian:bookworm pulled through the mirror" in m for m in messages), messages
        assert not any("copse's template base" in m for m in messages), messages
        sbx = Sandbox.create(name, timeout=60, **builder.env)
        try:
            assert sbx.commands.run('echo "$FROM_MIRROR"').stdout == "yes\n"
        finally:
            sbx.kill()
    finally:
        drop(builder, name)


def test_cloud_registry_logins_are_refused_with_what_copse_supports(builder):
    template = Template().from_aws_registry("1.dkr.ecr.eu-west-1.amazonaws.com/x:1", access_key_id="AKIA",
                                            secret_access_key="s", region="eu-west-1").run_cmd("true")
    with pytest.raises(BuildException) as refused:
        Template.build(template, alias=f"aws-{uuid.uuid4().hex[:6]}", **builder.env)
    assert "type aws is not supported" in str(refused.value) and "username and password" in str(refused.value)
