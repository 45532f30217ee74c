"""The cache control API across the engine-process boundary (`kvgate serve`): commands pickle
over the pipe, and answers sent by the tiers' I/O thread (a delete's disk and file work) reach
the HTTP handler as the step loop's own replies do. Prompts are this module's own, so the shared
server's other tests see nothing change."""

from __future__ import annotations

import random

import httpx
import openai


def ids(seed: int, n: int = 161) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def test_lookup_pin_prefetch_and_delete_through_the_engine_process(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def post(path: str, body: dict) -> dict:
        response = client.post(path, body=body, cast_to=httpx.Response)
        assert response.status_code == 200, response.text
        return response.json()

    prompt = ids(31_337)
    assert post("/cache/lookup", {"prompt": prompt})["cached_tokens"] == 0
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    assert post("/cache/lookup", {"prompt": prompt})["tiers"]["device"] == 160
    assert post("/cache/pin", {"prompt": prompt})["pinned_blocks"] == 10
    assert post("/cache/prefetch", {"prompt": prompt, "ttl_s": 5})["cached_tokens"] == 160
    gone = client.delete("/cache", body={"prompt": prompt}, cast_to=httpx.Response).json()
    assert gone["dropped_blocks"]["device"] == 10 and gone["unpinned_blocks"] == 10
    assert post("/cache/lookup", {"prompt": prompt})["cached_tokens"] == 0
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    metrics = httpx.get(server.url + "/admin/metrics").json()["cache_control"]
    assert metrics["requests"]["delete"] >= 1 and metrics["dropped_blocks"]["device"] >= 10
