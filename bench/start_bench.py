"""How long `kvgate serve` takes to start: to listening, to /ready, to a first completion.

For each model (``--models``, default ``tiny,default``) and each run (``--runs``, default 5), a
fresh `kvgate serve --disk-cache off` on a free loopback port; the time from exec to the port
answering, to ``/ready`` answering 200 and to the first token of a one-token completion, and from
the server's log the engine's own steps (``loading weights`` and ``engine ready``). With
``--against REF`` the same runs start the server of another commit too (a temporary
``git worktree`` of REF, run by this venv's Python), alternating, so both are measured side by
side on the same machine in the same minutes. Prints a table of medians, writes JSON and a PNG.

    .venv/bin/python -m bench.start_bench --against 4da6336 --json-out docs/bench_start.json \\
        --plot-out docs/bench_start.png
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.cluster import free_port

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("listening_s", "ready_s", "first_token_s")
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.start_bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Run it on a quiet machine: a start is mostly imports and loading, "
                                       "which anything else on the cores slows down.")
    p.add_argument("--models", default="tiny,default",
                   help="comma-separated models to start: aliases (tiny, default) or folders (default: tiny,default)")
    p.add_argument("--runs", type=int, default=5, help="starts per model and tree; the table shows medians (default 5)")
    p.add_argument("--against", metavar="REF", default=None,
                   help="also start the server of this git commit (a temporary worktree), alternating with this tree")
    p.add_argument("--kvgate-args", default="", help="extra arguments for `kvgate serve`, one string")
    p.add_argument("--timeout-s", type=float, default=300.0, help="give up on a start after this long (default 300)")
    p.add_argument("--json-out", type=Path, default=None, help="write every run's figures as JSON here")
    p.add_argument("--plot-out", type=Path, default=None, help="write a PNG of the medians here (needs matplotlib)")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    return args


def say(message: str) -> None:
    print(f"[start_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _answers(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return None


def _complete(url: str, model: str) -> None:
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        json.load(response)


def _log_times(log: str) -> dict[str, float]:
    """Wall-clock times of the engine's steps, read from the server's log lines."""
    found: dict[str, float] = {}
    for line in log.splitlines():
        stamp = _LOG_TIME.match(line)
        if stamp is None:
            continue
        when = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if "loading weights" in line:
            found.setdefault("weights_at", when)
        elif "engine ready" in line and "engine_ready_at" not in found:
            found["engine_ready_at"] = when
    return found


def start_once(tree: Path, model: str, extra: list[str], timeout_s: float, log_path: Path) -> dict[str, float]:
    """One start of the server in ``tree``: seconds from exec to each phase."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "app.cli", "serve", "--model", model, "--port", str(port),
            "--disk-cache", "off", *extra]
    with log_path.open("w") as out:
        t0 = time.time()
        proc = subprocess.Popen(argv, cwd=tree, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    figures: dict[str, float] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while "ready_s" not in figures:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} before it was ready; see {log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s; see {log_path}")
            status = _answers(url + "/ready")
            if status is not None:
                figures.setdefault("listening_s", time.time() - t0)
            if status == 200:
                figures["ready_s"] = time.time() - t0
            else:
                time.sleep(0.05)
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
            served = json.load(response)["data"][0]["id"]
        _complete(url, served)
        figures["first_token_s"] = time.time() - t0
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    steps = _log_times(log_path.read_text(errors="replace"))
    if "weights_at" in steps:
        figures["weights_s"] = steps["weights_at"] - t0
    if "engine_ready_at" in steps:
        figures["engine_ready_s"] = steps["engine_ready_at"] - t0
    return figures


def _worktree(ref: str, parent: Path) -> Path:
    folder = parent / "against"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), ref],
                   check=True, capture_output=True, text=True)
    return folder


def run(args: argparse.Namespace) -> dict[str, Any]:
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    extra = args.kvgate_args.split()
    scratch = Path(tempfile.mkdtemp(prefix="kvgate-start-bench-"))
    trees = {"this": ROOT}
    try:
        if args.against:
            trees[args.against] = _worktree(args.against, scratch)
        raw: dict[str, dict[str, list[dict[str, float]]]] = {m: {name: [] for name in trees} for m in models}
        for model in models:
            for r in range(args.runs):
                order = list(trees) if r % 2 == 0 else list(reversed(trees))  # alternate who starts first
                for name in order:
                    log = scratch / f"{model.replace('/', '_')}-{name}-{r}.log"
                    figures = start_once(trees[name], model, extra, args.timeout_s, log)
                    raw[model][name].append(figures)
                    say(f"{model} {name} run {r + 1}/{args.runs}: ready {figures['ready_s']:.2f} s, "
                        f"first token {figures['first_token_s']:.2f} s")
    finally:
        if args.against:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(scratch / "against")],
                           capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    medians = {model: {name: {key: statistics.median(run[key] for run in runs if key in run)
                              for key in (*PHASES, "weights_s", "engine_ready_s") if any(key in run for run in runs)}
                       for name, runs in by_tree.items()} for model, by_tree in raw.items()}
    return {"models": models, "runs": args.runs, "against": args.against, "raw": raw, "medians": medians}


def table(result: dict[str, Any]) -> str:
    trees = ["this"] + ([result["against"]] if result["against"] else [])
    lines = ["| model | tree | listening | weights loading | engine ready | /ready | first token |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for model in result["models"]:
        for name in trees:
            m = result["medians"][model][name]
            cells = " | ".join(f"{m[key]:.2f} s" if key in m else "-" for key in
                               ("listening_s", "weights_s", "engine_ready_s", "ready_s", "first_token_s"))
            lines.append(f"| {model} | {name} | {cells} |")
        if result["against"]:
            this, other = result["medians"][model]["this"], result["medians"][model][result["against"]]
            lines.append(f"| {model} | this / {result['against']} | | | | "
                         f"{this['ready_s'] / other['ready_s']:.2f}× | "
                         f"{this['first_token_s'] / other['first_token_s']:.2f}× |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trees = ["this"] + ([result["against"]] if result["against"] else [])
    fig, axes = plt.subplots(1, len(result["models"]), figsize=(5 * len(result["models"]), 4), squeeze=False)
    for ax, model in zip(axes[0], result["models"], strict=True):
        width = 0.8 / len(trees)
        for i, name in enumerate(trees):
            m = result["medians"][model][name]
            ax.bar([x + i * width for x in range(len(PHASES))], [m[p] for p in PHASES], width, label=name)
        ax.set_xticks([x + width * (len(trees) - 1) / 2 for x in range(len(PHASES))],
                      ["listening", "/ready", "first token"])
        ax.set_ylabel("seconds from exec (median)")
        ax.set_title(f"kvgate serve --model {model}")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or ""
        print(f"start_bench: {exc} {detail}".strip(), file=sys.stderr)
        return 1
    print(table(result))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=2))
    if args.plot_out:
        plot(result, args.plot_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
