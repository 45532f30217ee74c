"""Tenant flooding against a real server: does a quiet tenant keep its hot prefix while a noisy
tenant sends unique long prompts at full speed? Run once without quotas and once with them.

Each run is a fresh `kvgate serve` (tiny model by default; small device pool and host tier so the
flood overflows both; no disk tier, so what leaves host is gone). The noisy tenant's clients send
unique prompts back to back for the whole run; the quiet tenant asks, one request at a time, a
question after its fixed system prompt. Reported per run: the quiet tenant's hit rate (cached
prompt tokens / the prefix's reusable tokens, and the share of requests that hit all of it), its
TTFT p50/p95, and the noisy tenant's requests and own hit rate.

    .venv/bin/python -m bench.flood_bench --json-out docs/bench_flood.json \\
        --plot-out docs/bench_flood.png
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.serve_bench import free_port, say, stop, wait_ready

KEYS = {"quiet": "sk-bench-quiet", "noisy": "sk-bench-noisy"}
CONFIG = """
[model]
path = "{model}"

[server]
secret = "bench-only-secret-0123456789abcdef"

[cache]
block_size = 16

[cache.device]
num_blocks = {device_blocks}

[cache.host]
capacity_mb = {host_mb}

[[tenants]]
name = "quiet"
api_keys = ["{quiet}"]

[[tenants]]
name = "noisy"
api_keys = ["{noisy}"]
{quota}
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.flood_bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="model to serve: tiny (default), default, a folder or hub id")
    p.add_argument("--device-blocks", type=int, default=64, help="device KV blocks of 16 tokens (default 64)")
    p.add_argument("--host-mb", type=int, default=1, help="host tier MiB (default 1: 128 tiny-model blocks)")
    p.add_argument("--quota", default="device = 16, host = 32",
                   help="the noisy tenant's quota in the second run, TOML inline-table body "
                        "(default 'device = 16, host = 32')")
    p.add_argument("--prefix-tokens", type=int, default=320, help="the quiet tenant's system prompt (default 320)")
    p.add_argument("--flood-tokens", type=int, default=640, help="tokens per noisy prompt (default 640)")
    p.add_argument("--flood-clients", type=int, default=3, help="noisy clients sending back to back (default 3)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per run (default 30)")
    p.add_argument("--json-out", type=Path, default=None, help="write the figures here as JSON")
    p.add_argument("--plot-out", type=Path, default=None, help="write a PNG plot here (needs matplotlib)")
    return p.parse_args(argv)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def complete(client: httpx.Client, model: str, prompt: list[int]) -> tuple[int, float, int]:
    """One streamed completion: (status, TTFT s, cached prompt tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    ttft, cached = 0.0, 0
    with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, 0.0, 0
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if not ttft and event.get("choices"):
                ttft = time.perf_counter() - started
            usage = event.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return 200, ttft, cached


def run(args: argparse.Namespace, quota: str, folder: Path) -> dict[str, float]:
    config = folder / "kvgate.toml"
    config.write_text(CONFIG.format(model=args.model, device_blocks=args.device_blocks, host_mb=args.host_mb,
                                    quota=f"quota = {{ {quota} }}" if quota else "", **KEYS))
    url = f"http://127.0.0.1:{free_port()}"
    exe = str(Path(sys.executable).with_name("kvgate"))
    with (folder / "server.log").open("w") as log:
        proc = subprocess.Popen([exe, "serve", "--config", str(config), "--port", url.rsplit(":", 1)[1],
                                 "--disk-cache", "off", "--log-level", "warning"],
                                stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        try:
            wait_ready(url, proc, 900.0, "/ready")
            return _measure(args, url)
        finally:
            stop(proc)


def _measure(args: argparse.Namespace, url: str) -> dict[str, float]:
    reusable = args.prefix_tokens // 16 * 16
    system = ids(1, args.prefix_tokens)
    quiet = httpx.Client(base_url=url, timeout=600, headers={"Authorization": f"Bearer {KEYS['quiet']}"})
    complete(quiet, args.model, system + ids(2, 8))  # the hot prefix is computed once
    done = threading.Event()
    noisy: list[tuple[int, int]] = []

    def flood(k: int) -> None:
        with httpx.Client(base_url=url, timeout=600, headers={"Authorization": f"Bearer {KEYS['noisy']}"}) as c:
            i = 0
            while not done.is_set():
                status, _, cached = complete(c, args.model, ids(10_000 * (k + 1) + i, args.flood_tokens))
                noisy.append((status, cached))
                i += 1

    threads = [threading.Thread(target=flood, args=(k,)) for k in range(args.flood_clients)]
    for thread in threads:
        thread.start()
    samples: list[tuple[float, int]] = []
    end = time.monotonic() + args.duration
    i = 0
    try:
        while time.monotonic() < end:
            status, ttft, cached = complete(quiet, args.model, system + ids(100 + i, 8))
            if status == 200:
                samples.append((ttft, cached))
            i += 1
            time.sleep(0.2)
    finally:
        done.set()
        for thread in threads:
            thread.join()
        quiet.close()
    ttfts = sorted(t for t, _ in samples)
    return {
        "quiet_requests": float(len(samples)),
        "quiet_hit_rate": sum(c for _, c in samples) / max(1, reusable * len(samples)),
        "quiet_full_hits": sum(1 for _, c in samples if c >= reusable) / max(1, len(samples)),
        "quiet_ttft_p50_ms": statistics.median(ttfts) * 1000 if ttfts else 0.0,
        "quiet_ttft_p95_ms": ttfts[int(0.95 * (len(ttfts) - 1))] * 1000 if ttfts else 0.0,
        "noisy_requests": float(len(noisy)),
        "noisy_failures": float(sum(1 for s, _ in noisy if s != 200)),
    }


def plot(results: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    axes[0].bar(names, [results[n]["quiet_hit_rate"] * 100 for n in names], color=["tab:red", "tab:green"])
    axes[0].set_ylabel("%")
    axes[0].set_ylim(0, 105)
    axes[0].set_title("quiet tenant: prefix tokens served from cache")
    width = 0.35
    for j, stat in enumerate(("p50", "p95")):
        axes[1].bar([i + (j - 0.5) * width for i in range(len(names))],
                    [results[n][f"quiet_ttft_{stat}_ms"] for n in names], width, label=stat)
    axes[1].set_xticks(range(len(names)), names)
    axes[1].set_ylabel("ms")
    axes[1].legend()
    axes[1].set_title("quiet tenant TTFT while noisy floods")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="kvgate-flood-") as tmp:
        for name, quota in (("no quota", ""), ("noisy quota", args.quota)):
            folder = Path(tmp) / name.replace(" ", "_")
            folder.mkdir()
            say(f"{name}: starting a server and flooding for {args.duration:.0f} s")
            results[name] = run(args, quota, folder)
            say(f"{name}: quiet hit rate {results[name]['quiet_hit_rate']:.1%}")
    fields = list(next(iter(results.values())))
    print("\n| figure | " + " | ".join(results) + " |\n|---|" + "---|" * len(results))
    for field in fields:
        print(f"| {field} | " + " | ".join(f"{results[n][field]:.3f}" for n in results) + " |")
    payload: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}
    if args.json_out:
        args.json_out.write_text(json.dumps(payload, indent=2) + "\n")
    if args.plot_out:
        plot(results, args.plot_out)
        say(f"plot written to {args.plot_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
