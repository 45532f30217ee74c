"""Admission bench: what `[cache] admit` and `[cache.remote] write` cost and save on the shipped
locust workload (loadtest/), side by side in one run.

For each setting, a fresh `kvgate serve` (loadtest/run.sh: a new disk folder, the same private
redis-server emptied between runs) runs the four workloads (shared system prompt, multi-turn,
document Q&A, unique prompts) with the same users, seed and duration. Per setting it reports,
from `/admin/metrics` before and after the load: bytes written to disk and to Redis per request,
blocks not admitted, the prompt-token hit rate of the whole run and of each tier.

    .venv/bin/python -m bench.admission_bench --json-out docs/bench_admission.json \\
        --plot-out docs/bench_admission.png
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ("always/through", "always/back", "always/selective",
            "second_use/through", "second_use/back", "second_use/selective")
TIERS = ("host", "disk", "remote")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.admission_bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Each setting starts its own server (the model loads each time); a run of "
                                       "the default six settings at 2 minutes each takes about 20 minutes.")
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help="comma-separated ADMIT/WRITE pairs, ADMIT in always|second_use, WRITE in "
                        "through|back|selective (default: all six)")
    p.add_argument("--model", default="default", help="model: default, small, tiny or a folder (default: default)")
    p.add_argument("--users", type=int, default=4, help="locust users (default 4: one per workload)")
    p.add_argument("--run-time", default="2m", help="load per setting, locust syntax (default 2m)")
    p.add_argument("--device-blocks", type=int, default=384,
                   help="device pool in blocks, small so that blocks leave it (default 384)")
    p.add_argument("--host-mb", type=int, default=192,
                   help="host tier in MiB, small so that blocks leave it for disk (default 192)")
    p.add_argument("--redis-url", default=None,
                   help="Redis for the remote tier (default: a private redis-server on a free port; it is "
                        "emptied before every setting, so never name a shared one)")
    p.add_argument("--out", type=Path, default=None, help="keep every run's folder here (default: a temporary one)")
    p.add_argument("--json-out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--plot-out", type=Path, default=None, help="write a PNG plot here")
    args = p.parse_args(argv)
    for pair in args.settings.split(","):
        admit, _, write = pair.partition("/")
        if admit not in ("always", "second_use") or write not in ("through", "back", "selective"):
            p.error(f"--settings: {pair!r} is not ADMIT/WRITE (e.g. second_use/selective)")
    return args


def say(message: str) -> None:
    print(f"[admission_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def config_text(admit: str, write: str, args: argparse.Namespace, redis_url: str) -> str:
    return f"""[cache]
admit = "{admit}"
[cache.device]
num_blocks = {args.device_blocks}
[cache.host]
capacity_mb = {args.host_mb}
[cache.disk]
capacity_mb = 4096
[cache.remote]
url = "{redis_url}"
write = "{write}"
[admin]
api_key = "bench-admin-key"
[[tenants]]
name = "tenant-a"
api_keys = ["sk-bench-a"]
[[tenants]]
name = "tenant-b"
api_keys = ["sk-bench-b"]
"""


def delta(after: dict[str, Any], before: dict[str, Any], *path: str) -> float:
    def get(data: Any) -> float:
        for key in path:
            data = (data or {}).get(key)
        return float(data) if isinstance(data, (int, float)) else 0.0

    return get(after) - get(before)


def measure(folder: Path) -> dict[str, Any]:
    """One setting's figures from what loadtest/run.sh left in ``folder``."""
    summary = json.loads((folder / "summary.json").read_text())
    before = json.loads((folder / "metrics_before.json").read_text())
    after = json.loads((folder / "metrics_after.json").read_text())
    requests = max(1, summary["requests"])
    out: dict[str, Any] = {"requests": summary["requests"], "failures": summary["failures"],
                           "hit_rate": summary["hit_rate"],
                           "tier_hit_rate": {t: r.get("hit_rate") for t, r in summary["tiers"].items()},
                           "not_admitted": delta(after, before, "tiers", "chain", "not_admitted"),
                           "readmitted": delta(after, before, "tiers", "chain", "readmitted")}
    for tier in TIERS:
        out[f"{tier}_bytes_written_per_request"] = delta(after, before, "tiers", tier, "bytes_written") / requests
        out[f"{tier}_hits"] = delta(after, before, "tiers", tier, "hits")
    return out


def run_setting(admit: str, write: str, args: argparse.Namespace, redis_url: str, work: Path) -> dict[str, Any]:
    label = f"{admit}-{write}"
    folder = work / label
    config = work / f"{label}.toml"
    config.write_text(config_text(admit, write, args, redis_url))
    subprocess.run(["redis-cli", "-u", redis_url, "flushall"], check=True, capture_output=True)
    cmd = [str(ROOT / "loadtest" / "run.sh"), "--config", str(config), "--model", args.model,
           "--users", str(args.users), "--spawn-rate", str(args.users), "--run-time", args.run_time,
           "--out", str(folder), "--label", label, "--quiet"]
    say(f"{label}: {' '.join(cmd[1:])}")
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode not in (0, 1) or not (folder / "summary.json").exists():  # 1: some requests failed
        raise SystemExit(f"loadtest/run.sh failed for {label} (status {done.returncode}):\n{done.stderr[-2000:]}")
    figures = measure(folder)
    say(f"{label}: {figures['requests']} requests in {time.monotonic() - t0:.0f} s, hit rate "
        f"{figures['hit_rate'] or 0:.1%}, disk {figures['disk_bytes_written_per_request'] / 2**20:.1f} MiB/request, "
        f"Redis {figures['remote_bytes_written_per_request'] / 2**20:.1f} MiB/request")
    return {"admit": admit, "write": write, **figures}


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| admit | remote write | requests | hit rate | disk MiB written / request | Redis MiB written / request "
          "| not admitted (blocks) | disk hits | Redis hits |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['admit']} | {r['write']} | {r['requests']} | {(r['hit_rate'] or 0):.1%} "
              f"| {r['disk_bytes_written_per_request'] / 2**20:.2f} | {r['remote_bytes_written_per_request'] / 2**20:.2f} "
              f"| {r['not_admitted']:.0f} | {r['disk_hits']:.0f} | {r['remote_hits']:.0f} |")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['admit']}\n{r['write']}" for r in rows]
    x = range(len(rows))
    fig, (ax, hit) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.4
    ax.bar([i - width / 2 for i in x], [r["disk_bytes_written_per_request"] / 2**20 for r in rows], width,
           label="disk", color="#27a")
    ax.bar([i + width / 2 for i in x], [r["remote_bytes_written_per_request"] / 2**20 for r in rows], width,
           label="Redis", color="#a72")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("MiB written per request")
    ax.legend()
    ax.set_title("bytes written below host memory")
    hit.bar(list(x), [(r["hit_rate"] or 0) * 100 for r in rows], color="#2a7")
    hit.set_xticks(list(x), labels, fontsize=8)
    hit.set_ylabel("prompt tokens served from cache, %")
    hit.set_title("hit rate over the run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def start_redis() -> tuple[subprocess.Popen[bytes], str]:
    from bench.tier_bench import start_redis as private_redis

    return private_redis(say)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for tool in ("redis-cli", "curl"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is needed (install redis-tools / curl)")
    proc, redis_url = (None, args.redis_url) if args.redis_url else start_redis()
    work = args.out or Path(tempfile.mkdtemp(prefix="kvgate-admission-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for pair in args.settings.split(","):
            admit, _, write = pair.partition("/")
            rows.append(run_setting(admit, write, args, redis_url, work))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        if args.out is None:
            shutil.rmtree(work, ignore_errors=True)
    print_table(rows)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"args": vars(args) | {"json_out": None, "plot_out": None, "out": None},
                                             "rows": rows}, indent=1, default=str))
    if args.plot_out is not None:
        plot(rows, args.plot_out)
        say(f"plot written to {args.plot_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
