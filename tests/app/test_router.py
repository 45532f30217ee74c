"""`kvgate route` in front of two `kvgate serve` replicas (tiny model, KV events on): a prompt
comes back to the replica that cached it, a tenant's prompt is matched only against its own
blocks, streams are relayed, bad keys get the replicas' 401, and a replica killed mid-run loses
no request the other could serve."""

from __future__ import annotations

import json
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from app.router.replicas import Replicas, reachable
from app.settings import load_settings
from tests.app.conftest import ADMIN_KEY, TENANT_KEYS

pytestmark = pytest.mark.server

CONFIG = f"""
[model]
path = "tiny"

[server]
secret = "tests-only-router-secret-0123456789"

[cache]
block_size = 16

[cache.device]
num_blocks = 256

[events]
endpoint = "tcp://127.0.0.1:*"
replay_endpoint = "tcp://127.0.0.1:*"

[admin]
api_key = "{ADMIN_KEY}"

[[tenants]]
name = "acme"
api_keys = ["{TENANT_KEYS['acme']}"]

[[tenants]]
name = "beta"
api_keys = ["{TENANT_KEYS['beta']}"]
"""
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TENANT_KEYS[tenant]}"}


def _ids(seed: int, n: int = 330) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


class RouterServer:
    """`create_router_app` on uvicorn, on a thread of this process."""

    def __init__(self, config_path: str, urls: list[str], load_weight: float = 1.0, policy: str = "prefix") -> None:
        import uvicorn

        from app.router.cli import _tokenizer
        from app.router.server import create_router_app

        settings = load_settings(config_path)
        pool = Replicas(urls, [None] * len(urls), settings.admin.api_key, interval_s=0.2)
        self.app = create_router_app(settings, pool, _tokenizer("tiny"), load_weight, policy)
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._listener]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError("the router did not become ready")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._listener.close()


@pytest.fixture(scope="module")
def cluster(start_server, tmp_path_factory) -> Iterator[tuple[RouterServer, list]]:
    folder = tmp_path_factory.mktemp("router")
    (folder / "kvgate.toml").write_text(CONFIG)
    replicas = [start_server(config=CONFIG) for _ in range(2)]
    router = RouterServer(str(folder / "kvgate.toml"), [r.url for r in replicas])
    router.config_path = str(folder / "kvgate.toml")
    try:
        yield router, replicas
    finally:
        router.stop()


def _complete(router: RouterServer, tenant: str, ids: list[int], stream: bool = False) -> tuple[str, int]:
    body = {"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    response = httpx.post(router.url + "/v1/completions", json=body, headers=_auth(tenant), timeout=60)
    assert response.status_code == 200, response.text
    if not stream:
        data = response.json()
        return data["choices"][0]["text"], data["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    return text, chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]


def _state(router: RouterServer) -> dict:
    return httpx.get(router.url + "/admin/router", headers=ADMIN, timeout=10).json()


def _wait_indexed(router: RouterServer, blocks: int, timeout_s: float = 15.0) -> dict:
    """Until the replicas' events put at least ``blocks`` device blocks in the router's index."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = _state(router)
        if sum(r["index_blocks"].get("GPU", 0) for r in state["replicas"]) >= blocks:
            return state
        time.sleep(0.05)
    raise AssertionError(f"the router's index did not reach {blocks} blocks: {_state(router)}")


def test_a_prompt_comes_back_to_the_replica_that_cached_it(cluster) -> None:
    router, _ = cluster
    prompts = [_ids(seed) for seed in (1, 2, 3, 4)]
    cold = {}
    for i, ids in enumerate(prompts):
        cold[i], cached = _complete(router, "acme", ids)
        assert cached == 0
        _wait_indexed(router, 20 * (i + 1))
    before = _state(router)
    for i, ids in enumerate(prompts):  # every repeat finds its prefix: only one replica holds it
        text, cached = _complete(router, "acme", ids)
        assert (text, cached) == (cold[i], 320)
    after = _state(router)
    assert after["decisions"]["prefix"] - before["decisions"]["prefix"] == 4
    assert all(r["healthy"] and r["event_batches"] > 0 for r in after["replicas"])
    assert all(r["routed"] >= 1 for r in after["replicas"])  # the cold prompts were spread
    assert all(r["outstanding_tokens"] == 0 and r["in_flight"] == 0 for r in after["replicas"])


def test_a_tenant_is_matched_only_against_its_own_blocks(cluster) -> None:
    router, _ = cluster
    ids = _ids(10)
    _complete(router, "acme", ids)
    _wait_indexed(router, sum(r["index_blocks"].get("GPU", 0) for r in _state(router)["replicas"]))
    before = _state(router)["decisions"]
    text, cached = _complete(router, "beta", ids)  # the same tokens, another salt: nothing to find
    assert cached == 0
    after = _state(router)["decisions"]
    assert after["prefix"] == before["prefix"] and after["load"] == before["load"] + 1


def test_streams_are_relayed_and_bad_keys_get_the_replicas_errors(cluster) -> None:
    router, _ = cluster
    ids = _ids(20)
    text, _ = _complete(router, "acme", ids)
    streamed, cached = _complete(router, "acme", ids, stream=True)
    assert streamed == text and cached == 320
    bad = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "hi"},
                     headers={"Authorization": "Bearer sk-nobody"}, timeout=10)
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    invalid = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": -1},
                         headers=_auth("acme"), timeout=10)
    assert invalid.status_code == 400 and "error" in invalid.json()  # the replica's own validation
    models = httpx.get(router.url + "/v1/models", headers=_auth("acme"), timeout=10)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
    assert httpx.get(router.url + "/admin/router", timeout=10).status_code == 401


def test_the_cache_api_goes_where_the_prefix_is_and_deletes_go_everywhere(cluster) -> None:
    router, _ = cluster
    ids = _ids(40)
    _complete(router, "acme", ids)
    _wait_indexed(router, 20)
    post = lambda op, body: httpx.post(f"{router.url}/v1/cache/{op}", json=body, headers=_auth("acme"), timeout=30)  # noqa: E731
    found = post("lookup", {"prompt": ids})
    assert found.status_code == 200 and found.json()["cached_tokens"] == 320  # the replica that holds it
    assert post("lookup", {"prompt": ids, "tenant": "beta"}).status_code == 403  # the replica's own check
    gone = httpx.request("DELETE", router.url + "/v1/cache", json={"prompt": ids}, headers=_auth("acme"), timeout=30)
    assert gone.status_code == 200, gone.text
    body = gone.json()
    assert body["replicas"] == 2 and body["dropped_blocks"]["device"] == 20  # summed over both
    assert post("lookup", {"prompt": ids}).json()["cached_tokens"] == 0
    assert httpx.post(router.url + "/v1/cache/lookup", json={"prompt": ids}, timeout=30).status_code == 401


def test_round_robin_is_blind_to_the_prefix(cluster) -> None:
    """The baseline policy: a repeated prompt alternates between the replicas, so every other
    repeat finds nothing where it lands."""
    _, replicas = cluster
    blind = RouterServer(cluster[0].config_path, [r.url for r in replicas], policy="round_robin")
    try:
        ids = _ids(30)
        cached = [_complete(blind, "acme", ids)[1] for _ in range(4)]
        assert cached[:2] == [0, 0] and cached[2:] == [320, 320]
        state = _state(blind)
        assert state["policy"] == "round_robin" and [r["routed"] for r in state["replicas"]] == [2, 2]
    finally:
        blind.stop()


def test_a_replica_killed_mid_run_loses_no_request(cluster) -> None:
    router, replicas = cluster
    results: list[int] = []
    errors: list[str] = []

    def client(seed: int) -> None:
        for k in range(6):
            try:
                _, cached = _complete(router, "acme", _ids(100 + seed * 10 + k % 2, 200))
                results.append(cached)
            except AssertionError as exc:
                errors.append(str(exc))

    threads = [threading.Thread(target=client, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    replicas[1].proc.send_signal(signal.SIGKILL)  # no drain: connections refused from now on
    for t in threads:
        t.join(120)
    assert errors == [] and len(results) == 18
    deadline = time.monotonic() + 20  # its health checks fail (a refused connection, or one left unanswered)
    while next(r for r in _state(router)["replicas"] if r["url"] == replicas[1].url)["healthy"]:
        assert time.monotonic() < deadline, "the killed replica is still in rotation"
        time.sleep(0.1)


def test_reachable_endpoints() -> None:
    assert reachable("tcp://*:5557", "10.0.0.5") == "tcp://10.0.0.5:5557"
    assert reachable("tcp://0.0.0.0:5557", "a") == "tcp://a:5557"
    assert reachable("tcp://127.0.0.1:5557", "a") == "tcp://127.0.0.1:5557"
    assert reachable(None, "a") is None
