"""A Disaggregated-Pipeline, runnable: a `role = "prefill"` replica computes prompts and answers
once their blocks are in the shared store, a `role = "decode"` replica loads them from it and
decodes, and `kvgate route` sends each request's two legs to the two. The output equals a single
mixed replica's greedy run, the decode replica computed no prompt block, and both replicas say
Disaggregated-Pipeline."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import httpx
import pytest

from app.settings import ConfigError, load_settings
from tests.app.conftest import ADMIN_KEY, TENANT_KEYS
from tests.app.test_router import RouterServer

pytestmark = pytest.mark.server

BASE = f"""
[model]
path = "tiny"

[server]
secret = "tests-only-disagg-secret-0123456789"
role = "{{role}}"

[cache]
block_size = 16

[cache.remote]
url = "{{redis}}"

[admin]
api_key = "{ADMIN_KEY}"

[[tenants]]
name = "acme"
api_keys = ["{TENANT_KEYS['acme']}"]
"""
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ACME = {"Authorization": f"Bearer {TENANT_KEYS['acme']}"}


def _ids(seed: int, n: int = 410) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


@pytest.fixture(scope="module")
def pipeline(start_server, redis_server, tmp_path_factory) -> Iterator[dict]:
    with redis_server.client() as client:
        client.flushall()
    configs = {role: BASE.format(role=role, redis=redis_server.url) for role in ("prefill", "decode", "both")}
    prefill = start_server(config=configs["prefill"])
    decode = start_server(config=configs["decode"])
    folder = tmp_path_factory.mktemp("pd")
    (folder / "kvgate.toml").write_text(configs["both"])
    router = RouterServer(str(folder / "kvgate.toml"), [prefill.url, decode.url])
    try:
        yield {"prefill": prefill, "decode": decode, "router": router, "both": configs["both"]}
    finally:
        router.stop()
        with redis_server.client() as client:
            client.flushall()


def _complete(url: str, ids: list[int], stream: bool = False) -> tuple[str, int]:
    body = {"model": "tiny", "prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    response = httpx.post(url + "/v1/completions", json=body, headers=ACME, timeout=60)
    assert response.status_code == 200, response.text
    if stream:
        import json

        lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return "".join(json.loads(x)["choices"][0]["text"] for x in lines[:-1] if json.loads(x)["choices"]), -1
    data = response.json()
    return data["choices"][0]["text"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def _metrics(url: str) -> dict:
    return httpx.get(url + "/admin/metrics", headers=ADMIN, timeout=30).json()


def test_prefill_there_decode_here_same_tokens(pipeline, start_app, redis_server) -> None:
    router, prefill, decode = pipeline["router"], pipeline["prefill"], pipeline["decode"]
    ids = _ids(1)
    before = _metrics(decode.url)
    text, cached = _complete(router.url, ids)
    assert cached == 400  # the decode replica loaded every reusable block of the prompt
    after = _metrics(decode.url)
    assert after["tiers"]["remote"]["hits"] - before["tiers"]["remote"]["hits"] >= 25
    # the decode replica computed only the prompt's last 10 tokens and the 12 it generated
    assert after["computed_tokens"] - before["computed_tokens"] <= 10 + 12
    shipped = httpx.get(prefill.url + "/admin/replica", headers=ADMIN, timeout=10).json()
    assert shipped["role"] == "prefill" and shipped["shipped"]["prompts"] >= 1 and shipped["shipped"]["late"] == 0
    # both write through to one store: the router counts a prefix one announced for the other too
    other = httpx.get(decode.url + "/admin/replica", headers=ADMIN, timeout=10).json()
    assert shipped["shared_store"] and other["shared_store"] == shipped["shared_store"]
    assert redis_server.url not in json.dumps(shipped)  # an id of the store, not its address
    decisions = httpx.get(router.url + "/admin/router", headers=ADMIN, timeout=10).json()["decisions"]
    assert decisions["disaggregated"] >= 1 and decisions["prefill_failed"] == 0

    with redis_server.client() as client:  # a single mixed replica, cold, for the reference
        client.flushall()
    alone = start_app(config=pipeline["both"])
    reference, reference_cached = _complete(alone.url, ids)
    assert reference_cached == 0 and text == reference

    streamed, _ = _complete(router.url, _ids(2), stream=True)  # streams take both legs too
    reference2, _ = _complete(alone.url, _ids(2))
    assert streamed == reference2


def test_both_sides_say_disaggregated_pipeline(pipeline) -> None:
    for role in ("prefill", "decode"):
        archetype = httpx.get(pipeline[role].url + "/admin/archetype", headers=ADMIN, timeout=10).json()
        assert archetype["name"] == "Disaggregated-Pipeline", archetype
        assert f"this is a {role} engine" in archetype["reason"]
        assert "network" in archetype["axes"]["substrate"]
        assert archetype["axes"]["ownership"].startswith("shared")


def test_a_role_without_a_shared_store_is_refused(tmp_path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text('[server]\nrole = "decode"\nsecret = "tests-only-disagg-secret-0123456789"\n')
    with pytest.raises(ConfigError, match=r"decode replica ships KV through the shared store"):
        load_settings(str(path), env={})
    path.write_text('[server]\nrole = "prefill"\nsecret = "tests-only-disagg-secret-0123456789"\n'
                    '[cache.remote]\nurl = "redis://127.0.0.1:1/0"\nwrite = "back"\n')
    with pytest.raises(ConfigError, match=r'write = "through"'):
        load_settings(str(path), env={})
