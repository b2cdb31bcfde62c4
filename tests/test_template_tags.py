"""Tags, visibility and the build-log route of built templates, through the
unchanged SDK: `Template.build("name:tag", tags=…)`, `Template.assign_tags`,
`remove_tags`, `get_tags`, `Sandbox.create("name:tag")`; the routes the SDK
has only as generated client (`/tags/count|exists|groups|assignments`,
`/builds/{id}/logs`, `PATCH`, `/default-templates`) through that client,
so the answers are parsed exactly as the SDK parses them."""

import httpx
import pytest
from conftest import API_KEY
from e2b import Sandbox, Template
from e2b.api.client.api.tags import (
    get_templates_template_id_tags_count,
    get_templates_template_id_tags_exists,
    get_templates_template_id_tags_groups,
    get_templates_template_id_tags_tag_assignments,
)
from e2b.api.client.api.templates import (
    get_default_templates,
    get_templates_template_id_builds_build_id_logs,
    patch_templates_template_id,
    patch_v_2_templates_template_id,
)
from e2b.api.client.models import LogLevel, LogsDirection, TemplateUpdateRequest
from e2b.api.client_sync import get_api_client
from e2b.connection_config import ConnectionConfig
from e2b.exceptions import TemplateException
import leakcheck
from conftest import DATA_DIR
from test_templates import api, delete_template, snapshot_files, unique
from test_tenancy import new_key, new_team

pytestmark = pytest.mark.timeout(600, func_only=True)


def client(key: str = API_KEY):
    return get_api_client(ConnectionConfig(api_key=key))


def tags_of(name: str, key: str = API_KEY) -> dict:
    return {t.tag: t.build_id for t in Template.get_tags(name, api_key=key)}


def marker(sbx) -> str:
    return sbx.commands.run("cat /marker").stdout.strip()


def build(name: str, text: str, **kwargs):
    template = Template().from_template("base").run_cmd(f"echo {text} > /marker", user="root")
    return Template.build(template, name, **kwargs)


def test_tags_name_builds_and_sandbox_create_takes_name_colon_tag(gateway):
    name = unique("tagged")
    try:
        first = build(f"{name}:v1", "one", tags=["Stable"])
        assert tags_of(name) == {"v1": first.build_id, "stable": first.build_id}
        assert Template.alias_exists(name)

        for ref in (f"{name}:v1", f"{name}:stable", name):
            sbx = Sandbox.create(ref, timeout=60)
            try:
                assert marker(sbx) == "one", ref
            finally:
                sbx.kill()
        with pytest.raises(Exception, match="not found"):
            Sandbox.create(f"{name}:nope", timeout=30)

        assigned = Template.assign_tags(f"{name}:v1", ["prod", "canary"])
        assert assigned.build_id == first.build_id and assigned.tags == ["prod", "canary"]
        Template.remove_tags(name, "canary")
        assert tags_of(name) == {"v1": first.build_id, "stable": first.build_id, "prod": first.build_id}
        with pytest.raises(TemplateException):
            Template.remove_tags(name, "canary")

        # A second build under a new tag: the old tags keep their build and
        # its image, so each tag boots its own build's files.
        with_first = snapshot_files()
        second = build(f"{name}:v2", "two")
        tags = tags_of(name)
        assert tags["v2"] == second.build_id and tags["v1"] == first.build_id
        assert with_first < snapshot_files(), "the first build's image was deleted"
        for ref, text in ((f"{name}:v2", "two"), (f"{name}:v1", "one"), (f"{name}:prod", "one"), (name, "two")):
            sbx = Sandbox.create(ref, timeout=60)
            try:
                assert marker(sbx) == text, ref
            finally:
                sbx.kill()
        # Once no tag names the first build, its image is collected; a
        # sandbox still running on it keeps its files until it ends.
        running_old = Sandbox.create(f"{name}:stable", timeout=120)
        try:
            Template.assign_tags(f"{name}:v2", "prod")
            Template.remove_tags(name, "stable")
            assert with_first < snapshot_files(), "v1 still names the first build"
            Template.assign_tags(f"{name}:v2", "v1")
            gone = with_first - snapshot_files()
            assert len(gone) == 1, gone
            assert marker(running_old) == "one"
        finally:
            running_old.kill()
        assert leakcheck.unnamed_layers(DATA_DIR) == []
        sbx = Sandbox.create(f"{name}:v1", timeout=60)
        try:
            assert marker(sbx) == "two"
        finally:
            sbx.kill()

        # The raw routes, parsed by the SDK's generated client.
        c = client()
        assert get_templates_template_id_tags_count.sync(name, client=c).total == 3
        exists = get_templates_template_id_tags_exists.sync(name, client=c, tag=" V2 ")
        assert exists.exists and exists.normalized_tag == "v2"
        assert not get_templates_template_id_tags_exists.sync(name, client=c, tag="v9").exists
        groups = get_templates_template_id_tags_groups.sync(name, client=c, assignment_limit=1, tags_limit=2)
        assert len(groups.tags) == 2 and groups.next_cursor == "2"
        assert groups.tags[0].tag == "v1"  # latest assignment first
        assert groups.tags[0].has_more and len(groups.tags[0].assignments) == 1
        assert str(groups.tags[0].assignments[0].build_id) == second.build_id
        rest = get_templates_template_id_tags_groups.sync(name, client=c, tags_cursor=groups.next_cursor)
        assert rest.next_cursor is None and len(rest.tags) == 1
        history = get_templates_template_id_tags_tag_assignments.sync(name, "v1", client=c, limit=1)
        assert [str(a.build_id) for a in history.data] == [second.build_id] and history.next_cursor == "1"
        older = get_templates_template_id_tags_tag_assignments.sync(name, "v1", client=c, cursor="1")
        assert [str(a.build_id) for a in older.data] == [first.build_id] and older.next_cursor is None
    finally:
        delete_template(gateway, name)
    assert not Template.alias_exists(name)


def test_build_logs_page_by_time_direction_and_level(gateway):
    name = unique("logs")
    try:
        info = Template.build(Template().from_template("base").run_cmd("echo hello-from-step"), name)
        c = client()

        def logs(**kw):
            return get_templates_template_id_builds_build_id_logs.sync(
                info.template_id, info.build_id, client=c, **kw
            ).logs

        everything = logs()
        assert any("hello-from-step" in e.message for e in everything), [e.message for e in everything]
        last = logs(direction=LogsDirection.BACKWARD, limit=1)
        assert len(last) == 1 and all(last[0].timestamp >= e.timestamp for e in everything)
        later = int(everything[-1].timestamp.timestamp() * 1000) + 1
        assert logs(cursor=later) == []
        assert logs(level=LogLevel.ERROR) == []
        response = api(gateway, "GET", f"/templates/{info.template_id}/builds/{info.build_id}/logs?direction=up")
        assert response.status_code == 400 and response.json()["code"] == 400
    finally:
        delete_template(gateway, name)


def test_a_public_template_is_creatable_by_other_teams_by_id_and_stays_theirs(gateway):
    name = unique("shared")
    other = new_key(new_team("pub"))
    try:
        info = build(name, "shared")
        with pytest.raises(Exception):
            Sandbox.create(info.template_id, api_key=other, timeout=30)
        updated = patch_v_2_templates_template_id.sync(
            info.template_id, client=client(), body=TemplateUpdateRequest(public=True)
        )
        assert updated.names == [name]
        assert api(gateway, "GET", f"/templates/{info.template_id}").json()["public"] is True

        sbx = Sandbox.create(info.template_id, api_key=other, timeout=60)
        try:
            assert marker(sbx) == "shared"
        finally:
            sbx.kill()
        # By name it is still only its team's: names are per team.
        with pytest.raises(Exception):
            Sandbox.create(name, api_key=other, timeout=30)
        # Usable, never changeable by them.
        denied = patch_templates_template_id.sync_detailed(
            info.template_id, client=client(other), body=TemplateUpdateRequest(public=False)
        )
        assert denied.status_code == 404
        assert api(gateway, "DELETE", f"/templates/{info.template_id}", other).status_code == 404
        with pytest.raises(TemplateException):
            Template.assign_tags(f"{name}:default", "theirs", api_key=other)
        with pytest.raises(TemplateException):
            Template.get_tags(info.template_id, api_key=other)

        made_private = patch_templates_template_id.sync_detailed(
            info.template_id, client=client(), body=TemplateUpdateRequest(public=False)
        )
        assert made_private.status_code == 200
        with pytest.raises(Exception):
            Sandbox.create(info.template_id, api_key=other, timeout=30)
    finally:
        delete_template(gateway, name)


def test_default_templates_are_the_shipped_ones(gateway):
    listed = get_default_templates.sync(client=client())
    by_name = {t.template_id: t for t in listed}
    assert "base" in by_name, list(by_name)
    assert by_name["base"].is_default and by_name["base"].public
    assert by_name["base"].build_status.value == "ready"


def test_built_in_names_cannot_be_tagged_or_patched(gateway):
    for response in (
        httpx.post(
            gateway.url + "/templates/tags",
            json={"target": "base:default", "tags": ["mine"]},
            headers={"x-api-key": API_KEY},
        ),
        httpx.patch(gateway.url + "/v2/templates/base", json={"public": False}, headers={"x-api-key": API_KEY}),
    ):
        assert response.status_code == 404, response.text
        assert response.json()["code"] == 404
