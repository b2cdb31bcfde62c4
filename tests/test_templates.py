"""A user's own template, built through the unchanged SDK's
`Template.build`: the steps run in a real sandbox of the base, their
output reaches `on_build_logs`, a failing step names itself, and
`Sandbox.create(name)` gets the built files, environment, user and working
directory, with the start command running and ready. Templates belong to
the team that built them."""

import os
import secrets

import httpx
import pytest
from conftest import API_KEY, free_port
from e2b import Sandbox, Template
from e2b.exceptions import BuildException
from test_tenancy import new_key, new_team

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
