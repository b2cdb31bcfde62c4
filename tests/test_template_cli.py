"""`copse template build -f Dockerfile` and `--from-json` (what the SDK's
`Template.to_json` writes) against the suite's gateway, then `template ls`,
`tags` and `rm`; the result is checked through the SDK, as a user of the
template sees it."""

import os
import subprocess

import pytest
from conftest import API_KEY, COPSE
from e2b import Sandbox, Template
from test_templates import delete_template, unique

pytestmark = pytest.mark.timeout(600, func_only=True)


def cli(gateway, *args, check=True, cwd=None):
    done = subprocess.run(
        [str(COPSE), "template", *args, "--api-url", gateway.url, "--api-key", API_KEY],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=540,
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done


@pytest.fixture
def context(tmp_path):
    app = tmp_path / "app"
    (app / "sub").mkdir(parents=True)
    (app / "run.sh").write_text("#!/bin/sh\necho run-ran\n")
    os.chmod(app / "run.sh", 0o750)
    (app / "sub" / "data.txt").write_text("nested\n")
    os.symlink("run.sh", app / "link.sh")
    return tmp_path


def test_a_dockerfile_builds_through_the_gateway_with_its_start_command(gateway, context):
    name = unique("cli")
    (context / "Dockerfile").write_text(
        """# every instruction the CLI takes
FROM e2bdev/base:latest
ARG GREETING=hello
ENV MODE="two words"
WORKDIR /srv
COPY --chown=user:user app/ /home/user/app/
COPY app/sub/data.txt ./data.txt
RUN echo "$GREETING-$MODE" > /srv/marker && \\
    chmod 644 /srv/marker
USER user
WORKDIR /home/user
EXPOSE 8080
CMD ["sh", "-c", "echo started > /tmp/started; exec sleep infinity"]
"""
    )
    try:
        built = cli(
            gateway, "build", "-f", str(context / "Dockerfile"), "--name", f"{name}:v1", "--ready-cmd", "test -f /tmp/started"
        )
        assert name in built.stdout, built.stdout
        assert "ready" in built.stderr, built.stderr

        sbx = Sandbox.create(f"{name}:v1", timeout=60)
        try:
            run = sbx.commands.run
            assert run("cat /srv/marker").stdout == "hello-two words\n"
            assert run("echo $MODE").stdout == "two words\n"
            assert run("pwd").stdout == "/home/user\n"
            assert run("whoami").stdout == "user\n"
            assert run("stat -c '%a %U' /home/user/app/run.sh").stdout == "750 user\n"
            assert run("readlink /home/user/app/link.sh").stdout == "run.sh\n"
            assert run("cat /home/user/app/sub/data.txt").stdout == "nested\n"
            assert run("stat -c '%U' /srv/data.txt && cat /srv/data.txt").stdout == "root\nnested\n"
            # The start command ran and was ready before create returned.
            assert run("cat /tmp/started").stdout == "started\n"
        finally:
            sbx.kill()

        listed = cli(gateway, "ls").stdout
        assert name in listed and "base" in listed, listed
        tags = cli(gateway, "tags", name, "--add", "prod,stable", "--from", "v1").stdout
        assert {"v1", "prod", "stable"} <= {line.split()[0] for line in tags.splitlines()[1:]}, tags
        tags = cli(gateway, "tags", name, "--remove", "stable").stdout
        assert "stable" not in tags and "prod" in tags, tags
        assert {t.tag for t in Template.get_tags(name)} == {"v1", "prod"}

        cli(gateway, "rm", name)
        assert not Template.alias_exists(name)
    finally:
        delete_template(gateway, name)


def test_a_template_json_from_the_sdk_builds_through_the_cli(gateway, context):
    name = unique("json")
    template = (
        Template(file_context_path=str(context))
        .from_template("base")
        .copy("app/", "/home/user/app/")
        .set_envs({"FROM_JSON": "yes"})
        .run_cmd("/home/user/app/run.sh > /home/user/ran.txt")
    )
    (context / "template.json").write_text(Template.to_json(template))
    try:
        cli(gateway, "build", "--from-json", str(context / "template.json"), "--name", name)
        sbx = Sandbox.create(name, timeout=60)
        try:
            assert sbx.commands.run("cat /home/user/ran.txt").stdout == "run-ran\n"
            assert sbx.commands.run("echo $FROM_JSON").stdout == "yes\n"
        finally:
            sbx.kill()
    finally:
        delete_template(gateway, name)


def test_unsupported_instructions_and_failing_steps_are_reported_with_their_place(gateway, tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM e2bdev/base\nRUN true\nHEALTHCHECK CMD true\n")
    refused = cli(gateway, "build", "-f", str(tmp_path / "Dockerfile"), "--name", unique("bad"), check=False)
    assert refused.returncode != 0
    assert "line 3: HEALTHCHECK" in refused.stderr, refused.stderr

    name = unique("fails")
    (tmp_path / "Dockerfile").write_text("FROM e2bdev/base\nRUN echo about-to-fail && exit 7\n")
    try:
        failed = cli(gateway, "build", "-f", str(tmp_path / "Dockerfile"), "--name", name, check=False)
        assert failed.returncode != 0
        assert "about-to-fail" in failed.stderr and "failed" in failed.stderr, failed.stderr
    finally:
        delete_template(gateway, name)


def test_copse_ls_and_kill_talk_to_the_running_gateway(gateway):
    """`copse ls` and `copse kill` share the template commands' client."""
    remote = ["--api-url", gateway.url, "--api-key", API_KEY]
    sbx = Sandbox.create(timeout=60)
    try:
        listed = subprocess.run([str(COPSE), "ls", *remote], capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0 and sbx.sandbox_id in listed.stdout, listed.stderr
        killed = subprocess.run([str(COPSE), "kill", sbx.sandbox_id, *remote], capture_output=True, text=True,
                                timeout=60)
        assert killed.returncode == 0 and f"killed {sbx.sandbox_id}" in killed.stdout, killed.stderr
        assert not sbx.is_running()
        again = subprocess.run([str(COPSE), "kill", sbx.sandbox_id, *remote], capture_output=True, text=True,
                               timeout=60)
        assert again.returncode != 0 and "404" in again.stderr, again.stderr
    finally:
        sbx.kill()
