"""Per-tenant rate and concurrency limits over HTTP: 429 in the OpenAI error shape with
`Retry-After`, other tenants unaffected, concurrency slots freed when a request ends, fails or
its client leaves, and limits changed by a reload."""

from __future__ import annotations

import time

import httpx
import pytest

from app.errors import RateLimitError
from app.settings import ConfigError, load_settings
from tests.app.conftest import assert_error

ADMIN = {"Authorization": "Bearer admin-key-limits"}
BURSTY = {"Authorization": "Bearer sk-bursty"}
SERIAL = {"Authorization": "Bearer sk-serial"}
FREE = {"Authorization": "Bearer sk-free"}
CONFIG = """
[model]
path = "tiny"

[admin]
api_key = "admin-key-limits"

[[tenants]]
name = "bursty"
api_keys = ["sk-bursty"]
rate = {{ requests_per_s = {rps}, burst = 2 }}

[[tenants]]
name = "serial"
api_keys = ["sk-serial"]
max_concurrent = 1

[[tenants]]
name = "free"
api_keys = ["sk-free"]
"""
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 1}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def served(start_app, tmp_path_factory):
    config = tmp_path_factory.mktemp("limits") / "kvgate.toml"
    config.write_text(CONFIG.format(rps=0.01))
    server = start_app("--config", str(config))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            yield client, config
    finally:
        server.stop()


def post(client: httpx.Client, headers: dict, **extra) -> httpx.Response:
    return client.post("/v1/completions", json={**BODY, **extra}, headers=headers)


def test_a_burst_beyond_the_rate_gets_429_with_retry_after(served) -> None:
    client, _ = served
    assert [post(client, BURSTY).status_code for _ in range(2)] == [200, 200]
    refused = post(client, BURSTY)
    assert_error(refused, 429)
    body = refused.json()["error"]
    assert body["type"] == "rate_limit_error" and body["code"] == "rate_limit_exceeded"
    assert "0.01 requests per second" in body["message"]
    assert 1 <= int(refused.headers["Retry-After"]) <= 100  # one request per 100 s
    # the same bucket for every generating route, streaming or not
    for path, payload in (("/v1/completions", {**BODY, "stream": True}), ("/v1/chat/completions", CHAT),
                          ("/v1/chat/completions", {**CHAT, "stream": True})):
        refused = client.post(path, json=payload, headers=BURSTY)
        assert_error(refused, 429, code="rate_limit_exceeded")
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert int(refused.headers["Retry-After"]) >= 1
    # another tenant is untouched
    assert post(client, FREE).status_code == 200
    assert client.post("/v1/chat/completions", json=CHAT, headers=FREE).status_code == 200


def _until_admitted(client: httpx.Client, headers: dict, timeout_s: float = 30.0) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        response = post(client, headers)
        if response.status_code != 429 or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


def test_max_concurrent_refuses_a_second_request_until_the_first_ends(served) -> None:
    client, _ = served
    checked = False
    with httpx.Client(base_url=client.base_url, timeout=120) as other, other.stream(
            "POST", "/v1/completions", headers=SERIAL,
            json={**BODY, "max_tokens": 2000, "ignore_eos": True, "stream": True}) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():  # while the first request streams, inside its loop
            if line.startswith("data: {") and not checked:
                checked = True
                refused = post(client, SERIAL)
                assert_error(refused, 429)
                assert "1 concurrent requests" in refused.json()["error"]["message"]
                assert int(refused.headers["Retry-After"]) >= 1
                assert post(client, FREE).status_code == 200
                break  # the client leaves mid-stream: its slot must be freed
    assert checked
    assert _until_admitted(client, SERIAL).status_code == 200
    assert post(client, SERIAL).status_code == 200  # and only one slot: nothing left behind


def test_failed_requests_leave_no_slot_behind(served) -> None:
    client, _ = served
    for _ in range(3):  # refused by the engine after admission (a token id beyond the vocabulary)
        assert_error(post(client, SERIAL, prompt=[5, 10**6]), 400)
        assert_error(post(client, SERIAL, prompt=[5, 10**6], stream=True), 400)
        assert_error(post(client, SERIAL, prompt=[[5], [10**6]]), 400)  # all prompts or none
        assert_error(client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10**6}, headers=SERIAL), 400)
        assert_error(post(client, SERIAL, max_tokens=-1), 400)  # refused before admission
    assert post(client, SERIAL).status_code == 200
    assert post(client, SERIAL, stream=True).status_code == 200
    assert client.post("/v1/chat/completions", json=CHAT, headers=SERIAL).status_code == 200


def test_a_reload_keeps_the_state_and_applies_new_limits(served) -> None:
    client, config = served
    while post(client, BURSTY).status_code == 200:  # use up whatever the bucket holds
        pass
    assert client.post("/admin/reload", headers=ADMIN).status_code == 200  # same limits: the bucket stays empty
    assert_error(post(client, BURSTY), 429, code="rate_limit_exceeded")
    config.write_text(CONFIG.format(rps=1000.0))
    assert client.post("/admin/reload", headers=ADMIN).status_code == 200
    assert _until_admitted(client, BURSTY, timeout_s=5).status_code == 200


@pytest.mark.parametrize(("wait_s", "header"), [(0.0001, "1"), (1.0, "1"), (1.2, "2"), (99.5, "100")])
def test_retry_after_is_whole_seconds_never_zero(wait_s: float, header: str) -> None:
    assert RateLimitError("over", wait_s).headers == {"Retry-After": header}


@pytest.mark.parametrize(("entry", "expected"), [
    ("rate = { requests_per_s = 0 }", "'tenants[0].rate.requests_per_s' (tenant 'acme'): Input should be greater than 0"),
    ("rate = { requests_per_s = inf }", "'tenants[0].rate.requests_per_s' (tenant 'acme'): Input should be a finite"),
    ("rate = { requests_per_s = 1, burst = 0 }", "'tenants[0].rate.burst' (tenant 'acme')"),
    ("rate = { requests_per_s = 1, burst = 2.5 }", "'tenants[0].rate.burst' (tenant 'acme')"),
    ("rate = { burst = 3 }", "tenant 'acme': rate.burst needs rate.requests_per_s"),
    ("rate = { tokens_per_min = -5 }", "'tenants[0].rate.tokens_per_min' (tenant 'acme')"),
    ("max_concurrent = 0", "'tenants[0].max_concurrent' (tenant 'acme')"),
    ("max_concurrent = true", "'tenants[0].max_concurrent' (tenant 'acme')"),
    ("rate = { rps = 3 }", "unknown key 'tenants[0].rate.rps' (tenant 'acme')"),
])
def test_invalid_limits_name_the_tenant_and_the_field(tmp_path, entry: str, expected: str) -> None:
    config = tmp_path / "kvgate.toml"
    config.write_text(f'[[tenants]]\nname = "acme"\napi_keys = ["sk-acme"]\n{entry}\n')
    with pytest.raises(ConfigError) as error:
        load_settings(config, env={})
    assert expected in str(error.value)


def test_limits_reach_the_tenant_and_the_anonymous_tenant_is_unlimited(tmp_path) -> None:
    config = tmp_path / "kvgate.toml"
    config.write_text('[[tenants]]\nname = "acme"\napi_keys = ["sk-acme"]\n'
                      'rate = { requests_per_s = 5.0, burst = 10, tokens_per_min = 200000 }\nmax_concurrent = 4\n')
    env = {"KVGATE_SECRET": "tests-only-server-secret-0123456789"}
    (acme,) = load_settings(config, env={}).tenant_registry(env).tenants
    assert (acme.limits.requests_per_s, acme.limits.burst, acme.limits.tokens_per_min,
            acme.limits.max_concurrent) == (5.0, 10, 200000, 4)
    anonymous = load_settings(None, env={}).tenant_registry(env).anonymous
    assert not anonymous.limits.any
