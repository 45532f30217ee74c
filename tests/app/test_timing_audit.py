"""Timing audit after Gu et al. ("Auditing Prompt Caching in Language Model APIs", ICML 2025).

An attacker who can tell a cache hit from a miss by its time to first token learns which prompts
someone else sent. The audit sends, through HTTP, 120 samples per side and compares the TTFT
distributions with a two-sample Kolmogorov–Smirnov test:

- across tenants, B sending prompts A has just cached vs B sending fresh prompts of the same
  length must show no signal (p > 0.01): B's namespace salt gives B other block keys;
- within a tenant, A repeating its prompts vs A sending fresh ones must show a clear signal
  (p < 0.01): the audit can see a cache when there is one, so its silence above means something.

Under the null hypothesis p is uniform, so one audit fails 1 % of the time by chance; the
cross-tenant side is therefore run a second time with new prompts when the first shows a
signal, and only a signal in both (chance 0.01 %) fails. The order within each sample is
shuffled with a fixed seed so that drift on a busy machine falls on both sides alike.
"""

from __future__ import annotations

import random
import time

import httpx

from app.ks import ks_2samp
from tests.app.conftest import TENANT_KEYS

SAMPLES = 120
PROMPT_TOKENS = 700  # 43 full blocks: a hit skips most of the prefill
ALPHA = 0.01


def test_ks_detects_a_shift_and_not_noise() -> None:
    rng = random.Random(0)
    same = ks_2samp([rng.gauss(0, 1) for _ in range(200)], [rng.gauss(0, 1) for _ in range(200)])
    shifted = ks_2samp([rng.gauss(0, 1) for _ in range(200)], [rng.gauss(1, 1) for _ in range(200)])
    assert same[1] > 0.05 and shifted[1] < 1e-6
    assert ks_2samp([1.0, 2.0], [1.0, 2.0]) == (0.0, 1.0)


class Audit:
    def __init__(self, client: httpx.Client, seed: int) -> None:
        self.client = client
        self.rng = random.Random(seed)

    def prompt(self) -> list[int]:
        return [self.rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS)]

    def ttft(self, tenant: str, ids: list[int]) -> float:
        """Seconds to the first streamed token (the attacker's clock), and the cache's answer."""
        body = {"model": "tiny", "prompt": ids, "max_tokens": 1, "stream": True,
                "stream_options": {"include_usage": True}}
        headers = {"Authorization": f"Bearer {TENANT_KEYS[tenant]}"}
        started = time.perf_counter()
        first = None
        with self.client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.perf_counter() - started
        assert first is not None
        return first

    def run(self) -> dict[str, list[float]]:
        sides: dict[str, list[float]] = {"b_on_a": [], "b_fresh": [], "a_repeat": [], "a_fresh": []}
        for _ in range(SAMPLES):
            secret = self.prompt()
            self.ttft("acme", secret)  # A's prompt, now cached in A's namespace
            probes = {"b_on_a": ("beta", secret), "b_fresh": ("beta", self.prompt()),
                      "a_repeat": ("acme", secret), "a_fresh": ("acme", self.prompt())}
            order = list(probes)
            self.rng.shuffle(order)
            for side in order:
                sides[side].append(self.ttft(*probes[side]))
        return sides


def test_cache_timing_leaks_nothing_across_tenants_and_is_visible_within_one(tenant_server) -> None:
    with httpx.Client(base_url=tenant_server.url, timeout=60) as client:
        first = Audit(client, seed=1).run()
        _, p_within = ks_2samp(first["a_repeat"], first["a_fresh"])
        assert p_within < ALPHA, f"the audit cannot see A's own cache (p={p_within:.3g}): it proves nothing"
        assert _median(first["a_repeat"]) < _median(first["a_fresh"])
        _, p_across = ks_2samp(first["b_on_a"], first["b_fresh"])
        print(f"timing audit: within A p={p_within:.3g} (median {_median(first['a_repeat']) * 1e3:.1f} vs "
              f"{_median(first['a_fresh']) * 1e3:.1f} ms); across tenants p={p_across:.3g} (median "
              f"{_median(first['b_on_a']) * 1e3:.1f} vs {_median(first['b_fresh']) * 1e3:.1f} ms)")
        if p_across <= ALPHA:  # 1 % by chance under no leak: a second, independent audit decides
            second = Audit(client, seed=2).run()
            _, p_again = ks_2samp(second["b_on_a"], second["b_fresh"])
            assert p_again > ALPHA, f"B can time A's cache: p={p_across:.3g}, then p={p_again:.3g}"


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]
