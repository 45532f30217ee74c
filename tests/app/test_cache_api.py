"""The cache control API over HTTP (`/v1/cache/*`, docs/cache_api.md), through the official
`openai` client's `post`/`delete` helpers and httpx, against an in-process server with tenants,
a small host tier, a disk tier and a private Redis: lookups as a prefix moves down the tiers,
a prefetch from disk, a pin that outlives another tenant's flood, a pin past the quota, drops of
a prefix and of everything (Redis records included), and another tenant probing a prompt it
does not own — which answers exactly as an unknown prompt does."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from cache.hashing import extend_block_hashes, root_hash
from tests.app.conftest import assert_error

ADMIN_KEY = "admin-key-cache-api"
KEYS = {"acme": "sk-acme-cache", "globex": "sk-globex-cache", "small": "sk-small-cache"}
CONFIG = f"""
[model]
path = "tiny"

[server]
secret = "tests-only-server-secret-0123456789"

[cache]
block_size = 16

[cache.device]
num_blocks = 64

[cache.host]
capacity_mb = 1

[admin]
api_key = "{ADMIN_KEY}"

[[tenants]]
name = "acme"
api_keys = ["{KEYS['acme']}"]

[[tenants]]
name = "globex"
api_keys = ["{KEYS['globex']}"]

[[tenants]]
name = "small"
api_keys = ["{KEYS['small']}"]
quota = {{ host = 4 }}
"""
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def ids(seed: int, n: int = 161) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


@pytest.fixture(scope="module")
def app_server(start_app, redis_server) -> Iterator[Any]:
    with redis_server.client() as client:
        client.flushall()
    server = start_app("--remote-cache", redis_server.url, config=CONFIG)
    yield server
    server.stop()
    with redis_server.client() as client:
        client.flushall()


def sdk(server: Any, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=60)


def post(client: openai.OpenAI, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, body=body, cast_to=httpx.Response)
    assert response.status_code == 200, response.text
    return response.json()


def delete(client: openai.OpenAI, body: dict[str, Any]) -> dict[str, Any]:
    response = client.delete("/cache", body=body, cast_to=httpx.Response)
    assert response.status_code == 200, response.text
    return response.json()


def complete(client: openai.OpenAI, prompt: list[int], max_tokens: int = 4) -> tuple[list[str], int]:
    result = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       extra_body={"ignore_eos": True})
    return [c.text for c in result.choices], result.usage.prompt_tokens_details.cached_tokens


def flood(server: Any, seed: int, prompts: int = 14) -> None:
    """One-off prompts of globex: more blocks than the device and host tiers hold together."""
    client = sdk(server, "globex")
    for i in range(prompts):
        complete(client, ids(10_000 * seed + i, 400), max_tokens=1)


def lookup_until(client: openai.OpenAI, prompt: list[int], tier: str, tokens: int) -> dict[str, Any]:
    """Look up until ``tier`` serves ``tokens`` of the prefix (disk writes finish in the background)."""
    deadline = time.monotonic() + 20
    while True:
        found = post(client, "/cache/lookup", {"prompt": prompt})
        if found["tiers"][tier] == tokens or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def remote_keys(server: Any, redis_server: Any, tenant: str, prompt: list[int]) -> tuple[set[bytes], set[bytes]]:
    """(the Redis keys of ``tenant``'s blocks of ``prompt``, every block key in Redis now)."""
    engine = server.app.state.engine
    salt = server.app.state.registry.get(tenant).salt
    hashes = extend_block_hashes([], root_hash(salt, engine.fingerprint, None), prompt, 16)
    prefix = f"kvgate:{engine.fingerprint.hex()}:"
    with redis_server.client() as client:
        present = {k for k in client.keys(prefix + "*") if b":owner:" not in k}
    return {(prefix + h.hex()).encode() for h in hashes}, present


def test_lookup_follows_a_prompt_down_the_tiers_and_a_prefetch_brings_it_back(app_server: Any) -> None:
    acme = sdk(app_server, "acme")
    prompt = ids(1)
    cold = post(acme, "/cache/lookup", {"prompt": prompt})
    assert cold == {"object": "cache.lookup", "prompt_tokens": 161, "block_size": 16, "cached_tokens": 0,
                    "tiers": {"device": 0, "host": 0, "disk": 0, "remote": 0},
                    "blocks": {"device": 0, "host": 0, "disk": 0, "remote": 0}}
    text, _ = complete(acme, prompt)
    hot = post(acme, "/cache/lookup", {"prompt": prompt})
    assert hot["cached_tokens"] == 160 and hot["tiers"]["device"] == 160 and hot["blocks"]["remote"] == 10
    flood(app_server, 9, prompts=3)  # more than the device holds, less than the host does
    assert lookup_until(acme, prompt, "host", 160)["tiers"]["host"] == 160
    flood(app_server, 1)
    cold_again = lookup_until(acme, prompt, "disk", 160)
    assert cold_again["tiers"] == {"device": 0, "host": 0, "disk": 160, "remote": 0}, cold_again
    up = post(acme, "/cache/prefetch", {"prompt": prompt, "ttl_s": 60})
    assert up["loaded_blocks"] == {"disk": 10} and up["loaded_tokens"] == 160 and up["protected_blocks"] == 10
    assert post(acme, "/cache/lookup", {"prompt": prompt})["tiers"]["host"] == 160
    assert complete(acme, prompt) == (text, 160)
    metrics = httpx.get(app_server.url + "/admin/metrics", headers=ADMIN).json()["cache_control"]
    assert metrics["prefetched_blocks"]["disk"] >= 10 and metrics["requests"]["prefetch"] >= 1
    assert metrics["protected_keys"] == 10
    assert post(acme, "/cache/unpin", {"all": True})["unpinned_blocks"] == 10  # protections go with pins


def test_a_chat_prefix_is_looked_up_as_the_chat_route_renders_it(app_server: Any) -> None:
    acme = sdk(app_server, "acme")
    messages = [{"role": "system", "content": "You answer in one word. " * 12},
                {"role": "user", "content": "Which colour is the sky on a clear day?"}]
    first = acme.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    found = post(acme, "/cache/lookup", {"messages": messages})
    again = acme.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    assert found["prompt_tokens"] == first.usage.prompt_tokens
    assert found["cached_tokens"] == again.usage.prompt_tokens_details.cached_tokens > 0


def test_a_pin_outlives_another_tenants_flood_and_unpinned_the_prefix_goes(app_server: Any) -> None:
    acme = sdk(app_server, "acme")
    prompt = ids(2)
    text, _ = complete(acme, prompt)
    pinned = post(acme, "/cache/pin", {"prompt": prompt})
    assert pinned == {"object": "cache.pin", "pinned_blocks": 10, "pinned_tokens": 160, "cached_tokens": 160,
                      "new_pins": 10, "tenant_pinned_blocks": 10, "quota": None}
    flood(app_server, 2)
    assert post(acme, "/cache/lookup", {"prompt": prompt})["tiers"]["host"] == 160
    metrics = httpx.get(app_server.url + "/admin/metrics", headers=ADMIN).json()["cache_control"]
    assert metrics["pinned_blocks"]["host"] == 10 and metrics["held_by_tenant"]["acme"] == 10
    prom = httpx.get(app_server.url + "/metrics", headers=ADMIN).text
    assert 'kvgate_cache_pinned_blocks{tier="host"} 10.0' in prom
    assert complete(acme, prompt) == (text, 160)
    assert post(acme, "/cache/unpin", {"prompt": prompt}) == {"object": "cache.unpin", "unpinned_blocks": 10,
                                                               "tenant_pinned_blocks": 0}
    flood(app_server, 3)
    assert post(acme, "/cache/lookup", {"prompt": prompt})["blocks"]["host"] == 0  # ordinary again: evicted


def test_a_pin_past_the_tenants_quota_is_a_409_naming_it(app_server: Any) -> None:
    small = sdk(app_server, "small")
    prompt = ids(3)
    complete(small, prompt)
    with pytest.raises(openai.ConflictError) as refused:
        small.post("/cache/pin", body={"prompt": prompt}, cast_to=httpx.Response)
    error = assert_error(refused.value.response, 409, param="prompt", code="quota_exceeded")
    assert "quota of 4" in error["message"] and "already holds 0" in error["message"]
    assert post(small, "/cache/pin", {"prompt": prompt[:70]})["pinned_blocks"] == 4  # 4 blocks fit
    assert post(small, "/cache/unpin", {"all": True})["unpinned_blocks"] == 4


def test_delete_drops_a_prefix_everywhere_redis_included_and_the_next_request_recomputes(
        app_server: Any, redis_server: Any) -> None:
    acme = sdk(app_server, "acme")
    prompt, other = ids(4), ids(5)
    text, _ = complete(acme, prompt)
    complete(acme, other)
    mine, present = remote_keys(app_server, redis_server, "acme", prompt)
    assert mine <= present
    gone = delete(acme, {"prompt": prompt})
    assert gone["dropped_blocks"]["device"] == 10 and gone["dropped_blocks"]["remote"] == 10
    after = post(acme, "/cache/lookup", {"prompt": prompt})
    assert after["cached_tokens"] == 0 and set(after["blocks"].values()) == {0}
    _, present = remote_keys(app_server, redis_server, "acme", prompt)
    assert not mine & present  # the records are gone from Redis
    assert post(acme, "/cache/lookup", {"prompt": other})["cached_tokens"] == 160  # another prefix stays
    assert complete(acme, prompt) == (text, 0)  # recomputed, the same greedy output


def test_delete_all_drops_every_block_of_the_caller_and_no_one_elses(app_server: Any, redis_server: Any) -> None:
    acme, globex = sdk(app_server, "acme"), sdk(app_server, "globex")
    theirs = ids(6)
    complete(globex, theirs)
    complete(acme, ids(7))
    acme_keys, _ = remote_keys(app_server, redis_server, "acme", ids(7))
    gone = httpx.delete(app_server.url + "/v1/cache?all=true", headers={"Authorization": f"Bearer {KEYS['acme']}"})
    assert gone.status_code == 200, gone.text
    assert gone.json()["dropped_blocks"]["remote"] >= 10
    assert post(acme, "/cache/lookup", {"prompt": ids(7)})["cached_tokens"] == 0
    assert post(acme, "/cache/lookup", {"prompt": ids(1)})["cached_tokens"] == 0  # earlier tests' prompts too
    theirs_keys, present = remote_keys(app_server, redis_server, "globex", theirs)
    assert theirs_keys <= present and not acme_keys & present
    assert post(globex, "/cache/lookup", {"prompt": theirs})["cached_tokens"] == 160
    assert delete(acme, {"all": True})["dropped"] == 0  # nothing left


def test_another_tenant_probing_a_prompt_learns_nothing(app_server: Any) -> None:
    acme, globex = sdk(app_server, "acme"), sdk(app_server, "globex")
    secret, unknown = ids(8), ids(9)
    complete(acme, secret)
    assert post(acme, "/cache/pin", {"prompt": secret})["pinned_blocks"] == 10
    before = post(acme, "/cache/lookup", {"prompt": secret})
    for path, body in (("/cache/lookup", {}), ("/cache/pin", {}), ("/cache/unpin", {}),
                       ("/cache/prefetch", {"ttl_s": 5})):
        probed = post(globex, path, {"prompt": secret, **body})
        control = post(globex, path, {"prompt": unknown, **body})
        probed.pop("expires_at", None), control.pop("expires_at", None)
        assert probed == control, path
    assert delete(globex, {"prompt": secret}) == delete(globex, {"prompt": unknown})
    assert post(acme, "/cache/lookup", {"prompt": secret}) == before  # A's blocks untouched
    assert post(acme, "/cache/unpin", {"prompt": secret})["unpinned_blocks"] == 10


def test_the_admin_key_acts_for_a_named_tenant_and_a_tenant_key_may_not(app_server: Any) -> None:
    prompt = ids(10)
    complete(sdk(app_server, "acme"), prompt)
    url = app_server.url + "/v1/cache/lookup"
    as_admin = httpx.post(url, headers=ADMIN, json={"prompt": prompt, "tenant": "acme"})
    assert as_admin.status_code == 200 and as_admin.json()["cached_tokens"] == 160
    assert httpx.post(url, headers=ADMIN, json={"prompt": prompt, "tenant": "globex"}).json()["cached_tokens"] == 0
    assert_error(httpx.post(url, headers=ADMIN, json={"prompt": prompt}), 400, param="tenant")
    assert_error(httpx.post(url, headers=ADMIN, json={"prompt": prompt, "tenant": "nobody"}), 400, param="tenant")
    tenant = {"Authorization": f"Bearer {KEYS['globex']}"}
    assert_error(httpx.post(url, headers=tenant, json={"prompt": prompt, "tenant": "acme"}), 403, param="tenant",
                 code="permission_denied")
    assert_error(httpx.post(url, json={"prompt": prompt}), 401)
    assert_error(httpx.post(url, headers={"Authorization": "Bearer sk-nope"}, json={"prompt": prompt}), 401)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/cache/lookup", {"prompt": ""}, "prompt"),
    ("/v1/cache/lookup", {"prompt": []}, "prompt"),
    ("/v1/cache/lookup", {}, "prompt"),
    ("/v1/cache/lookup", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "messages"),
    ("/v1/cache/lookup", {"messages": []}, "messages"),
    ("/v1/cache/lookup", {"prompt": [5] * 5000}, "prompt"),
    ("/v1/cache/lookup", {"prompt": "many words " * 20000}, "prompt"),
    ("/v1/cache/lookup", {"prompt": [5, 100_000]}, "prompt"),
    ("/v1/cache/lookup", {"prompt": [5], "cache_salt": ""}, "cache_salt"),
    ("/v1/cache/lookup", {"prompt": [5], "extra": 1}, "extra"),
    ("/v1/cache/prefetch", {"prompt": [5], "ttl_s": 0}, "ttl_s"),
    ("/v1/cache/prefetch", {"prompt": [5], "ttl_s": 86400}, "ttl_s"),
    ("/v1/cache/prefetch", {"prompt": [5], "ttl_s": "60"}, "ttl_s"),
    ("/v1/cache/unpin", {"prompt": [5], "all": True}, "all"),
])
def test_bad_input_is_a_400_naming_the_field(app_server: Any, path: str, body: dict, param: str) -> None:
    response = httpx.post(app_server.url + path, json=body, headers={"Authorization": f"Bearer {KEYS['acme']}"})
    error = assert_error(response, 400, param=param)
    assert error["type"] == "invalid_request_error"


def test_a_delete_naming_nothing_is_a_400(app_server: Any) -> None:
    response = httpx.request("DELETE", app_server.url + "/v1/cache",
                             headers={"Authorization": f"Bearer {KEYS['acme']}"})
    assert_error(response, 400, param="prompt")


def test_the_routes_are_in_the_openapi_schema(app_server: Any) -> None:
    schema = httpx.get(app_server.url + "/openapi.json", headers=ADMIN).json()
    for path, method in (("/v1/cache/lookup", "post"), ("/v1/cache/prefetch", "post"), ("/v1/cache/pin", "post"),
                         ("/v1/cache/unpin", "post"), ("/v1/cache", "delete")):
        operation = schema["paths"][path][method]
        assert operation["tags"] == ["cache"] and operation["description"]
        assert "200" in operation["responses"]
    assert "CacheLookupResponse" in schema["components"]["schemas"]


def test_a_public_prefix_hashes_as_for_a_request_and_is_nobodys_to_drop(app_server: Any) -> None:
    public = ids(11, 40)  # two full blocks every tenant shares, then a partial one
    added = httpx.post(app_server.url + "/admin/public-prefixes", headers=ADMIN,
                       json={"name": "cache-api-test", "token_ids": public})
    assert added.status_code == 200, added.text
    try:
        acme, globex = sdk(app_server, "acme"), sdk(app_server, "globex")
        mine, unknown = public + ids(12, 121), public + ids(13, 121)
        complete(acme, mine)
        assert post(acme, "/cache/lookup", {"prompt": mine})["cached_tokens"] == 160
        probed = post(globex, "/cache/lookup", {"prompt": mine})
        assert probed["cached_tokens"] == 32 and probed == post(globex, "/cache/lookup", {"prompt": unknown})
        assert post(acme, "/cache/lookup", {"prompt": mine, "cache_salt": "own"})["cached_tokens"] == 0
        pinned = post(acme, "/cache/pin", {"prompt": mine})
        assert pinned["pinned_blocks"] == 8 and pinned["cached_tokens"] == 160  # the public two are nobody's
        gone = delete(acme, {"prompt": mine})
        assert gone["dropped_blocks"]["device"] == 8 and gone["unpinned_blocks"] == 8
        assert post(globex, "/cache/lookup", {"prompt": unknown})["cached_tokens"] == 32  # still shared
    finally:
        httpx.delete(app_server.url + "/admin/public-prefixes/cache-api-test", headers=ADMIN)
