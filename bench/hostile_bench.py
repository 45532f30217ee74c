"""Hostile and heavy requests against a real server: the figures issue 18 asks for, in one run.

Three measurements, each on a fresh `kvgate serve` (tiny model by default, two tenants):

1. huge prompts: eight concurrent 3.9 MB prompts (under max_body_bytes): each one's time to its
   400, and the server's RSS before, at peak (sampled every 10 ms) and 2 s after;
2. fairness: tenant B's time to first token (streaming, 4 tokens) unloaded, then while tenant A
   floods with n=16 requests from several clients; the ratio of the medians;
3. event loop: `/health` latency (p50/p99/max over a fixed number of polls) while two clients
   send, in a loop, item 5's load as reported (1,000 prompts of 4,000 characters; a chat of
   130,000 messages), the worst body under the default limit (100,000 tiny JSON objects), and
   prompts that run (four of 4,000 characters each per request).

    .venv/bin/python -m bench.hostile_bench --json-out docs/bench_hostile.json \\
        --plot-out docs/bench_hostile.png

Prints a table; see docs/benchmarks.md for recorded results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.serve_bench import free_port, say, stop, wait_ready

KEYS = {"a": "sk-bench-a", "b": "sk-bench-b"}
CONFIG = """
[model]
path = "{model}"

[server]
secret = "bench-only-secret-0123456789abcdef"

[[tenants]]
name = "a"
api_keys = ["{a}"]

[[tenants]]
name = "b"
api_keys = ["{b}"]
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.hostile_bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="model to serve: tiny (default), default, a folder or hub id")
    p.add_argument("--flood-clients", type=int, default=4, help="tenant A's concurrent clients (default 4)")
    p.add_argument("--flood-max-tokens", type=int, default=400,
                   help="max_tokens of each of A's n=16 requests (default 400)")
    p.add_argument("--samples", type=int, default=15, help="tenant B's TTFT samples per side (default 15)")
    p.add_argument("--health-polls", type=int, default=300, help="/health polls under load (default 300)")
    p.add_argument("--json-out", type=Path, default=None, help="write the figures here as JSON")
    p.add_argument("--plot-out", type=Path, default=None, help="write a PNG plot here (needs matplotlib)")
    return p.parse_args(argv)


class Server:
    """A `kvgate serve` subprocess on a free port with the two-tenant config."""

    def __init__(self, model: str, folder: Path) -> None:
        import subprocess

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = folder / "kvgate.toml"
        config.write_text(CONFIG.format(model=model, **KEYS))
        exe = str(Path(sys.executable).with_name("kvgate"))
        self.log = (folder / "server.log").open("w")
        self.proc = subprocess.Popen([exe, "serve", "--config", str(config), "--port", str(self.port),
                                      "--disk-cache", str(folder / "kv"), "--log-level", "warning"],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=os.environ.copy())
        wait_ready(self.url, self.proc, 600.0, "/ready")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def close(self) -> None:
        stop(self.proc)
        self.log.close()


def _headers(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def huge_prompts(server: Server, model: str) -> dict[str, float]:
    prompt = "ab " * 1_300_000
    baseline = server.rss_mb()
    peak = baseline
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, server.rss_mb())
            time.sleep(0.01)

    times: list[float] = []
    statuses: list[int] = []

    def send() -> None:
        with httpx.Client(base_url=server.url, timeout=120, headers=_headers("a")) as client:
            started = time.perf_counter()
            response = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1})
            times.append(time.perf_counter() - started)
            statuses.append(response.status_code)

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=send) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    time.sleep(2.0)
    done.set()
    sampler.join()
    return {"huge_statuses_400": float(statuses.count(400)), "huge_latency_max_s": max(times),
            "huge_latency_median_s": statistics.median(times), "rss_baseline_mb": baseline,
            "rss_peak_growth_mb": peak - baseline, "rss_after_growth_mb": server.rss_mb() - baseline}


def _ttft(client: httpx.Client, model: str, i: int) -> float:
    body = {"model": model, "prompt": f"tenant b question {i}: what is the answer?", "max_tokens": 4,
            "stream": True}
    started = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        first = None
        for line in response.iter_lines():
            if first is None and line.startswith("data: {") and '"text":' in line:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("stream ended without a token")
    return first


def fairness(server: Server, model: str, args: argparse.Namespace) -> dict[str, float]:
    with httpx.Client(base_url=server.url, timeout=300, headers=_headers("b")) as b:
        _ttft(b, model, -1)
        alone = [_ttft(b, model, i) for i in range(args.samples)]
        stop_flood = threading.Event()
        flood_statuses: list[int] = []

        def flood(k: int) -> None:
            body = {"model": model, "prompt": f"tenant a flood {k}", "n": 16, "ignore_eos": True,
                    "max_tokens": args.flood_max_tokens, "temperature": 1.0}
            with httpx.Client(base_url=server.url, timeout=600, headers=_headers("a")) as a:
                while not stop_flood.is_set():
                    flood_statuses.append(a.post("/v1/completions", json=body).status_code)

        flooders = [threading.Thread(target=flood, args=(k,)) for k in range(args.flood_clients)]
        for thread in flooders:
            thread.start()
        time.sleep(3.0)  # let A's requests fill the running slots and the queue
        loaded = [_ttft(b, model, 1000 + i) for i in range(args.samples)]
        stop_flood.set()
        for thread in flooders:
            thread.join()
    return {"b_ttft_alone_ms": statistics.median(alone) * 1000, "b_ttft_flooded_ms": statistics.median(loaded) * 1000,
            "b_ttft_ratio": statistics.median(loaded) / statistics.median(alone),
            "a_requests_ok": float(flood_statuses.count(200)), "a_requests": float(len(flood_statuses))}


HEALTH_LOADS = {
    # item 5 as reported: 1,000 prompts of 4,000 characters (refused by fan-out), a chat of
    # 130,000 messages (over max_body_bytes: 413)
    "item5": [("/v1/completions", {"prompt": ["lorem ipsum dolor sit amet " * 148] * 1000, "max_tokens": 1}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}] * 130_000, "max_tokens": 1})],
    # the worst body under the default 4 MiB limit: 100,000 tiny JSON objects (parsed, then 400)
    "tiny-objects": [("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}] * 100_000,
                                               "max_tokens": 1})],
    # work that runs: four 4,000-character prompts (~2,500 tokens each) prefilled per request
    "prefill": [("/v1/completions", {"prompt": ["lorem ipsum dolor sit amet " * 148] * 4, "max_tokens": 1})],
}


def health_under_load(server: Server, model: str, polls: int, load_name: str) -> dict[str, float]:
    bodies = [(path, json.dumps({"model": model, **body}).encode()) for path, body in HEALTH_LOADS[load_name]]
    stop_load = threading.Event()
    statuses: list[int] = []

    def load() -> None:
        headers = {**_headers("a"), "Content-Type": "application/json"}
        with httpx.Client(base_url=server.url, timeout=300, headers=headers) as client:
            while not stop_load.is_set():
                for path, body in bodies:
                    statuses.append(client.post(path, content=body).status_code)

    workers = [threading.Thread(target=load) for _ in range(2)]
    for worker in workers:
        worker.start()
    latencies = []
    with httpx.Client(base_url=server.url, timeout=30) as probe:
        time.sleep(1.0)
        for _ in range(polls):
            started = time.perf_counter()
            probe.get("/health")
            latencies.append(time.perf_counter() - started)
            time.sleep(0.02)
    stop_load.set()
    for worker in workers:
        worker.join()
    latencies.sort()
    key = f"health_{load_name}"
    return {f"{key}_p50_ms": latencies[len(latencies) // 2] * 1000,
            f"{key}_p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000,
            f"{key}_max_ms": latencies[-1] * 1000, f"{key}_requests": float(len(statuses)),
            f"{key}_statuses": ",".join(sorted({str(s) for s in statuses}))}


def plot(figures: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    axes[0].bar(["latency max (s)", "RSS peak +GB", "RSS after +GB"],
                [figures["huge_latency_max_s"], figures["rss_peak_growth_mb"] / 1024,
                 figures["rss_after_growth_mb"] / 1024], color=["tab:blue", "tab:orange", "tab:green"])
    axes[0].set_title("8 × 3.9 MB prompts")
    axes[1].bar(["B alone", "B while A floods"], [figures["b_ttft_alone_ms"], figures["b_ttft_flooded_ms"]],
                color=["tab:blue", "tab:red"])
    axes[1].set_title(f"tenant B TTFT ms (×{figures['b_ttft_ratio']:.2f})")
    names = list(HEALTH_LOADS)
    width = 0.25
    for j, stat in enumerate(("p50", "p99", "max")):
        axes[2].bar([i + (j - 1) * width for i in range(len(names))],
                    [figures[f"health_{n}_{stat}_ms"] for n in names], width, label=stat)
    axes[2].set_xticks(range(len(names)), names)
    axes[2].axhline(50, color="grey", linestyle="--")
    axes[2].legend()
    axes[2].set_title("/health ms under load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvgate-hostile-") as tmp:
        for name, step in (("huge prompts", lambda s: huge_prompts(s, args.model)),
                           ("tenant fairness", lambda s: fairness(s, args.model, args)),
                           *((f"/health under {name}", lambda s, name=name: health_under_load(
                               s, args.model, args.health_polls, name)) for name in HEALTH_LOADS)):
            folder = Path(tmp) / name.replace(" ", "_").replace("/", "")
            folder.mkdir()
            say(f"{name}: starting a server")
            server = Server(args.model, folder)
            try:
                say(f"{name}: measuring")
                figures.update(step(server))
            finally:
                server.close()
    print("\n| figure | value |\n|---|---|")
    for key, value in figures.items():
        print(f"| {key} | {value:.3f} |" if isinstance(value, float) else f"| {key} | {value} |")
    if args.json_out:
        args.json_out.write_text(json.dumps(figures, indent=2) + "\n")
    if args.plot_out:
        plot(figures, args.plot_out)
        say(f"plot written to {args.plot_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
