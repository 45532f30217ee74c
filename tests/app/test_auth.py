"""A server configured from TOML: tenants with bearer keys, admin key, namespaces, queue limit."""

from __future__ import annotations

import json
import re
import threading

import httpx
import openai
import pytest

from tests.app.conftest import ADMIN_KEY, TENANT_KEYS, assert_error, wait_for_idle

PROMPT = " ".join(f"tenant data row {i};" for i in range(40))  # several full blocks
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _key(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TENANT_KEYS[name]}"}


@pytest.fixture()
def http(tenant_server):
    with httpx.Client(base_url=tenant_server.url, timeout=60) as client:
        yield client


def _cached(http: httpx.Client, tenant: str, **extra) -> int:
    response = http.post("/v1/completions", headers=_key(tenant),
                         json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1, **extra})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_v1_needs_a_valid_key(http: httpx.Client) -> None:
    for path in ("/v1/models", "/v1/models/tiny"):
        assert_error(http.get(path), 401, code="invalid_api_key")
        assert_error(http.get(path, headers={"Authorization": "Bearer sk-wrong"}), 401, code="invalid_api_key")
        assert_error(http.get(path, headers={"Authorization": TENANT_KEYS["acme"]}), 401)  # no scheme
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert_error(response, 401)
    assert response.headers["www-authenticate"] == "Bearer"
    # auth comes before body validation: a bad body without a key is still 401
    assert_error(http.post("/v1/chat/completions", content=b"{"), 401)
    assert http.get("/v1/models", headers=_key("acme")).status_code == 200
    assert http.get("/v1/models", headers={"Authorization": "Bearer sk-acme-2"}).status_code == 200
    assert http.get("/health").status_code == 200 and http.get("/ready").status_code == 200


def test_openai_client_with_key(tenant_server) -> None:
    client = openai.OpenAI(base_url=tenant_server.url + "/v1", api_key=TENANT_KEYS["beta"], max_retries=0)
    assert client.models.list().data[0].id == "tiny"
    bad = openai.OpenAI(base_url=tenant_server.url + "/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_admin_metrics_needs_admin_key(http: httpx.Client) -> None:
    assert_error(http.get("/admin/metrics"), 401)
    assert_error(http.get("/admin/metrics", headers=_key("acme")), 401)
    metrics = http.get("/admin/metrics", headers=ADMIN).json()
    assert metrics["blocks_in_use"] == 0 and metrics["requests"]["requests_total"] > 0


def test_namespaces_isolate_tenants_and_groups_share(http: httpx.Client) -> None:
    _cached(http, "acme")
    assert _cached(http, "acme") > 0  # a tenant reuses its own prefix
    assert _cached(http, "beta") == 0  # another tenant never hits acme's blocks
    assert _cached(http, "gamma") > 0  # beta and gamma share the group "team"
    assert _cached(http, "gamma", cache_salt="private") == 0


def test_body_limit_is_configurable(http: httpx.Client) -> None:
    body = {"model": "tiny", "prompt": "a" * 70_000}
    assert_error(http.post("/v1/completions", headers=_key("acme"), json=body), 413)


def test_full_queue_is_429_with_retry_after(http: httpx.Client, tenant_server) -> None:
    """max_num_seqs = 1 and max_queue = 1: one running, one waiting, the third is refused."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    started = [threading.Event(), threading.Event()]
    stop = threading.Event()

    def hold(i: int) -> None:
        with httpx.Client(base_url=tenant_server.url, timeout=60) as client, \
                client.stream("POST", "/v1/completions", json=body, headers=_key("acme")) as response:
            assert response.status_code == 200
            started[i].set()
            for _ in response.iter_lines():
                if stop.is_set():
                    break

    threads = [threading.Thread(target=hold, args=(i,)) for i in range(2)]
    try:
        threads[0].start()
        assert started[0].wait(30)
        threads[1].start()
        assert started[1].wait(30)
        response = http.post("/v1/completions", headers=_key("acme"),
                             json={"model": "tiny", "prompt": "y", "max_tokens": 1})
        error = assert_error(response, 429, code="queue_full")
        assert int(response.headers["retry-after"]) >= 1
        assert error["type"] == "rate_limit_error"
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert wait_for_idle(http, headers=ADMIN)["blocks_in_use"] == 0
    ok = http.post("/v1/completions", headers=_key("acme"), json={"model": "tiny", "prompt": "y", "max_tokens": 1})
    assert ok.status_code == 200


def test_tiers_are_on_and_keys_never_logged(tenant_server) -> None:
    assert re.search(r"cache tiers: host \d+ blocks \(64 MiB\)", tenant_server.log())
    assert all(key not in tenant_server.log() for key in (*TENANT_KEYS.values(), ADMIN_KEY))


def test_chat_with_tenant_key(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", headers=_key("gamma"),
                         json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert json.loads(response.text)["usage"]["total_tokens"] >= 1
