"""Public prefixes over HTTP: a system prompt declared in the config (or through the admin API) is
prefilled once for every tenant, while what follows it stays each tenant's own."""

from __future__ import annotations

import httpx
import pytest

from tests.app.conftest import assert_error

ADMIN = {"Authorization": "Bearer admin-key-public"}
A = {"Authorization": "Bearer sk-a-public"}
B = {"Authorization": "Bearer sk-b-public"}
SYSTEM = " ".join(f"Rule {i}: answer politely and cite the handbook section {i}." for i in range(12))
CONFIG = f"""
[model]
path = "tiny"

[cache]
block_size = 16

[admin]
api_key = "admin-key-public"

[[tenants]]
name = "a"
api_keys = ["sk-a-public"]

[[tenants]]
name = "b"
api_keys = ["sk-b-public"]

[[public_prefixes]]
name = "handbook"
system = "{SYSTEM}"
"""


@pytest.fixture(scope="module")
def client(start_app):
    server = start_app(config=CONFIG)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def chat(client: httpx.Client, headers: dict, question: str) -> int:
    body = {"model": "tiny", "max_tokens": 1, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
    response = client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def complete(client: httpx.Client, headers: dict, ids: list[int]) -> int:
    response = client.post("/v1/completions", headers=headers,
                           json={"model": "tiny", "prompt": ids, "max_tokens": 1})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_declared_system_prompt_is_shared_by_tenants_and_nothing_after_it(client: httpx.Client) -> None:
    listing = client.get("/admin/public-prefixes", headers=ADMIN).json()["public_prefixes"]
    (handbook,) = listing
    assert handbook["name"] == "handbook" and handbook["source"] == "system" and handbook["shared_blocks"] >= 4
    shared = handbook["shared_blocks"] * 16
    question = "Where is the handbook kept, and who may read section four of it today?"
    assert chat(client, A, question) == 0
    assert chat(client, B, question) == shared  # A prefilled the public part, and only that is shared
    assert chat(client, A, question) > shared  # A's own continuation: its own hit


def test_prefixes_declared_at_run_time_then_removed(client: httpx.Client) -> None:
    public = list(range(200, 300))  # 100 token ids: 6 full blocks
    answer = client.post("/admin/public-prefixes", headers=ADMIN, json={"name": "ids", "token_ids": public}).json()
    assert answer == {"name": "ids", "tokens": 100, "shared_blocks": 6}
    assert complete(client, A, public + [7] * 30) == 0
    assert complete(client, B, public + [8] * 30) == 96
    assert client.delete("/admin/public-prefixes/ids", headers=ADMIN).json() == {"name": "ids", "removed": True}
    assert complete(client, B, public + [9] * 30) == 0  # hashed in B's own namespace again
    assert_error(client.delete("/admin/public-prefixes/ids", headers=ADMIN), 404)


def test_the_admin_api_checks_its_input_and_its_key(client: httpx.Client) -> None:
    assert_error(client.get("/admin/public-prefixes", headers=A), 401)
    assert_error(client.post("/admin/public-prefixes", headers=A, json={"name": "x", "text": "hi"}), 401)
    for body in ({"name": "x"}, {"name": "x", "text": "hi", "token_ids": [1]}, {"name": "../x", "text": "hi"},
                 {"name": "x", "text": "hi", "colour": "red"}, {"name": "x", "token_ids": []}):
        assert_error(client.post("/admin/public-prefixes", headers=ADMIN, json=body), 400)
