"""KVGate over HTTP against vLLM-CPU (and the in-process plain loop), side by side in one run.

For each run (``--runs``, default 3) and each system, one after the other on the same machine:
start a fresh server on a loopback port, wait for it to be ready, run the shared load client
(``../shared/peers/load.py``: throughput at concurrency 1/4/16 and the 2k prefix-reuse TTFTs),
stop the server. The plain ``model.generate`` loop is measured in process by
``bench.engine_bench --systems plain`` in the same run. Prints one table of medians with ratios,
writes the raw results as JSON and a PNG plot.

    .venv/bin/python -m bench.serve_bench --vllm-python /path/to/vllm-venv/bin/python \\
        --json-out docs/bench_serve.json --plot-out docs/bench_serve.png

Without ``--vllm-python`` only KVGate (and the plain loop) run. ``--interleave`` keeps both servers
up and measures each part on both a minute apart instead. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "peers"
SEED = 20261202  # load.py's default prompt seed; an interleaved run r uses SEED + r on both servers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.serve_bench", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Each system gets a fresh server per run; figures are medians over the runs. Run it on a "
               "quiet machine: anything else on the cores skews every figure.")
    p.add_argument("--runs", type=int, default=3, help="runs per system; the table shows medians (default 3)")
    p.add_argument("--model", default="default",
                   help="KVGate model: 'default' (SmolLM2-135M-Instruct), a folder or hub id (default: default)")
    p.add_argument("--kvgate-args", default="", help="extra arguments for `kvgate serve`, one string")
    p.add_argument("--vllm-python", type=Path, default=None,
                   help="python of a venv with vllm-cpu installed (see ../shared/peers/README.md); "
                        "omit to skip vLLM")
    p.add_argument("--vllm-model-dir", type=Path, default=None,
                   help="float32 model folder for vLLM (default: the folder `kvgate serve` converted, "
                        "<KVGATE_CACHE_DIR>/models/SmolLM2-135M-Instruct)")
    p.add_argument("--vllm-start-timeout", type=float, default=900.0,
                   help="seconds to wait for vLLM to be ready (its first start compiles; default 900)")
    p.add_argument("--no-plain", action="store_true", help="skip the in-process plain generate loop")
    p.add_argument("--load-py", type=Path, default=PEERS / "load.py",
                   help="the shared load client (default: ../shared/peers/load.py)")
    p.add_argument("--conc", default="1,4,16",
                   help="concurrency levels of the throughput part (default 1,4,16; e.g. 1,4,16,32,64). Each "
                        "level sends max(16, the highest level) requests, so every level can fill its slots")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="dtype of both servers (`kvgate serve --dtype`, vLLM's --dtype; default float32)")
    p.add_argument("--interleave", action="store_true",
                   help="start KVGate and vLLM once, side by side, and alternate them part by part (each "
                        "concurrency level, then the 2k prefix part), the first of each pair swapping every "
                        "time, each part run once per --runs with that run's own prompts; the table adds the "
                        "median of the per-pair ratios. For a VM whose speed drifts over minutes: the two "
                        "figures of a pair are taken a minute apart, not ten")
    p.add_argument("--load-args", default="", help="extra arguments for load.py, one string (e.g. '--runs 1')")
    p.add_argument("--json-out", type=Path, default=None, help="write every run's raw results here")
    p.add_argument("--plot-out", type=Path, default=None, help="write a PNG plot here (needs matplotlib)")
    args = p.parse_args(argv)
    try:
        args.conc_list = sorted({int(c) for c in args.conc.split(",") if c.strip()})
    except ValueError:
        p.error("--conc takes comma-separated whole numbers, e.g. 1,4,16,32,64")
    if not args.conc_list or min(args.conc_list) < 1:
        p.error("--conc needs at least one level, each >= 1")
    return args


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def say(message: str) -> None:
    print(f"[serve_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float, path: str) -> None:
    deadline = time.monotonic() + timeout_s
    last = time.monotonic()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + path, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() - last > 30:
            say(f"  still waiting for {url}{path} ...")
            last = time.monotonic()
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout_s:.0f}s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_server(name: str, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start a server in a session of its own (so `stop` and `wait_quiet` reach its children),
    its output to ``log``."""
    say(f"{name}: starting ({log})")
    with log.open("w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)


def served_model(url: str) -> str:
    """The id of the model a server at ``url`` serves (its first)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
        return str(json.load(response)["data"][0]["id"])


def kvgate_command(args: argparse.Namespace, kvgate: str, port: int, disk: Path) -> list[str]:
    """`kvgate serve` on ``port``, with a disk tier in ``disk`` unless --kvgate-args names one (a
    fresh folder, so the seeded prompts start cold)."""
    extra = args.kvgate_args.split()
    if "--disk-cache" not in extra:
        extra += ["--disk-cache", str(disk)]
    return [kvgate, "serve", "--model", args.model, "--dtype", args.dtype, "--port", str(port),
            "--log-level", "warning", *extra]


def run_server(name: str, argv: list[str], env: dict[str, str], model_id: str | None, ready_path: str,
               start_timeout: float, args: argparse.Namespace, port: int, log: Path) -> dict[str, Any]:
    proc = start_server(name, argv, env, log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc, start_timeout, ready_path)
        model_id = model_id or served_model(url)
        say(f"{name}: ready; running the load client")
        return load_client(args, url, model_id, name, ["--conc", ",".join(map(str, args.conc_list))])
    finally:
        stop(proc)


def load_client(args: argparse.Namespace, url: str, model_id: str, label: str, extra: list[str]) -> dict[str, Any]:
    """Run the shared load client against ``url`` and return its JSON report."""
    cmd = [sys.executable, str(args.load_py), "--base-url", url, "--model", model_id, "--label", label,
           "--requests", str(max(16, *args.conc_list)), *extra, *args.load_args.split()]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    for line in result.stdout.splitlines():
        if not line.startswith("JSON "):
            say(f"  {line}")
    return json.loads(next(line for line in result.stdout.splitlines() if line.startswith("JSON "))[5:])


def parts(levels: list[int]) -> list[list[str]]:
    """The load client's arguments for each part of an interleaved run: one per concurrency
    level (the throughput workload alone), then the 2k prefix workload."""
    return [["--workloads", "a", "--conc", str(level)] for level in levels] + [["--workloads", "b"]]


def pair_order(run: int, part: int) -> tuple[str, str]:
    """Which system goes first in a pair: swapped from one pair to the next, so neither is always
    the one measured right after the other's load (or always first on a fresh run)."""
    return ("kvgate", "vllm") if (run + part) % 2 == 0 else ("vllm", "kvgate")


def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's per-part load reports as one report: every throughput row, the prefix part."""
    merged: dict[str, Any] = {"a": []}
    for report in reports:
        merged["a"].extend(report.get("a", []))
        if report.get("b"):
            merged["b"] = report["b"]
    return merged


def ratio(key: str, kvgate: float, vllm: float) -> float:
    """KVGate against vLLM for one figure, > 1 = KVGate better: tok/s over tok/s, vLLM's time over
    KVGate's for a TTFT."""
    return kvgate / vllm if key.startswith("tok_s") else vllm / kvgate


def pair_ratios(kvgate: list[dict[str, float]], vllm: list[dict[str, float]]) -> dict[str, float]:
    """Median over runs of each run's `ratio`, for the keys both runs have."""
    out: dict[str, list[float]] = {}
    for kv, vl in zip(kvgate, vllm, strict=False):
        for key in kv.keys() & vl.keys():
            if kv[key] and vl[key]:
                out.setdefault(key, []).append(ratio(key, kv[key], vl[key]))
    return {key: statistics.median(values) for key, values in out.items()}


def cpu_seconds(pids: list[int]) -> float:
    """CPU time used so far by the processes in the sessions of ``pids`` (their children too)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) in pids:  # the session id (field 6 of stat)
            total += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def wait_quiet(pids: list[int], timeout_s: float = 60.0, window_s: float = 1.0, most: float = 0.05) -> float:
    """Wait until the servers in the sessions of ``pids`` use less than ``most`` of a core over a
    ``window_s`` window (a server writing its cache behind after a load is not idle), at most
    ``timeout_s``; returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        before = cpu_seconds(pids)
        time.sleep(window_s)
        if cpu_seconds(pids) - before < most * window_s:
            return time.monotonic() - t0
    say(f"  the servers still use CPU after {timeout_s:.0f} s; measuring anyway")
    return time.monotonic() - t0


def run_interleaved(args: argparse.Namespace, kvgate: tuple[list[str], int], vllm: tuple[list[str], int],
                    env: dict[str, str], logs: Path) -> dict[str, list[dict[str, Any]]]:
    """Both servers up at once (``(argv, port)`` each); each part of each run measured on both, one
    right after the other."""
    raw: dict[str, list[dict[str, Any]]] = {"kvgate": [], "vllm": []}
    procs: dict[str, subprocess.Popen] = {}
    urls: dict[str, str] = {}
    models: dict[str, str] = {"vllm": "smollm2"}
    try:
        for name, (argv, port), run_env, ready, timeout in (
                ("kvgate", kvgate, dict(os.environ), "/ready", 600.0),
                ("vllm", vllm, env, "/v1/models", args.vllm_start_timeout)):
            procs[name] = start_server(name, argv, run_env, logs / f"{name}_interleaved.log")
            urls[name] = f"http://127.0.0.1:{port}"
            wait_ready(urls[name], procs[name], timeout, ready)
        models["kvgate"] = served_model(urls["kvgate"])
        pids = [proc.pid for proc in procs.values()]
        for run in range(1, args.runs + 1):
            reports: dict[str, list[dict[str, Any]]] = {"kvgate": [], "vllm": []}
            for index, extra in enumerate(parts(args.conc_list)):
                for name in pair_order(run, index):
                    waited = wait_quiet(pids)
                    say(f"run {run}/{args.runs}, {name}: {' '.join(extra)} (after {waited:.0f} s quiet wait)")
                    reports[name].append(load_client(args, urls[name], models[name], name,
                                                     [*extra, "--seed", str(SEED + run)]))
            for name in raw:
                raw[name].append(merge(reports[name]))
    finally:
        for proc in procs.values():
            stop(proc)
    return raw


def vllm_command(args: argparse.Namespace, model_dir: Path, port: int) -> list[str]:
    """../shared/peers/start_vllm.sh for float32; for another dtype the same server command with that
    dtype (the script fixes float32), under the same environment."""
    if args.dtype == "float32":
        return ["bash", str(PEERS / "start_vllm.sh"), str(model_dir), str(port)]
    script = (PEERS / "start_vllm.sh").read_text().replace("--dtype float32", f"--dtype {args.dtype}")
    if f"--dtype {args.dtype}" not in script:
        raise SystemExit("serve_bench: ../shared/peers/start_vllm.sh no longer says --dtype float32; update vllm_command")
    return ["bash", "-c", script, "start_vllm.sh", str(model_dir), str(port)]


def run_plain(model: str, dtype: str = "float32") -> dict[str, Any]:
    """The in-process plain generate loop, via bench.engine_bench (same prompt shapes)."""
    say("plain loop: bench.engine_bench --systems plain")
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"serve_bench_plain_{os.getpid()}.json"
    cmd = [sys.executable, "-m", "bench.engine_bench", "--model", model, "--dtype", dtype, "--systems", "plain",
           "--repeats", "1",
           "--concurrency", "1", "--json-out", str(out)]  # the plain loop serves one request at a time
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    data = json.loads(out.read_text())
    out.unlink()
    return data


def _plain_figures(data: dict[str, Any]) -> dict[str, float]:
    plain = data.get("throughput", {}).get("plain", {})
    out = {f"tok_s_c{level}": row["median_tok_s"] for level, row in plain.items()}
    cold = data.get("ttft", {}).get("plain", {}).get("median_cold_s")
    if cold is not None:
        out["cold_s"] = cold
    return out


def figures(result: dict[str, Any]) -> dict[str, float]:
    out = {f"tok_s_c{a['conc']}": a["tok_s"] for a in result["a"]}
    out.update({f"ttft_p50_c{a['conc']}": a["ttft_p50_s"] for a in result["a"]})
    b = result.get("b", {})
    for key, name in (("cold", "cold_s"), ("suffix_changed", "cached_s"), ("exact_repeat", "repeat_s")):
        if key in b:
            out[name] = b[key]["ttft_median_s"]
    return out


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for row in rows for k in row})
    return {k: statistics.median(row[k] for row in rows if k in row) for k in keys}


def table(results: dict[str, dict[str, float]], levels: list[int] = [1, 4, 16],  # noqa: B006
          pairs: dict[str, float] | None = None) -> str:
    """Medians per system, their ratio and, where given, the median of the per-pair ratios."""
    top = max(levels)
    cols = [*((f"tok_s_c{c}", f"tok/s c={c}") for c in levels),
            (f"ttft_p50_c{top}", f"TTFT p50 c={top} (s)"), ("cold_s", "2k cold (s)"), ("cached_s", "1,984 cached (s)"),
            ("repeat_s", "exact repeat (s)")]
    lines = ["| system | " + " | ".join(c[1] for c in cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, row in results.items():
        cells = [f"{row[k]:.3g}" if k in row else "—" for k, _ in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if "kvgate" in results and "vllm" in results:
        kv, vl = results["kvgate"], results["vllm"]
        cells = []
        for k, _ in cols:
            if k in kv and k in vl and vl[k] and kv[k]:
                cells.append(f"{ratio(k, kv[k], vl[k]):.2f}×")
            else:
                cells.append("—")
        lines.append("| KVGate vs vLLM (>1 = KVGate better) | " + " | ".join(cells) + " |")
    if pairs:
        cells = [f"{pairs[k]:.2f}×" if k in pairs else "—" for k, _ in cols]
        lines.append("| median of the per-pair ratios | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, float]], path: Path, levels: list[int] = [1, 4, 16],  # noqa: B006
         plot_dtype: str = "float32") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(results))
    for i, (name, row) in enumerate(results.items()):
        xs = [j + i * width for j in range(len(levels))]
        ax1.bar(xs, [row.get(f"tok_s_c{c}", 0) for c in levels], width, label=name)
    ax1.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(levels))], [f"c={c}" for c in levels])
    ax1.set_ylabel("output tok/s (higher is better)")
    ax1.set_title(f"throughput over HTTP ({plot_dtype})")
    ax1.legend()
    keys = [("cold_s", "cold"), ("cached_s", "1,984 cached"), ("repeat_s", "exact repeat")]
    for i, (name, row) in enumerate(results.items()):
        xs = [j + i * width for j in range(len(keys))]
        ax2.bar(xs, [row.get(k, 0) for k, _ in keys], width, label=name)
    ax2.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(keys))], [label for _, label in keys])
    ax2.set_yscale("log")
    ax2.set_ylabel("TTFT, s (log; lower is better)")
    ax2.set_title("2,052-token prompt")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.load_py.is_file():
        print(f"serve_bench: error: the load client {args.load_py} does not exist; pass --load-py", file=sys.stderr)
        return 2
    cache_dir = Path(os.environ.get("KVGATE_CACHE_DIR", Path.home() / ".cache" / "kvgate"))
    vllm_dir = args.vllm_model_dir or cache_dir / "models" / "SmolLM2-135M-Instruct"
    if args.vllm_python is not None and not (vllm_dir / "config.json").is_file():
        print(f"serve_bench: error: no float32 model folder at {vllm_dir}; start `kvgate serve` once (it "
              "converts the default model there) or pass --vllm-model-dir", file=sys.stderr)
        return 2
    kvgate = str(Path(sys.executable).with_name("kvgate"))
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "serve_bench_logs"
    logs.mkdir(exist_ok=True)
    raw: dict[str, list[dict[str, Any]]] = {"kvgate": [], "vllm": [], "plain": []}
    import shutil

    if args.interleave:
        if args.vllm_python is None:
            print("serve_bench: error: --interleave alternates KVGate and vLLM; pass --vllm-python", file=sys.stderr)
            return 2
        kv_port, vl_port = free_port(), free_port()
        raw.update(run_interleaved(
            args, (kvgate_command(args, kvgate, kv_port, logs / f"kv_run0_{os.getpid()}"), kv_port),
            (vllm_command(args, vllm_dir, vl_port), vl_port), dict(os.environ, VLLM_PY=str(args.vllm_python)), logs))
        if not args.no_plain:  # in process, once the servers are down
            raw["plain"] = [run_plain(args.model, args.dtype) for _ in range(args.runs)]
    else:
        for run in range(1, args.runs + 1):
            say(f"run {run}/{args.runs}")
            port = free_port()
            raw["kvgate"].append(run_server(
                "kvgate", kvgate_command(args, kvgate, port, logs / f"kv_run{run}_{os.getpid()}"),
                dict(os.environ), None, "/ready", 600, args, port,
                logs / f"kvgate_{run}.log"))
            if args.vllm_python is not None:
                port = free_port()
                env = dict(os.environ, VLLM_PY=str(args.vllm_python))
                raw["vllm"].append(run_server(
                    "vllm", vllm_command(args, vllm_dir, port), env, "smollm2",
                    "/v1/models", args.vllm_start_timeout, args, port, logs / f"vllm_{run}.log"))
            if not args.no_plain:
                raw["plain"].append(run_plain(args.model, args.dtype))
    for folder in logs.glob(f"kv_run*_{os.getpid()}"):
        shutil.rmtree(folder, ignore_errors=True)
    results: dict[str, dict[str, float]] = {}
    if raw["plain"]:
        results["plain loop (in process)"] = medians([_plain_figures(d) for d in raw["plain"]])
    for name in ("kvgate", "vllm"):
        if raw[name]:
            results[name] = medians([figures(r) for r in raw[name]])
    ratios = pair_ratios([figures(r) for r in raw["kvgate"]], [figures(r) for r in raw["vllm"]])
    print(f"medians over {args.runs} run(s); TTFT ratios are vLLM / KVGate\n")
    print(table(results, args.conc_list, ratios if args.interleave else None))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"raw": raw, "medians": results, "pair_ratios": ratios,
                                             "interleaved": args.interleave, "dtype": args.dtype,
                                             "conc": args.conc_list}, indent=1))
    if args.plot_out is not None:
        plot(results, args.plot_out, args.conc_list, args.dtype)
        say(f"plot written to {args.plot_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
