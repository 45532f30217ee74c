"""Router bench (issue 35, item 2): `kvgate route --policy prefix` against `--policy round_robin`
over the same two replicas, on the shipped locust workload, in one run; then the prefix policy
again with one replica SIGKILLed half way through.

Each run starts afresh in a temporary folder (bench/cluster.py): a private redis-server on a free
port, two `kvgate serve` replicas with the same config (secret, tenants, the private Redis as
shared tier, KV events on free ports, a small device pool and host tier so that where a prefix is
warm matters, a disk tier each), then `kvgate route` over them, then locust (loadtest/locustfile.py,
the same users, seed and duration for every run). Reported per workload (scenario): requests,
failures, TTFT p50/p95, the share of prompt tokens served from the KV cache and the share served
from device or host memory (from each response's `usage.prompt_tokens_details.
cached_tokens_per_tier`, summed by the locustfile); per run, from both
replicas' /admin/metrics before and after the load, where the cached tokens came from:

    hit         = Δ prefix_cache.hit_tokens          (prompt tokens found in any tier)
    promoted    = Δ promoted_blocks × block_size     (brought up into the device pool)
    disk, Redis = Δ tiers.<disk|remote>.hits × block_size   (loaded from there, via host memory)
    device      = hit − promoted          host = promoted − disk − Redis
    device+host share = (hit − disk − Redis) / Δ prefix_cache.query_tokens

    .venv/bin/python -m bench.router_bench --json-out docs/bench_router.json --plot-out docs/bench_router.png
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from bench.cluster import (
    TENANT_KEYS,
    Child,
    Cluster,
    complete,
    config_text,
    delta,
    machine,
    metrics,
    router_state,
)

WORKLOADS = ("shared-system", "multi-turn", "document-qa", "unique")
CLASSES = {"shared-system": "SharedSystemPromptUser", "multi-turn": "MultiTurnUser",
           "document-qa": "DocumentQAUser", "unique": "UniquePromptUser"}
RUNS = ("round_robin", "prefix", "prefix_kill")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.router_bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1] + "\nThree runs (round_robin, prefix, prefix "
                                "with a kill) of --run-time each, plus start-up: about 8-10 minutes with the "
                                "defaults. Exit status 1 when a run without a kill had failures, or the kill "
                                "run lost more requests than the killed replica had in flight.")
    p.add_argument("--model", default="default", help="model of both replicas: default, small, tiny or a folder "
                                                      "(default: default)")
    p.add_argument("--run-time", default="2m", help="load per run, locust syntax: 90s, 2m (default 2m)")
    p.add_argument("--users", type=int, default=8,
                   help="locust users, spread evenly over the workloads (default 8: two per workload)")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated locust workloads (default: all of {', '.join(WORKLOADS)})")
    p.add_argument("--tenants", type=int, default=2, choices=(2, 3),
                   help="tenants in the config; locust gives their keys to the users in turn (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's text (default 0)")
    p.add_argument("--device-blocks", type=int, default=256,
                   help="device pool of each replica in blocks, small so that affinity matters (default 256)")
    p.add_argument("--host-mb", type=int, default=64, help="host tier of each replica in MiB (default 64)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per replica ([engine] num_threads; default 1: two replicas, two cores)")
    p.add_argument("--runs", default=",".join(RUNS),
                   help="comma-separated runs, in order (default: round_robin,prefix,prefix_kill; prefix_kill "
                        "is the prefix policy with replica b SIGKILLed half way through)")
    p.add_argument("--skip-kill", action="store_true", help="leave out the prefix_kill run")
    p.add_argument("--keep", type=Path, default=None,
                   help="keep every run's folder (configs, logs, locust CSVs) here instead of a temporary one")
    p.add_argument("--json-out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--plot-out", type=Path, default=None, help="write a PNG plot here (needs matplotlib)")
    args = p.parse_args(argv)
    unknown = [w for w in args.workloads.split(",") if w not in CLASSES]
    if unknown:
        p.error(f"--workloads: unknown {', '.join(unknown)} (known: {', '.join(WORKLOADS)})")
    args.run_list = [r for r in args.runs.split(",") if r and not (args.skip_kill and r == "prefix_kill")]
    if not args.run_list or any(r not in RUNS for r in args.run_list):
        p.error(f"--runs: choose from {', '.join(RUNS)}")
    try:
        args.seconds = seconds(args.run_time)
    except ValueError as exc:
        p.error(str(exc))
    return args


def seconds(text: str) -> int:
    """Locust's duration syntax (``90``, ``90s``, ``2m``, ``1m30s``) in seconds."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s?)?", text.strip())
    if not text.strip() or parts is None:
        raise ValueError(f"--run-time {text!r}: use locust's syntax, e.g. 90s or 2m")
    h, m, s = (int(g or 0) for g in parts.groups())
    if h * 3600 + m * 60 + s <= 0:
        raise ValueError("--run-time must be positive")
    return h * 3600 + m * 60 + s


def say(message: str) -> None:
    print(f"[router_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def sources(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Prompt tokens looked up and where the cached ones came from, between two /admin/metrics
    snapshots of one replica (the formulas of the module docstring)."""
    def d(*path: str) -> float:
        return delta(after, before, *path)

    bs = float(after.get("block_size") or 16)
    hit, promoted = d("prefix_cache", "hit_tokens"), d("promoted_blocks") * bs
    disk, remote = d("tiers", "disk", "hits") * bs, d("tiers", "remote", "hits") * bs
    return {"query_tokens": d("prefix_cache", "query_tokens"), "hit_tokens": hit,
            "device_tokens": max(0.0, hit - promoted), "host_tokens": max(0.0, promoted - disk - remote),
            "disk_tokens": disk, "remote_tokens": remote}


def shares(parts: list[dict[str, float]]) -> dict[str, Any]:
    total = {k: sum(p[k] for p in parts) for k in parts[0]}
    query = total["query_tokens"] or 1.0
    return {**total, "hit_share": total["hit_tokens"] / query,
            "device_host_share": (total["device_tokens"] + total["host_tokens"]) / query,
            **{f"{k[:-7]}_share": total[k] / query for k in ("device_tokens", "host_tokens", "disk_tokens",
                                                               "remote_tokens")}}


def scenarios(folder: Path) -> dict[str, dict[str, Any]]:
    """Per workload, from locust's CSV and the locustfile's token report (loadtest/summary.py)."""
    from loadtest.summary import read_locust_stats, workload_rows

    report = json.loads((folder / "workloads.json").read_text()) if (folder / "workloads.json").exists() else {}
    rows = workload_rows(read_locust_stats(folder / "locust_stats.csv"), report.get("workloads", {}))
    def device_host(r: dict[str, Any]) -> float | None:
        tiers = r.get("tier_tokens") or {}
        near = tiers.get("device", 0) + tiers.get("host", 0)
        return near / r["prompt_tokens"] if r["prompt_tokens"] else None

    return {name: {"requests": r["requests"], "failures": r["failures"], "ttft_p50_ms": r["ttft_p50_ms"],
                   "ttft_p95_ms": r["ttft_p95_ms"], "prompt_tokens": r["prompt_tokens"],
                   "cached_tokens": r["cached_tokens"], "cached_share": r["hit_rate"],
                   "tier_tokens": r.get("tier_tokens") or {}, "device_host_share": device_host(r)}
            for name, r in rows.items()}


def start_locust(cluster: Cluster, router: Child, args: argparse.Namespace, folder: Path) -> Child:
    """loadtest/run.sh's locust command, against the router (run.sh --url cannot: it reads
    /admin/metrics from the URL it loads, which a router does not serve)."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = ",".join(list(TENANT_KEYS.values())[:args.tenants])
    env = {**cluster.env, "KVGATE_KEYS": keys, "KVGATE_SEED": str(args.seed)}
    argv = [sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless", "--host", router.url,
            "--users", str(args.users), "--spawn-rate", str(args.users), "--run-time", f"{args.seconds}s",
            "--stop-timeout", "10", "--csv", str(folder / "locust"), "--kv-report", str(folder / "workloads.json"),
            "--only-summary", *(CLASSES[w] for w in args.workloads.split(","))]
    return cluster.spawn("locust", argv, env)


def run(name: str, args: argparse.Namespace, keep: Path | None) -> dict[str, Any]:
    policy = "prefix" if name.startswith("prefix") else "round_robin"
    kill = name == "prefix_kill"
    with Cluster(f"router-bench-{name}", say, keep / name if keep else None) as cluster:
        redis_url = cluster.start_redis()
        config = cluster.work / "kvgate.toml"
        config.write_text(config_text(args.model, redis_url, device_blocks=args.device_blocks, host_mb=args.host_mb,
                                      threads=args.threads, tenants=args.tenants))
        say(f"{name}: starting replicas a and b ({args.model}, {args.device_blocks} device blocks, "
            f"{args.host_mb} MiB host tier each; logs in {cluster.work})")
        t0 = time.monotonic()
        replicas = [cluster.start_replica(n, config) for n in ("a", "b")]
        router = cluster.start_router(config, replicas, policy)  # it takes replicas in as they come up
        cluster.wait_ready(replicas)
        cluster.wait_ready([router], replicas=2)
        say(f"{name}: replicas and `kvgate route --policy {policy}` ready after {time.monotonic() - t0:.0f} s")
        key = TENANT_KEYS["tenant-a"]
        for target in (*replicas, router):  # first-request costs (and the router's tokenizer) stay out
            complete(target.url, key, {"prompt": "Warm-up request.", "max_tokens": 2})
        before = [metrics(r) for r in replicas]
        state_before = router_state(router)
        locust = start_locust(cluster, router, args, cluster.work / "load")
        say(f"{name}: load for {args.seconds} s: {args.users} users, workloads {args.workloads}, "
            f"{args.tenants} tenants, seed {args.seed}")
        out: dict[str, Any] = {"policy": policy, "kill": None}
        start, next_note = time.monotonic(), 20.0
        at_kill: dict[str, Any] | None = None
        while locust.alive():
            elapsed = time.monotonic() - start
            if kill and at_kill is None and elapsed >= args.seconds / 2:
                at_kill = kill_one(cluster, router, replicas[1], elapsed)
                out["kill"] = {k: v for k, v in at_kill.items() if k != "metrics"}
            if elapsed >= next_note:
                progress(name, router, elapsed, args.seconds)
                next_note += 20
            if elapsed > args.seconds + 120:
                raise RuntimeError(f"locust did not finish:\n{locust.log_tail()}")
            time.sleep(0.2)
        if locust.proc.returncode not in (0, 1):  # 1: some requests failed
            raise RuntimeError(f"locust exited with {locust.proc.returncode}:\n{locust.log_tail()}")
        after = [at_kill["metrics"] if at_kill and r is replicas[1] else metrics(r) for r in replicas]
        state = router_state(router)
        out["scenarios"] = scenarios(cluster.work / "load")
        out["requests"] = sum(s["requests"] for s in out["scenarios"].values())
        out["failures"] = sum(s["failures"] for s in out["scenarios"].values())
        out["tiers"] = shares([sources(b, a) for b, a in zip(before, after, strict=True)])
        out["decisions"] = {k: v - state_before["decisions"].get(k, 0) for k, v in state["decisions"].items()}
        out["replicas"] = [{"name": n, "routed": r["routed"] - rb["routed"], "errors": r["errors"],
                            "broken": r["broken"] - rb["broken"], "healthy": r["healthy"],
                            "index_blocks": r["index_blocks"], "event_batches": r["event_batches"],
                            "gaps": r["gaps"], "resets": r["resets"]}
                           for n, r, rb in zip("ab", state["replicas"], state_before["replicas"], strict=True)]
        if kill:
            assert at_kill is not None
            # the streams it broke off mid-way as the router saw them: the in-flight count of the
            # snapshot misses a request routed between the snapshot and the signal
            out["kill"]["lost_at_most"] = out["replicas"][1]["broken"]
            out["kill"]["retried"] = out["decisions"].get("retried", 0)
        t = out["tiers"]
        say(f"{name}: {out['requests']} requests, {out['failures']} failures; cached {t['hit_share']:.1%} of prompt "
            f"tokens, device+host {t['device_host_share']:.1%} (Redis {t['remote_share']:.1%}, disk "
            f"{t['disk_share']:.1%}); routed a={out['replicas'][0]['routed']} b={out['replicas'][1]['routed']}")
        return out


def kill_one(cluster: Cluster, router: Child, replica: Child, elapsed: float) -> dict[str, Any]:
    """Snapshot the replica (its counters, its requests in flight as the router sees them), SIGKILL it."""
    snapshot = metrics(replica)
    state = router_state(router)
    entry = next(r for r in state["replicas"] if r["url"] == replica.url)
    cluster.kill(replica)
    say(f"replica {replica.name} SIGKILLed at {elapsed:.0f} s with {entry['in_flight']} request(s) in flight on it")
    return {"replica": replica.name, "at_s": round(elapsed, 1), "in_flight": entry["in_flight"],
            "routed_before": entry["routed"], "metrics": snapshot}


def progress(name: str, router: Child, elapsed: float, total: int) -> None:
    try:
        state = router_state(router)
    except OSError:
        return
    routed = " ".join(f"{'ab'[i]}={r['routed']}/{r['in_flight']}{'' if r['healthy'] else ' (down)'}"
                      for i, r in enumerate(state["replicas"]))
    d = state["decisions"]
    say(f"{name}: {elapsed:.0f}/{total} s; routed/in flight {routed}; decisions prefix={d['prefix']} "
        f"load={d['load']} retried={d['retried']}")


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def print_tables(result: dict[str, Any]) -> None:
    runs = result["runs"]
    print("| scenario | policy | requests | failures | prompt tokens cached | from device+host "
          "| TTFT p50 ms | TTFT p95 ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    names = [w for w in WORKLOADS if any(w in r["scenarios"] for r in runs.values())]
    for w in names:
        for run_name, r in runs.items():
            s = r["scenarios"].get(w)
            if s:
                print(f"| {w} | {run_name} | {s['requests']} | {s['failures']} | {pct(s['cached_share'])} "
                      f"| {pct(s.get('device_host_share'))} | {ms(s['ttft_p50_ms'])} | {ms(s['ttft_p95_ms'])} |")
    print()
    print("| run | requests | failures | cached | device+host | device | host | disk | Redis "
          "| routed a / b | decisions prefix / load |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for run_name, r in runs.items():
        t, d = r["tiers"], r["decisions"]
        print(f"| {run_name} | {r['requests']} | {r['failures']} | {pct(t['hit_share'])} "
              f"| **{pct(t['device_host_share'])}** | {pct(t['device_share'])} | {pct(t['host_share'])} "
              f"| {pct(t['disk_share'])} | {pct(t['remote_share'])} "
              f"| {r['replicas'][0]['routed']} / {r['replicas'][1]['routed']} | {d['prefix']} / {d['load']} |")
    kill = (runs.get("prefix_kill") or {}).get("kill")
    if kill:
        print(f"\nprefix_kill: replica {kill['replica']} SIGKILLed at {kill['at_s']:.0f} s with {kill['in_flight']} "
              f"request(s) in flight on it; it broke off {kill['lost_at_most']} stream(s); "
              f"{runs['prefix_kill']['failures']} request(s) failed, "
              f"{kill['retried']} retried on the other replica.")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    names = [w for w in WORKLOADS if any(w in r["scenarios"] for r in runs.values())]
    colors = {"round_robin": "#a72", "prefix": "#27a", "prefix_kill": "#7ab"}
    fig, (hit, ttft) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(runs)
    groups = [*names, "all: device+host"]
    for i, (run_name, r) in enumerate(runs.items()):
        x = [g + (i - (len(runs) - 1) / 2) * width for g in range(len(groups))]
        values = [100 * (r["scenarios"].get(w, {}).get("cached_share") or 0) for w in names]
        near = [100 * (r["scenarios"].get(w, {}).get("device_host_share") or 0) for w in names]
        bars = hit.bar(x, [*values, 100 * r["tiers"]["device_host_share"]], width, label=run_name,
                       color=colors.get(run_name), alpha=0.45)
        hit.bar(x[:-1], near, width, color=colors.get(run_name), label=f"{run_name}: device+host")
        hit.bar_label(bars, fmt="%.0f", fontsize=7)
        p50 = [r["scenarios"].get(w, {}).get("ttft_p50_ms") or 0 for w in names]
        p95 = [r["scenarios"].get(w, {}).get("ttft_p95_ms") or 0 for w in names]
        bars = ttft.bar(x[:-1], p50, width, label=f"{run_name} p50", color=colors.get(run_name))
        ttft.bar_label(bars, fmt="%.0f", fontsize=7)
        ttft.scatter(x[:-1], p95, marker="_", s=200, color="black", zorder=3, label="p95" if i == 0 else None)
    hit.set_xticks(range(len(groups)), groups, rotation=12)
    hit.set_ylabel("prompt tokens from cache, %")
    hit.set_ylim(0, 105)
    hit.set_title("Cached (light) and device+host (dark) share per scenario; device+host of the run")
    ttft.set_xticks(range(len(names)), names, rotation=12)
    ttft.set_ylabel("TTFT, ms")
    ttft.set_title("TTFT p50 (bars) and p95 (marks) per scenario")
    for ax in (hit, ttft):
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"kvgate route over two replicas ({result['args']['model']}, {result['args']['run_time']} per run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {"machine": machine(), "args": {k: str(v) if isinstance(v, Path) else v
                                                              for k, v in vars(args).items()},
                              "workloads": args.workloads.split(","), "runs": {}}
    for name in args.run_list:
        result["runs"][name] = run(name, args, args.keep)
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    print_tables(result)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")
        say(f"results written to {args.json_out}")
    if args.plot_out is not None:
        plot(result, args.plot_out)
        say(f"plot written to {args.plot_out}")
    runs = result["runs"]
    clean = all(r["failures"] == 0 for n, r in runs.items() if n != "prefix_kill")
    kill = runs.get("prefix_kill")
    return 0 if clean and (kill is None or kill["failures"] <= kill["kill"]["lost_at_most"]) else 1


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        say("interrupted: every process it started is stopped, its folders removed")
        raise SystemExit(130) from None
