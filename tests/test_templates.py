"""A user's own template, built through the unchanged SDK's
`Template.build`: the steps run in a real sandbox of the base, their
output reaches `on_build_logs`, a failing step names itself, and
`Sandbox.create(name)` gets the built files, environment, user and working
directory, with the start command running and ready (restored from the
build's memory snapshot, where the substrate keeps memory). Templates belong to
the team that built them."""

import io
import json
import os
import secrets
import subprocess
import tarfile
import time

import httpx
import leakcheck
import pytest
from conftest import API_KEY, DATA_DIR, ROOT, free_port, wheel
from e2b import Sandbox, SandboxException, Template
from e2b.exceptions import BuildException
from test_leaks import stop_gateway
from test_tenancy import new_key, new_team
from test_volumes import volumes  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(600, func_only=True)


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def api(gateway, method: str, path: str, key: str = API_KEY) -> httpx.Response:
    return httpx.request(method, gateway.url + path, headers={"x-api-key": key}, timeout=60)


def delete_template(gateway, name: str, key: str = API_KEY):
    api(gateway, "DELETE", f"/templates/{name}", key)


@pytest.fixture
def context(tmp_path):
    """A build context: a directory with an executable, a nested file and a
    relative symlink."""
    app = tmp_path / "app"
    (app / "sub").mkdir(parents=True)
    (app / "main.sh").write_text("#!/bin/sh\necho main-ran\n")
    os.chmod(app / "main.sh", 0o750)
    (app / "sub" / "data.txt").write_text("nested data\n")
    os.symlink("main.sh", app / "link.sh")
    return tmp_path


def test_a_template_built_from_base_gives_its_sandboxes_files_envs_user_and_workdir(gateway, context):
    name = unique("app")
    lines = []
    template = (
        Template(file_context_path=str(context))
        .from_template("base")
        .copy("app/", "/home/user/app/")
        .set_envs({"MODE": "two words"})
        .set_workdir("/home/user/app")
        .run_cmd("echo built-$MODE > marker.txt && echo line-from-the-build")
        .make_dir("/opt/tool", user="root")
        .run_cmd("whoami > /opt/tool/builder", user="root")
        .make_symlink("/home/user/app/main.sh", "/opt/tool/main", user="root")
    )
    try:
        info = Template.build(template, alias=name, on_build_logs=lines.append)
        messages = [entry.message for entry in lines]
        assert any("line-from-the-build" in m for m in messages), messages
        assert any("[2/" in m and "ENV" in m for m in messages), messages
        assert Template.alias_exists(name)
        assert api(gateway, "GET", f"/templates/aliases/{name}").json()["templateID"] == info.template_id

        sbx = Sandbox.create(name, timeout=60)
        try:
            run = sbx.commands.run
            assert run("cat /home/user/app/marker.txt").stdout == "built-two words\n"
            assert run("echo $MODE").stdout == "two words\n"
            # Modes, owner and the symlink came through the upload.
            assert run("stat -c '%a %U' /home/user/app/main.sh").stdout == "750 user\n"
            assert run("readlink /home/user/app/link.sh").stdout == "main.sh\n"
            assert run("cat /home/user/app/sub/data.txt").stdout == "nested data\n"
            assert run("/opt/tool/main").stdout == "main-ran\n"
            assert run("cat /opt/tool/builder").stdout == "root\n"
            assert run("whoami").stdout == "user\n"
            # WORKDIR is where a command with no cwd runs, as in E2B.
            assert run("pwd").stdout == "/home/user/app\n"
            assert run("pwd", cwd="/tmp").stdout == "/tmp\n"
            # The caller's own environment wins over the template's.
        finally:
            sbx.kill()
        other = Sandbox.create(name, timeout=60, envs={"MODE": "mine"})
        try:
            assert other.commands.run("echo $MODE").stdout == "mine\n"
        finally:
            other.kill()
    finally:
        delete_template(gateway, name)
    assert not Template.alias_exists(name)


def test_a_failing_step_fails_the_build_naming_the_step_and_its_output(gateway):
    name = unique("broken")
    lines = []
    template = (
        Template()
        .from_template("base")
        .run_cmd("echo fine")
        .run_cmd("echo about-to-fail >&2; exit 3")
        .run_cmd("echo never-runs")
    )
    try:
        with pytest.raises(BuildException) as failed:
            Template.build(template, alias=name, on_build_logs=lines.append)
        message = str(failed.value)
        assert "step 2" in message and "exit code 3" in message and "about-to-fail" in message, message
        assert not any("never-runs" in entry.message for entry in lines if "RUN" not in entry.message)
        # A failed first build leaves nothing to create a sandbox from.
        with pytest.raises(Exception):
            Sandbox.create(name, timeout=30)
    finally:
        delete_template(gateway, name)
    # The build sandbox is gone.
    assert not [s for s in Sandbox.list().next_items() if (s.metadata or {}).get("copse.build")]


def test_the_start_command_is_ready_when_create_returns(gateway):
    name = unique("server")
    template = (
        Template()
        .from_template("base")
        .run_cmd("mkdir -p /home/user/site && echo served-page > /home/user/site/index.html")
        .set_workdir("/home/user/site")
        .set_start_cmd("python3 -m http.server 8080", ready_cmd="curl -sf localhost:8080 >/dev/null")
    )
    try:
        Template.build(template, alias=name)
        sbx = Sandbox.create(name, timeout=60)
        try:
            # No wait: the ready command already succeeded.
            assert sbx.commands.run("curl -s localhost:8080/index.html").stdout == "served-page\n"
        finally:
            sbx.kill()
    finally:
        delete_template(gateway, name)


def test_a_running_template_is_restored_with_its_server_already_up(gateway, volumes):
    name = unique("running")
    lines = []
    # Each run of the start command leaves a line and its pid; the server
    # is that same process (exec).
    start = "echo ran >> /home/user/start-runs; echo $$ > /home/user/start-pid; exec python3 -m http.server 8080"
    template = (
        Template()
        .from_template("base")
        .run_cmd("mkdir -p /home/user/site && echo served-page > /home/user/site/index.html")
        .set_workdir("/home/user/site")
        .set_start_cmd(start, ready_cmd="curl -sf localhost:8080 >/dev/null")
    )
    try:
        Template.build(template, alias=name, on_build_logs=lines.append)
        log = "\n".join(entry.message for entry in lines)
        assert "Saving the template's files and running processes" in log, log
        sbx = Sandbox.create(name, timeout=60)
        try:
            # The first request, no retry: the server was restored running.
            response = httpx.get(gateway.url + "/index.html", headers={"host": sbx.get_host(8080)}, timeout=10)
            assert response.status_code == 200 and response.text == "served-page\n", response.text
            # The start command ran once, at build time, not at this create.
            assert sbx.commands.run("cat /home/user/start-runs").stdout == "ran\n"
            pid = sbx.commands.run("cat /home/user/start-pid").stdout.strip()
            assert sbx.commands.run(f"cat /proc/{pid}/cmdline | tr '\\0' ' '").stdout.startswith("python3 -m http.server")
        finally:
            sbx.kill()
        # A memory image cannot take volume mounts, as a memory snapshot cannot.
        with pytest.raises(SandboxException, match="volume mounts"):
            Sandbox.create(name, timeout=60, volume_mounts={"/mnt/data": volumes()})
    finally:
        delete_template(gateway, name)


def test_a_ready_command_that_never_succeeds_fails_the_build_with_its_output(gateway):
    name = unique("never-ready")
    lines = []
    template = (
        Template()
        .from_template("base")
        .set_start_cmd("sleep infinity", ready_cmd="echo still-not-ready-marker >&2; exit 1")
    )
    try:
        with pytest.raises(BuildException) as failed:
            Template.build(template, alias=name, on_build_logs=lines.append)
        message = str(failed.value)
        assert "ready command did not succeed" in message and "still-not-ready-marker" in message, message
        with pytest.raises(Exception):
            Sandbox.create(name, timeout=30)
    finally:
        delete_template(gateway, name)
    assert not [s for s in Sandbox.list().next_items() if (s.metadata or {}).get("copse.build")]


def test_workdir_makes_missing_directories_owned_by_the_build_user(gateway):
    """A missing directory is made, with its missing parents, owned by the
    current USER, even under a directory that user cannot write (/opt) or
    enter (/root); an existing one is left as it is."""
    name = unique("workdir")
    template = (
        Template()
        .from_template("base")
        .set_user("user")
        .set_workdir("/opt/app/sub")
        .run_cmd("touch made-here")
        .set_workdir("/root/private")
        .run_cmd("touch mine")
        .set_workdir("/etc")
        .run_cmd("pwd > /tmp/where")
    )
    try:
        Template.build(template, alias=name)
        sbx = Sandbox.create(name, timeout=60)
        try:
            owners = sbx.commands.run(
                "stat -c '%n %U' /opt /opt/app /opt/app/sub /opt/app/sub/made-here /root /root/private /etc",
                user="root",
            ).stdout.split("\n")
            assert owners[:-1] == [
                "/opt root",
                "/opt/app user",
                "/opt/app/sub user",
                "/opt/app/sub/made-here user",
                "/root root",
                "/root/private user",
                "/etc root",
            ], owners
            assert sbx.commands.run("test -f /root/private/mine", user="root").exit_code == 0
            assert sbx.commands.run("cat /tmp/where").stdout == "/etc\n"
        finally:
            sbx.kill()
    finally:
        delete_template(gateway, name)


def test_a_template_built_from_another_keeps_its_files_and_settings(gateway):
    parent, child = unique("parent"), unique("child")
    try:
        Template.build(Template().from_template("base").set_envs({"LAYER": "one"}).run_cmd("echo 1 > ~/one"), alias=parent)
        Template.build(Template().from_template(parent).run_cmd("echo $LAYER-2 > ~/two"), alias=child)
        sbx = Sandbox.create(child, timeout=60)
        try:
            assert sbx.commands.run("cat ~/one ~/two").stdout == "1\none-2\n"
        finally:
            sbx.kill()
    finally:
        delete_template(gateway, child)
        delete_template(gateway, parent)


def test_another_teams_template_is_404_everywhere(gateway):
    name = unique("private")
    other = new_key(new_team("tmpl"))
    try:
        info = Template.build(Template().from_template("base").run_cmd("true"), alias=name)
        for path in (
            f"/templates/{info.template_id}",
            f"/templates/aliases/{name}",
            f"/templates/{info.template_id}/builds/{info.build_id}/status",
            f"/templates/{info.template_id}/files/{'a' * 64}",
        ):
            response = api(gateway, "GET", path, other)
            assert response.status_code == 404, (path, response.text)
            assert response.json()["code"] == 404
        assert api(gateway, "DELETE", f"/templates/{info.template_id}", other).status_code == 404
        assert not Template.alias_exists(name, api_key=other)
        with pytest.raises(Exception):
            Sandbox.create(name, api_key=other, timeout=30)
        # Still there for its own team.
        assert Template.alias_exists(name)
        listed = api(gateway, "GET", "/v2/templates").json()
        assert info.template_id in [t["templateID"] for t in listed]
        assert info.template_id not in [t["templateID"] for t in api(gateway, "GET", "/v2/templates", other).json()]
    finally:
        delete_template(gateway, name)


def test_an_image_from_an_unreachable_registry_fails_the_build_naming_it(gateway):
    # No mirror names this loopback port: copse speaks HTTPS to it, and
    # nothing listens there.
    image = f"127.0.0.1:{free_port()}/someone/thing:1"
    name = unique("image")
    try:
        with pytest.raises(BuildException) as failed:
            Template.build(Template().from_image(image).run_cmd("true"), alias=name)
        assert f"pulling {image}" in str(failed.value)
    finally:
        delete_template(gateway, name)


def test_debian_images_map_to_base_and_say_so(gateway):
    name = unique("debian")
    lines = []
    try:
        Template.build(Template().from_debian_image("bookworm").run_cmd("true"), alias=name, on_build_logs=lines.append)
        assert any("debian:bookworm" in e.message and "base" in e.message for e in lines), [e.message for e in lines]
    finally:
        delete_template(gateway, name)


# The build layer cache. Each step's files are a layer keyed by the team,
# the base, every step so far and a copy's files hash; a rebuild starts on
# the deepest layer it has and runs only the steps after it.

STAMP = "date +%s%N"


def stamped(run_id: str, extra_step: str = "echo same") -> Template:
    """ENV and WORKDIR (settings outside the files), then steps whose every
    run leaves a new timestamp line. `run_id` keeps one test's layers from
    another's."""
    return (
        Template()
        .from_template("base")
        .set_envs({"STAGE": "one", "RUN_ID": run_id})
        .set_workdir("/var/tmp")
        .run_cmd(f"{extra_step}; echo $STAGE $(pwd) {STAMP} >> a")
        .run_cmd(f"{STAMP} >> b")
    )


def build_logged(template, name, **kwargs) -> tuple[list[str], float]:
    lines = []
    started = time.monotonic()
    Template.build(template, alias=name, on_build_logs=lines.append, **kwargs)
    took = time.monotonic() - started
    print(f"build of {name} took {took:.2f} s")
    return [entry.message for entry in lines], took


def cached_steps(messages: list[str]) -> list[int]:
    return [int(m.split("[")[1].split("/")[0]) for m in messages if m.startswith("CACHED [")]


def run_steps(messages: list[str]) -> list[int]:
    return [int(m.split("[")[1].split("/")[0]) for m in messages if m.startswith("[") and "/" in m.split("]")[0]]


def read_files(name: str, *paths: str, **kwargs) -> list[str]:
    sbx = Sandbox.create(name, timeout=60, **kwargs)
    try:
        return [sbx.files.read(p) for p in paths]
    finally:
        sbx.kill()


@pytest.mark.timeout(900, func_only=True)
def test_an_unchanged_rebuild_runs_no_step_even_after_a_gateway_restart(gateway):
    name = unique("cached")
    try:
        first, cold = build_logged(stamped(name), name)
        assert cached_steps(first) == [] and run_steps(first) == [1, 2, 3, 4], first
        before = read_files(name, "/var/tmp/a", "/var/tmp/b")
        assert before[0].startswith("one /var/tmp "), before

        stop_gateway(gateway)
        gateway.start()
        # The image is a snapshot no snapshot row names: the start's sweep
        # of unnamed snapshots must have kept it.
        assert read_files(name, "/var/tmp/a", "/var/tmp/b") == before

        again, warm = build_logged(stamped(name), name)
        print(f"cold build {cold:.2f} s, cached rebuild {warm:.2f} s")
        assert cached_steps(again) == [1, 2, 3, 4], again
        assert run_steps(again) == [], again
        # No run_cmd ran again: the stamps are the first build's, once.
        assert read_files(name, "/var/tmp/a", "/var/tmp/b") == before
    finally:
        delete_template(gateway, name)


@pytest.mark.timeout(900, func_only=True)
def test_changing_a_step_reruns_it_and_every_step_after_with_the_cached_settings(gateway):
    name = unique("changed")
    try:
        build_logged(stamped(name), name)
        _, b_before = read_files(name, "/var/tmp/a", "/var/tmp/b")
        messages, _ = build_logged(stamped(name, "echo changed"), name)
        assert cached_steps(messages) == [1, 2], messages
        assert run_steps(messages) == [3, 4], messages
        assert any(m == "changed" for m in messages), messages
        a, b = read_files(name, "/var/tmp/a", "/var/tmp/b")
        # The cached ENV and WORKDIR still applied to the re-run step.
        assert a.startswith("one /var/tmp ") and a.count("\n") == 1, a
        assert b != b_before and b.count("\n") == 1, (b, b_before)
    finally:
        delete_template(gateway, name)


@pytest.mark.timeout(900, func_only=True)
def test_skip_cache_reruns_the_whole_build_or_from_the_marked_step(gateway):
    name = unique("skip")
    try:
        build_logged(stamped(name), name)
        _, b_first = read_files(name, "/var/tmp/a", "/var/tmp/b")

        messages, _ = build_logged(stamped(name), name, skip_cache=True)
        assert cached_steps(messages) == [] and run_steps(messages) == [1, 2, 3, 4], messages
        _, b_second = read_files(name, "/var/tmp/a", "/var/tmp/b")
        assert b_second != b_first

        marked = (
            Template()
            .from_template("base")
            .set_envs({"STAGE": "one", "RUN_ID": name})
            .set_workdir("/var/tmp")
            .run_cmd(f"echo same; echo $STAGE $(pwd) {STAMP} >> a")
            .skip_cache()
            .run_cmd(f"{STAMP} >> b")
        )
        messages, _ = build_logged(marked, name)
        assert cached_steps(messages) == [1, 2, 3] and run_steps(messages) == [4], messages
        _, b_third = read_files(name, "/var/tmp/a", "/var/tmp/b")
        assert b_third not in (b_first, b_second)
    finally:
        delete_template(gateway, name)


@pytest.mark.timeout(900, func_only=True)
def test_another_teams_identical_build_reuses_none_of_the_first_teams_layers(gateway):
    name = unique("teams")
    other = new_key(new_team("cache"))
    try:
        build_logged(stamped(name), name)
        _, b_mine = read_files(name, "/var/tmp/a", "/var/tmp/b")
        lines = []
        Template.build(stamped(name), alias=name, on_build_logs=lines.append, api_key=other)
        messages = [entry.message for entry in lines]
        assert cached_steps(messages) == [] and run_steps(messages) == [1, 2, 3, 4], messages
        _, b_theirs = read_files(name, "/var/tmp/a", "/var/tmp/b", api_key=other)
        assert b_theirs != b_mine
    finally:
        delete_template(gateway, name)
        delete_template(gateway, name, other)


def snapshot_files() -> set[str]:
    return {p.name for p in (DATA_DIR / "snapshots").glob("*.json")}


@pytest.mark.timeout(900, func_only=True)
def test_deleting_a_template_collects_its_layers_once_no_sandbox_uses_them(gateway):
    name = unique("collect")
    before = snapshot_files()
    sbx = None
    try:
        build_logged(stamped(name), name)
        made = snapshot_files() - before
        # The image and one cache layer per step.
        assert len(made) == 5, made
        sbx = Sandbox.create(name, timeout=120)
        # Deleting a template a sandbox uses is allowed; the sandbox keeps
        # its files, whose layers go when it does.
        assert api(gateway, "DELETE", f"/templates/{name}").status_code == 204
        assert snapshot_files() - before == set()
        assert sbx.files.read("/var/tmp/a").startswith("one /var/tmp ")
        assert leakcheck.unnamed_layers(DATA_DIR) == []
        in_use = {p.name for p in (DATA_DIR / "layers").iterdir()}
        sbx.kill()
        sbx = None
        left = {p.name for p in (DATA_DIR / "layers").iterdir()}
        assert left < in_use, "the sandbox's layers were collected with it"
        assert leakcheck.unnamed_layers(DATA_DIR) == []
        # A rebuild starts cold again.
        messages, _ = build_logged(stamped(name), name)
        assert cached_steps(messages) == [], messages
    finally:
        if sbx is not None:
            sbx.kill()
        delete_template(gateway, name)


def test_the_shipped_templates_are_what_their_definitions_say(gateway):
    """`base` and `code-interpreter-v1` are built from the build definitions
    in e2b-compat/templates/debian: every package of a definition's
    `apt_install` line is installed, every copied file is there with the
    repo's bytes and mode, and every other step's effect (the interpreter's
    account) is present."""
    apt = "apt-get update && DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes apt-get install -y --no-install-recommends "
    for name in ("base", "code-interpreter-v1"):
        definition = json.loads((ROOT / "e2b-compat/templates/debian" / f"{name}.json").read_text())
        sbx = Sandbox.create(name, timeout=120)
        try:
            for step in definition["steps"]:
                command = step["args"][0]
                if step["type"] == "RUN" and command.startswith(apt):
                    packages = command[len(apt) :].split()
                    out = sbx.commands.run("dpkg-query -W -f '${Package} ${Status}\\n' " + " ".join(packages) + "; true")
                    installed = {line.split()[0] for line in out.stdout.splitlines() if line.endswith("install ok installed")}
                    assert installed == set(packages), f"{name}: missing {set(packages) - installed}"
                elif step["type"] == "COPY":
                    src, dest, mode = step["args"][0], step["args"][1], step["args"][3]
                    path = dest + src.rsplit("/", 1)[-1] if dest.endswith("/") else dest
                    expected = (ROOT / "e2b-compat" / src).read_text().rstrip() + "\n"
                    assert sbx.files.read(path) == expected, f"{name}: {path}"
                    stat = sbx.commands.run(f"stat -c '%a %U' {path}").stdout.split()
                    assert stat == [mode.lstrip("0"), "root"], f"{name}: {path} {stat}"
            service = definition.get("copseService")
            if service:
                assert sbx.commands.run(f"id -u {service['user']}").exit_code == 0
        finally:
            sbx.kill()


def npm_package(directory):
    """copse-probe 1.0.0, whose `copse-probe` command prints npm-ran."""
    manifest = json.dumps({"name": "copse-probe", "version": "1.0.0", "bin": {"copse-probe": "cli.js"}}).encode()
    cli = b"#!/usr/bin/env node\nconsole.log('npm-ran')\n"
    with tarfile.open(directory / "copse-probe-1.0.0.tgz", "w:gz") as tgz:
        for name, data, mode in (("package.json", manifest, 0o644), ("cli.js", cli, 0o755)):
            entry = tarfile.TarInfo(f"package/{name}")
            entry.size, entry.mode = len(data), mode
            tgz.addfile(entry, io.BytesIO(data))


def deb_package(directory, scratch):
    """copse-probe 1.0, which installs /usr/share/copse-probe/marker."""
    root = scratch / "deb"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN/control").write_text(
        "Package: copse-probe\nVersion: 1.0\nArchitecture: all\n"
        "Maintainer: copse tests <tests@copse.invalid>\nDescription: a package the build installs\n"
    )
    (root / "usr/share/copse-probe").mkdir(parents=True)
    (root / "usr/share/copse-probe/marker").write_text("apt-installed\n")
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", root, directory / "copse-probe_1.0_all.deb"], check=True, capture_output=True)


def git_repository(directory, scratch):
    """A bare repository whose `main` has two commits, `first` and `second`."""
    work = scratch / "work"
    git = ["git", "-c", "user.name=copse", "-c", "user.email=tests@copse.invalid", "-C", str(work)]
    subprocess.run(["git", "init", "-q", "-b", "main", str(work)], check=True)
    for message in ("first", "second"):
        (work / "README").write_text(f"{message}\n")
        subprocess.run([*git, "add", "README"], check=True)
        subprocess.run([*git, "commit", "-q", "-m", message], check=True)
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(directory / "repo.git")], check=True)


def test_every_install_step_works_on_base_without_a_network(gateway, tmp_path):
    """The SDK's `apt_install`, `pip_install` (for everyone, and with
    `g=False` for the user), `npm_install` (global, and into the working
    directory) and `git_clone` on `base`, as on E2B's base image: pip installs
    beside Debian's Python (which marks itself externally managed) and npm is
    there. What they install is what the test made and the build copies in;
    none reaches a package index (apt is left no sources, pip and npm are
    told to stay offline)."""
    packages = tmp_path / "pkgs"
    packages.mkdir()
    wheel(packages, "copse_probe", "pip-for-everyone")
    wheel(packages, "copse_probe_user", "pip-for-the-user")
    npm_package(packages)
    deb_package(packages, tmp_path)
    git_repository(packages, tmp_path)
    name = unique("installs")
    at = "/home/user/pkgs"
    template = (
        Template(file_context_path=str(tmp_path))
        .from_template("base")
        .copy("pkgs/", f"{at}/")
        .set_envs({"PIP_NO_INDEX": "1", "npm_config_offline": "true"})
        .run_cmd("rm -f /etc/apt/sources.list /etc/apt/sources.list.d/*", user="root")
        .apt_install([f"{at}/copse-probe_1.0_all.deb"])
        .pip_install([f"{at}/copse_probe-1.0-py3-none-any.whl"])
        .pip_install([f"{at}/copse_probe_user-1.0-py3-none-any.whl"], g=False)
        .npm_install([f"{at}/copse-probe-1.0.0.tgz"], g=True)
        .set_workdir("/home/user/project")
        .npm_install([f"{at}/copse-probe-1.0.0.tgz"])
        .git_clone(f"file://{at}/repo.git", "/home/user/clone", branch="main", depth=1)
    )
    try:
        Template.build(template, alias=name)
        sbx = Sandbox.create(name, timeout=60)
        try:
            run = sbx.commands.run
            assert run("dpkg-query -W -f '${Status}' copse-probe").stdout == "install ok installed"
            assert run("cat /usr/share/copse-probe/marker").stdout == "apt-installed\n"
            probe = "import {0} as m; print(m.VALUE, m.__file__.startswith('{1}'))"
            assert run(f"python3 -c \"{probe.format('copse_probe', '/usr/local/lib/')}\"").stdout == "pip-for-everyone True\n"
            user_probe = probe.format("copse_probe_user", "/home/user/.local/lib/")
            assert run(f"python3 -c \"{user_probe}\"").stdout == "pip-for-the-user True\n"
            assert run("copse-probe").stdout == "npm-ran\n"
            assert run("node node_modules/copse-probe/cli.js").stdout == "npm-ran\n"
            assert run("git -C /home/user/clone log --format=%s").stdout == "second\n"
            assert run("stat -c %U /home/user/clone/README /home/user/project/node_modules").stdout == "user\nuser\n"
            # An agent's own `pip install` works too, into the user's site.
            assert run(f"pip install --no-index {at}/copse_probe_user-1.0-py3-none-any.whl --force-reinstall").exit_code == 0
        finally:
            sbx.kill()
    finally:
        delete_template(gateway, name)
