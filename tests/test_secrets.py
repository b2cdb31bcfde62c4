"""Secrets through the official SDK's `Secret` class: create, read, list,
new versions, delete; values are write-only; the keyring rotates while the
gateway runs. Egress rules that use them: test_egress_rules.py."""

import json
import os
import subprocess
import urllib.error
import urllib.request
import uuid

import pytest
from e2b import Secret, SecretException, SecretNotFoundException
from conftest import API_KEY, COPSE


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def api(gateway, method: str, path: str, body=None):
    request = urllib.request.Request(
        gateway.url + path,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"X-API-Key": API_KEY, "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_a_secret_is_created_versioned_listed_and_deleted(gateway):
    name = unique("api-key")
    created = Secret.create(name, "value-one", metadata={"env": "test"})
    assert created.name == name and created.version == 1
    assert created.metadata == {"env": "test"}

    updated = Secret.update(name, "value-two")
    assert updated.secret_id == created.secret_id and updated.version == 2
    assert updated.metadata == {"env": "test"}, "metadata left out keeps the old"
    assert updated.updated_at >= created.updated_at
    replaced = Secret.update(created.secret_id, "value-three", metadata={"env": "prod"})
    assert replaced.version == 3 and replaced.metadata == {"env": "prod"}

    info = Secret.get_info(name)
    assert (info.secret_id, info.version) == (created.secret_id, 3)
    assert Secret.exists(created.secret_id)

    assert Secret.destroy(name) is True
    assert Secret.destroy(name) is False
    assert not Secret.exists(name)
    with pytest.raises(SecretNotFoundException):
        Secret.get_info(created.secret_id)
    with pytest.raises(SecretNotFoundException):
        Secret.update(name, "v")


def test_listing_pages_through_every_secret(gateway):
    names = {unique("paged") for _ in range(5)}
    for name in names:
        Secret.create(name, "v")
    paginator = Secret.list(limit=2)
    seen = []
    while paginator.has_next:
        page = paginator.next_items()
        assert len(page) <= 2
        seen.extend(s.name for s in page)
    assert names <= set(seen)
    assert len(seen) == len(set(seen)), "no secret twice across pages"
    for name in names:
        Secret.destroy(name)


def test_no_route_gives_a_value_back(gateway):
    name, value = unique("write-only"), "never-" + uuid.uuid4().hex
    created = Secret.create(name, value)
    answers = [
        api(gateway, "GET", f"/secrets/{created.secret_id}"),
        api(gateway, "GET", f"/secrets/{name}"),
        api(gateway, "GET", "/secrets?limit=1000"),
        api(gateway, "POST", f"/secrets/{name}", {"value": value + "-2"}),
    ]
    for status, body in answers:
        assert status in (200, 201), body
        assert value.encode() not in body
        assert b'"value"' not in body
    Secret.destroy(name)


@pytest.mark.parametrize(
    "body, status",
    [
        ({"name": "has{brace}", "value": "v"}, 400),
        ({"name": "ok-name", "value": ""}, 400),
        ({"name": "ok-name", "value": "v" * (64 * 1024 + 1)}, 400),
        ({"name": "ok-name"}, 400),
        ({"name": "", "value": "v"}, 400),
        ({"name": "ok-name", "value": "v", "metadata": {"k": 1}}, 400),
    ],
)
def test_bad_secrets_are_refused_with_code_and_message(gateway, body, status):
    got, raw = api(gateway, "POST", "/secrets", body)
    assert got == status, raw
    error = json.loads(raw)
    assert error["code"] == status and error["message"]
    assert api(gateway, "GET", "/secrets/ok-name")[0] == 404, "nothing was stored"


def test_a_name_is_taken_once(gateway):
    name = unique("taken")
    Secret.create(name, "v")
    with pytest.raises(SecretException) as caught:
        Secret.create(name, "w")
    assert getattr(caught.value, "status_code", None) == 409 or "already exists" in str(caught.value)
    Secret.destroy(name)


def test_the_key_rotates_while_the_gateway_runs(gateway):
    keyring = gateway.data_dir / "secrets.keyring"
    name = unique("rotated")
    Secret.create(name, "before")
    old = keyring.read_text()
    subprocess.run([str(COPSE), "secrets", "rotate-key", "--data-dir", str(gateway.data_dir)], check=True)
    new = keyring.read_text()
    assert new != old
    # Every old key is gone from the keyring...
    old_keys = {line.split()[1] for line in old.splitlines() if line and not line.startswith("#")}
    assert not old_keys & {line.split()[1] for line in new.splitlines() if line and not line.startswith("#")}
    # ...and the running gateway seals under the new one at once.
    assert Secret.update(name, "after").version == 2
    subprocess.run([str(COPSE), "secrets", "rotate-key", "--data-dir", str(gateway.data_dir)], check=True)
    assert Secret.get_info(name).version == 2
    Secret.destroy(name)
