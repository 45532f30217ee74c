"""Survival benchmark: does a document set larger than device + host come back from the cache,
within one server life, across a stop by SIGTERM to the process group, and across `kill -9`?

Over HTTP against `kvgate serve` (SmolLM2-135M-Instruct float32 by default, default tiers: device
pool, 1 GiB host, disk in a fresh temporary folder), started in a process group of its own as a
service manager would. A set of documents (default 40 of ~1,500 tokens: more than device + host
hold) is asked about once per pass, shuffled, one request at a time (one new token). Per pass:
mean / median / p90 TTFT (the whole request: one token) and the share of prompt tokens served
from the cache. Scenarios (``--scenarios``):

  one-life   passes 1-3 on one server;
  sigterm    pass 1, SIGTERM to the process group (the server drains and flushes), restart,
             passes 2-3;
  kill9      half of pass 1, SIGKILL to the process group, restart, then pass 2 over the
             documents asked before the kill: the share of their cacheable tokens that survived;
  c16        pass 1 over half the documents, then the shared load client at concurrency 16
             (``../shared/peers/load.py``, 64 requests): output tokens/s while the host tier's
             blocks are new (what ``persist = "behind"`` writes in the background).

Each scenario runs once per ``--persist`` setting. The floor for one-life and sigterm: passes
2-3 mean TTFT at most 1/10 of pass 1's.

    .venv/bin/python -m bench.survival_bench --json-out docs/bench_survival.json \\
        --plot-out docs/bench_survival.png
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LOAD_PY = ROOT.parent / "shared" / "peers" / "load.py"
SCENARIOS = ("one-life", "sigterm", "kill9", "c16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.survival_bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Run it on a quiet machine: TTFTs are wall times of real requests.")
    p.add_argument("--model", default="default", help="model for `kvgate serve --model` (default: default)")
    p.add_argument("--docs", type=int, default=40, help="documents in the set (default 40)")
    p.add_argument("--doc-tokens", type=int, default=1500, help="tokens per document (default 1500)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated, from {', '.join(SCENARIOS)} (default: all)")
    p.add_argument("--persist", default="on_evict,behind",
                   help="comma-separated [cache.disk] persist settings (on_evict, behind, idle) to run each "
                        "scenario with; behind:S also sets behind_delay_s = S (behind:0 writes every block "
                        "at once); 'unset' leaves the key out (for a KVGate without it) "
                        "(default: on_evict,behind)")
    p.add_argument("--kvgate", default=None,
                   help="the command that runs KVGate, one string (default: this venv's `kvgate`); e.g. "
                        "'python -m app.cli' with --cwd to measure another checkout side by side")
    p.add_argument("--cwd", type=Path, default=None, help="working folder for --kvgate (default: here)")
    p.add_argument("--seed", type=int, default=0, help="documents and shuffles (default 0)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for /ready (default 600)")
    p.add_argument("--json-out", type=Path, default=None, help="write the results here")
    p.add_argument("--plot-out", type=Path, default=None, help="write a PNG plot here (needs matplotlib)")
    return p.parse_args(argv)


def say(message: str) -> None:
    print(f"[survival] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`kvgate serve` in a process group of its own, on a free port, with a config file."""

    def __init__(self, args: argparse.Namespace, folder: Path, persist: str, label: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = folder / "kvgate.toml"
        config.write_text(server_config(folder / "kv", persist))
        self.log_path = folder / f"server-{label}.log"
        self._log = self.log_path.open("w")
        kvgate = shlex.split(args.kvgate) if args.kvgate else [str(Path(sys.executable).with_name("kvgate"))]
        env = dict(os.environ)
        if args.cwd is not None:  # another checkout: its own packages first
            env["PYTHONPATH"] = str(args.cwd)
        self.proc = subprocess.Popen([*kvgate, "serve", "--model", args.model, "--port", str(self.port),
                                      "--config", str(config)], stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=args.cwd, env=env)
        deadline = time.monotonic() + args.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvgate serve exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2) as response:
                    ready = response.status == 200
                if ready:
                    with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as response:
                        self.model = json.loads(response.read())["data"][0]["id"]
                    return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.signal_group(signal.SIGKILL)
        raise RuntimeError(f"kvgate serve was not ready after {args.start_timeout} s; see {self.log_path}")

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 120.0) -> tuple[int, float]:
        """Signal the whole group; (exit status, seconds until it exited)."""
        t0 = time.monotonic()
        self.signal_group(sig)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
            code = self.proc.wait()
        self._log.close()
        return code, time.monotonic() - t0

    def flushed(self) -> int | None:
        for line in self.log_path.read_text().splitlines():
            if "flushed" in line and "blocks to disk" in line:
                return int(line.split("flushed", 1)[1].split()[0])
        return None


def complete(url: str, model: str, ids: list[int]) -> tuple[float, int, int]:
    """(seconds, prompt tokens, cached tokens) of a one-token greedy completion."""
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        data = json.loads(response.read())
    elapsed = time.perf_counter() - t0
    usage = data["usage"]
    return elapsed, usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def run_pass(server: Server, docs: list[list[int]], order: list[int], question: list[int], label: str) -> dict[str, Any]:
    times, prompt, cached = [], 0, 0
    for n, i in enumerate(order, 1):
        t, p, c = complete(server.url, server.model, docs[i] + question)
        times.append(t)
        prompt += p
        cached += c
        if n % 10 == 0 or n == len(order):
            say(f"  {label}: {n}/{len(order)} documents, mean {statistics.mean(times) * 1000:.0f} ms")
    times.sort()
    return {"mean_s": statistics.mean(times), "median_s": statistics.median(times),
            "p90_s": times[min(len(times) - 1, int(0.9 * len(times)))], "cached_share": cached / prompt,
            "requests": len(times), "tiers": tier_counters(server.url)}


def tier_counters(url: str) -> dict[str, Any]:
    """The chain's and the disk tier's counters after a pass (what explains its figures)."""
    with urllib.request.urlopen(url + "/admin/metrics", timeout=60) as response:
        tiers = json.loads(response.read())["tiers"]
    chain, disk, host = tiers.get("chain", {}), tiers.get("disk", {}), tiers.get("host", {})
    return {**{k: chain.get(k) for k in ("dropped_writes", "recalled_blocks", "persisted_behind", "recompute_chosen",
                                         "prefetched_blocks", "pending_writes", "unpersisted_blocks")},
            "disk_hits": disk.get("hits"), "disk_blocks": disk.get("blocks"), "disk_timeouts": disk.get("timeouts"),
            "disk_writes": disk.get("writes"), "host_kept_unpersisted": host.get("kept_unpersisted")}


def scenario(args: argparse.Namespace, name: str, persist: str, docs: list[list[int]]) -> dict[str, Any]:
    rng = random.Random(f"{args.seed}-{name}-{persist}")
    questions = [[rng.randrange(1000, 20000) for _ in range(12)] for _ in range(4)]
    orders = [rng.sample(range(len(docs)), len(docs)) for _ in range(3)]
    out: dict[str, Any] = {"scenario": name, "persist": persist, "passes": []}
    with tempfile.TemporaryDirectory(prefix="kvgate-survival-") as tmp:
        folder = Path(tmp)
        say(f"{name} (persist = {persist}): starting the server")
        server = Server(args, folder, persist, "first")
        try:
            if name == "kill9":
                half = orders[0][: len(docs) // 2]
                out["passes"].append(run_pass(server, docs, half, questions[0], "pass 1 (half)"))
                code, _ = server.stop(signal.SIGKILL)
                out["exit_code"] = code
                say("  SIGKILL to the group; restarting")
                server = Server(args, folder, persist, "second")
                survived = run_pass(server, docs, half, questions[1], "pass 2 (documents asked before the kill)")
                cacheable = args.doc_tokens // 16 * 16 / (args.doc_tokens + len(questions[1]))
                survived["survived_share"] = survived["cached_share"] / cacheable
                out["passes"].append(survived)
            elif name == "c16":
                some = orders[0][: len(docs) // 2]
                out["passes"].append(run_pass(server, docs, some, questions[0], "pass 1 (half)"))
                out["c16"] = load_c16(server.url, server.model)
                say(f"  concurrency 16: {out['c16']['output_tok_s']:.1f} output tok/s")
            else:
                out["passes"].append(run_pass(server, docs, orders[0], questions[0], "pass 1"))
                if name == "sigterm":
                    code, seconds = server.stop(signal.SIGTERM)
                    out.update(exit_code=code, stop_s=seconds, flushed_blocks=server.flushed())
                    say(f"  SIGTERM to the group: exit {code} after {seconds:.1f} s, "
                        f"{out['flushed_blocks']} blocks flushed; restarting")
                    server = Server(args, folder, persist, "second")
                for p in (1, 2):
                    out["passes"].append(run_pass(server, docs, orders[p], questions[p], f"pass {p + 1}"))
                first, later = out["passes"][0]["mean_s"], [x["mean_s"] for x in out["passes"][1:]]
                out["later_over_first"] = statistics.mean(later) / first
                out["floor_met"] = out["later_over_first"] <= 0.1
        finally:
            if server.proc.poll() is None:
                server.stop(signal.SIGTERM)
    return out


def load_c16(url: str, model: str) -> dict[str, Any]:
    """The shared load client's throughput workload at concurrency 16 (64 requests)."""
    result = subprocess.run([sys.executable, str(LOAD_PY), "--base-url", url, "--model", model, "--workloads", "a",
                             "--conc", "16", "--requests", "64"], capture_output=True, text=True, check=True)
    report = json.loads(next(line[5:] for line in result.stdout.splitlines() if line.startswith("JSON ")))
    row = report["a"][0]
    return {"output_tok_s": row["tok_s"], "ttft_p50_s": row["ttft_p50_s"], "raw": row}


def print_tables(results: list[dict[str, Any]]) -> None:
    print("\n| scenario | persist | pass | mean TTFT | median | p90 | cached share |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        for n, p in enumerate(r["passes"], 1):
            print(f"| {r['scenario']} | {r['persist']} | {n} | {p['mean_s'] * 1000:.0f} ms | "
                  f"{p['median_s'] * 1000:.0f} ms | {p['p90_s'] * 1000:.0f} ms | {p['cached_share']:.1%} |")
    print("\n| scenario | persist | result |")
    print("|---|---|---|")
    for r in results:
        if "later_over_first" in r:
            verdict = "meets" if r["floor_met"] else "MISSES"
            extra = f", flushed {r['flushed_blocks']} blocks in {r['stop_s']:.1f} s" if "stop_s" in r else ""
            print(f"| {r['scenario']} | {r['persist']} | passes 2-3 / pass 1 = {r['later_over_first']:.3f} "
                  f"({verdict} the 1/10 floor){extra} |")
        if r["scenario"] == "kill9":
            print(f"| kill9 | {r['persist']} | {r['passes'][1]['survived_share']:.1%} of the cacheable tokens "
                  f"asked before the kill survived |")
        if "c16" in r:
            print(f"| c16 | {r['persist']} | {r['c16']['output_tok_s']:.1f} output tok/s |")


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in results if r["scenario"] in ("one-life", "sigterm", "kill9")]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(shown))
    for k, r in enumerate(shown):
        xs = [n + k * width for n in range(len(r["passes"]))]
        ax.bar(xs, [p["mean_s"] for p in r["passes"]], width, label=f"{r['scenario']} ({r['persist']})")
    ax.set_xticks([n + 0.4 - width / 2 for n in range(3)], ["pass 1", "pass 2", "pass 3"])
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title("documents larger than device + host: mean TTFT per pass")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_persist(text: str) -> tuple[str, float | None] | None:
    """A --persist setting as (mode, behind_delay_s or None), or None where ``text`` is none: a
    mode (on_evict, behind, idle, unset), or behind:<seconds>."""
    mode, colon, delay = text.partition(":")
    if not colon:
        return (mode, None) if mode in ("on_evict", "behind", "idle", "unset") else None
    try:
        seconds = float(delay)
    except ValueError:
        return None
    return (mode, seconds) if mode == "behind" and seconds >= 0 else None


def server_config(kv_path: Path, persist: str) -> str:
    """The server's config file for a --persist setting (valid: `parse_persist`), its disk tier
    in ``kv_path``."""
    parsed = parse_persist(persist)
    if parsed is None:
        raise ValueError(f"not a --persist setting: {persist!r}")
    mode, delay = parsed
    text = f'[cache.disk]\npath = "{kv_path}"\n'
    if mode != "unset":
        text += f'persist = "{mode}"\n'
    if delay is not None:
        text += f"behind_delay_s = {delay}\n"
    return text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [s for s in args.scenarios.split(",") if s]
    persists = [s for s in args.persist.split(",") if s]
    bad = [s for s in names if s not in SCENARIOS] + [p for p in persists if parse_persist(p) is None]
    if bad:
        print(f"unknown scenario or persist setting: {', '.join(bad)}; scenarios are {', '.join(SCENARIOS)}, "
              "persist settings on_evict, behind, behind:<seconds>, idle and unset", file=sys.stderr)
        return 2
    if "c16" in names and not LOAD_PY.is_file():
        print(f"the c16 scenario needs the shared load client at {LOAD_PY}; drop c16 from --scenarios",
              file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    docs = [[rng.randrange(1000, 20000) for _ in range(args.doc_tokens)] for _ in range(args.docs)]
    results = [scenario(args, name, persist, docs) for persist in persists for name in names]
    print_tables(results)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                             "results": results}, indent=1))
    if args.plot_out is not None:
        plot(results, args.plot_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
