"""What KVGate's detailed metrics cost: TTFT at concurrency 16 with `[engine] metrics` on vs off.

Each run starts two fresh servers one after the other (the order alternates between runs, so a
slow spell on the machine hits both), runs the shared load client against each (throughput
workload at concurrency 16, and the 2k prefix-reuse TTFTs) and stops it. Prints medians and the
on/off ratios; writes the raw results as JSON and a PNG plot. "Off" turns off what the metrics
add on the hot path (per-request TTFT parts, block lives); the plain counters stay on in both.

    .venv/bin/python -m bench.metrics_bench --model default --runs 5 \\
        --json-out docs/bench_metrics.json --plot-out docs/bench_metrics.png

The issue's bar: metrics on costs under 2 % of TTFT at concurrency 16. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.serve_bench import PEERS, figures, free_port, medians, run_server, say

COLUMNS = [("ttft_p50_c16", "TTFT p50 c=16 (s)"), ("tok_s_c16", "tok/s c=16"), ("cold_s", "2k cold (s)"),
           ("cached_s", "1,984 cached (s)"), ("repeat_s", "exact repeat (s)")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.metrics_bench", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="runs per setting; the table shows medians (default 5)")
    p.add_argument("--model", default="default", help="model for `kvgate serve --model` (default: default)")
    p.add_argument("--kvgate-args", default="", help="extra arguments for `kvgate serve`, one string")
    p.add_argument("--load-py", type=Path, default=PEERS / "load.py",
                   help="the shared load client (default ../shared/peers/load.py)")
    p.add_argument("--load-args", default="--workloads a,b --conc 16 --requests 32",
                   help="arguments for load.py, one string (default: '%(default)s')")
    p.add_argument("--json-out", type=Path, default=None, help="write every run's raw results here")
    p.add_argument("--plot-out", type=Path, default=None, help="write a PNG plot here (needs matplotlib)")
    return p.parse_args(argv)


def table(results: dict[str, dict[str, float]]) -> str:
    lines = ["| metrics | " + " | ".join(c[1] for c in COLUMNS) + " |", "|---|" + "---:|" * len(COLUMNS)]
    for name, row in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[k]:.4g}" if k in row else "—" for k, _ in COLUMNS) + " |")
    on, off = results.get("on", {}), results.get("off", {})
    cells = [f"{on[k] / off[k]:.3f}" if on.get(k) and off.get(k) else "—" for k, _ in COLUMNS]
    lines.append("| on / off | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(raw: dict[str, list[dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("ttft_p50_c16", "TTFT p50, c=16"), ("cold_s", "2k cold"), ("cached_s", "1,984 cached")]
    fig, axes = plt.subplots(1, len(keys), figsize=(12, 3.8))
    for ax, (key, title) in zip(axes, keys, strict=True):
        data = [[row[key] for row in raw[name] if key in row] for name in ("on", "off")]
        ax.boxplot(data, tick_labels=["metrics on", "metrics off"])
        ax.set_title(title)
        ax.set_ylabel("seconds (lower is better)")
    fig.suptitle("KVGate: detailed metrics on vs off (each box: one figure per run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.load_py.is_file():
        print(f"metrics_bench: error: the load client {args.load_py} does not exist; pass --load-py",
              file=sys.stderr)
        return 2
    kvgate = str(Path(sys.executable).with_name("kvgate"))
    work = Path(tempfile.mkdtemp(prefix="metrics_bench_"))
    raw: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    full: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    try:
        for run in range(1, args.runs + 1):
            order = ("on", "off") if run % 2 else ("off", "on")
            for setting in order:
                say(f"run {run}/{args.runs}: metrics {setting}")
                config = work / f"{setting}.toml"
                config.write_text(f"[engine]\nmetrics = {'true' if setting == 'on' else 'false'}\n")
                port = free_port()
                argv_ = [kvgate, "serve", "--model", args.model, "--port", str(port), "--log-level", "warning",
                         "--config", str(config), "--disk-cache", str(work / f"kv_{setting}_{run}"),
                         *args.kvgate_args.split()]
                result = run_server(f"metrics-{setting}", argv_, dict(os.environ), None, "/ready", 600, args, port,
                                    work / f"{setting}_{run}.log")
                full[setting].append(result)
                raw[setting].append(figures(result))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = {name: medians(rows) for name, rows in raw.items()}
    print(f"medians over {args.runs} run(s) per setting\n")
    print(table(results))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"raw": full, "figures": raw, "medians": results}, indent=1))
    if args.plot_out is not None:
        plot(raw, args.plot_out)
        say(f"plot written to {args.plot_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
