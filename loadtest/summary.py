"""Helpers of loadtest/run.sh: tenant keys from a config, metrics snapshots, the run's summary and plot.

    python loadtest/summary.py keys CONFIG tenants|admin       # print keys read from a kvgate TOML
    python loadtest/summary.py warmup URL [--key K]              # one short request before the load
    python loadtest/summary.py snapshot URL OUT [--admin-key K]  # save /admin/metrics as JSON
    python loadtest/summary.py report DIR [--label NAME]        # DIR/summary.{json,md,png}
    python loadtest/summary.py compare DIR DIR... --json F --png F  # several runs side by side

`report` reads what run.sh leaves in DIR: `locust_stats.csv` (locust's `--csv DIR/locust`),
`workloads.json` (the locustfile's `--kv-report`), `metrics_before.json` / `metrics_after.json`
(`/admin/metrics` before and after the load) and `run.json` (the run's parameters). It needs
only the standard library, except the plot (matplotlib).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

WORKLOAD_ORDER = ("shared-system", "multi-turn", "document-qa", "unique")
TIER_ORDER = ("device", "host", "disk", "remote")


# ---------------------------------------------------------------------------------------------
# keys, snapshot


def config_keys(path: Path, which: str) -> str:
    """The first API key of each `[[tenants]]` (comma-separated), or the `[admin] api_key`."""
    config = tomllib.loads(path.read_text())
    if which == "admin":
        return str(config.get("admin", {}).get("api_key") or "")
    return ",".join(str(t["api_keys"][0]) for t in config.get("tenants", []) if t.get("api_keys"))


def call(url: str, path: str, key: str = "", body: dict[str, Any] | None = None,
         timeout_s: float = 60.0) -> dict[str, Any]:
    """GET (or POST `body` to) `<url><path>` with an optional bearer key; the JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data)
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.load(response)


def fetch_metrics(url: str, admin_key: str = "") -> dict[str, Any]:
    """`GET <url>/admin/metrics` as a dict."""
    return call(url, "/admin/metrics", admin_key)


def warm_up(url: str, key: str = "") -> None:
    """One short completion, so that first-request costs (lazy initialisation) stay out of the run."""
    model = call(url, "/v1/models", key)["data"][0]["id"]
    call(url, "/v1/completions", key, {"model": model, "prompt": "Warm-up request.", "max_tokens": 2})


# ---------------------------------------------------------------------------------------------
# report


def _number(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def read_locust_stats(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def workload_rows(stats: list[dict[str, str]], tallies: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per workload: requests, failures, requests/s, TTFT and end-to-end p50/p95 (ms), hit rate."""
    rows: dict[str, dict[str, Any]] = {}
    by_key = {(r["Type"], r["Name"]): r for r in stats}
    names = [n for n in WORKLOAD_ORDER if ("POST", n) in by_key]
    names += sorted(n for (kind, n) in by_key if kind == "POST" and n not in names)
    for name in names:
        post, ttft = by_key[("POST", name)], by_key.get(("TTFT", name), {})
        tally = tallies.get(name, {})
        count = int(post["Request Count"])
        rows[name] = {
            "requests": count,
            "failures": int(post["Failure Count"]),
            "requests_per_s": _number(post["Requests/s"]) or 0.0,
            "ttft_p50_ms": _number(ttft.get("50%", "")),
            "ttft_p95_ms": _number(ttft.get("95%", "")),
            "e2e_p50_ms": _number(post["50%"]),
            "e2e_p95_ms": _number(post["95%"]),
            "prompt_tokens": tally.get("prompt_tokens", 0),
            "cached_tokens": tally.get("cached_tokens", 0),
            "hit_rate": tally.get("hit_rate"),
            "tier_tokens": tally.get("tier_tokens") or {},
        }
    return rows


def _delta(after: dict[str, Any], before: dict[str, Any], *path: str) -> float:
    def get(data: dict[str, Any]) -> float:
        for key in path:
            data = data.get(key) or {}
        return float(data) if isinstance(data, (int, float)) else 0.0

    return get(after) - get(before)


def tier_rows(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Hit rates during the run: the device's in prompt tokens, each lower tier's in block lookups."""
    hit = _delta(after, before, "prefix_cache", "hit_tokens")
    query = _delta(after, before, "prefix_cache", "query_tokens")
    rows: dict[str, dict[str, Any]] = {
        "device": {"unit": "tokens", "hits": hit, "lookups": query, "hit_rate": hit / query if query else None},
    }
    for tier in TIER_ORDER[1:]:
        if tier not in (after.get("tiers") or {}):
            continue
        hits = _delta(after, before, "tiers", tier, "hits")
        misses = _delta(after, before, "tiers", tier, "misses")
        rows[tier] = {"unit": "blocks", "hits": hits, "lookups": hits + misses,
                      "hit_rate": hits / (hits + misses) if hits + misses else None}
    return rows


def build_summary(folder: Path, label: str | None = None) -> dict[str, Any]:
    """Everything the run left in `folder`, reduced to one dict (written as summary.json)."""
    run = json.loads((folder / "run.json").read_text()) if (folder / "run.json").exists() else {}
    stats = read_locust_stats(folder / "locust_stats.csv")
    report = json.loads((folder / "workloads.json").read_text()) if (folder / "workloads.json").exists() else {}
    before = _load_json(folder / "metrics_before.json")
    after = _load_json(folder / "metrics_after.json")
    workloads = workload_rows(stats, report.get("workloads", {}))
    requests = sum(r["requests"] for r in workloads.values())
    total = report.get("total", {})
    return {
        "label": label or run.get("label") or folder.name,
        "run": run,
        "requests": requests,
        "failures": sum(int(r["Failure Count"]) for r in stats if r["Name"] != "Aggregated"),
        "requests_per_s": sum(r["requests_per_s"] for r in workloads.values()),
        "hit_rate": total.get("hit_rate"),
        "workloads": workloads,
        "tiers": tier_rows(before, after) if after else {},
    }


def _load_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def summary_markdown(summary: dict[str, Any]) -> str:
    run = summary["run"]
    lines = [f"# Load run: {summary['label']}", ""]
    if run:
        lines += [f"{run.get('users')} users, spawn rate {run.get('spawn_rate')}/s, {run.get('run_time')}, "
                  f"model `{run.get('model') or 'from config'}`, config `{run.get('config') or '-'}`, "
                  f"workloads {run.get('workloads') or 'all'}", ""]
    lines += [f"**{summary['requests']} requests, {summary['requests_per_s']:.2f} req/s, "
              f"{summary['failures']} failures; prompt tokens served from cache: {_pct(summary['hit_rate'])}**", "",
              "| workload | requests | failures | req/s | TTFT p50 ms | TTFT p95 ms | e2e p50 ms | e2e p95 ms "
              "| prompt tokens | cached | hit rate |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in summary["workloads"].items():
        lines.append(f"| {name} | {r['requests']} | {r['failures']} | {r['requests_per_s']:.2f} "
                     f"| {_ms(r['ttft_p50_ms'])} | {_ms(r['ttft_p95_ms'])} | {_ms(r['e2e_p50_ms'])} "
                     f"| {_ms(r['e2e_p95_ms'])} | {r['prompt_tokens']:,} | {r['cached_tokens']:,} "
                     f"| {_pct(r['hit_rate'])} |")
    if summary["tiers"]:
        lines += ["", "| tier | hits | lookups | hit rate |", "|---|---:|---:|---:|"]
        for tier, t in summary["tiers"].items():
            lines.append(f"| {tier} ({t['unit']}) | {t['hits']:,.0f} | {t['lookups']:,.0f} | {_pct(t['hit_rate'])} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# plots


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grouped_bars(ax: Any, groups: list[str], series: dict[str, list[float]], colors: list[str]) -> None:
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        offsets = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(offsets, values, width, label=name, color=colors[i % len(colors)])
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=15)


COLORS = ["#27a", "#a72", "#2a7", "#a27", "#777"]


def plot_runs(summaries: list[dict[str, Any]], out: Path) -> None:
    """Hit rate and TTFT p50/p95 per workload, one bar per run; plus tier hit rates."""
    plt = _pyplot()
    names = [n for n in WORKLOAD_ORDER if any(n in s["workloads"] for s in summaries)]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))

    def values(summary: dict[str, Any], key: str, scale: float = 1.0) -> list[float]:
        return [(summary["workloads"].get(n, {}).get(key) or 0.0) * scale for n in names]

    _grouped_bars(axes[0], names, {s["label"]: values(s, "hit_rate", 100) for s in summaries}, COLORS)
    axes[0].set_ylabel("prompt tokens cached, %")
    axes[0].set_ylim(0, 100)
    axes[0].set_title("Hit rate per workload (usage.cached_tokens)")
    series = {}
    for s in summaries:
        series[f"{s['label']} p50"] = values(s, "ttft_p50_ms")
        series[f"{s['label']} p95"] = values(s, "ttft_p95_ms")
    _grouped_bars(axes[1], names, series, ["#27a", "#9bd", "#a72", "#dba", "#2a7", "#9d9"])
    axes[1].set_ylabel("TTFT, ms")
    axes[1].set_title("TTFT p50 / p95 per workload")
    tiers = [t for t in TIER_ORDER if any(t in s["tiers"] for s in summaries)]
    _grouped_bars(axes[2], tiers, {s["label"]: [((s["tiers"].get(t) or {}).get("hit_rate") or 0.0) * 100
                                                  for t in tiers] for s in summaries}, COLORS)
    axes[2].set_ylabel("hit rate, %")
    axes[2].set_ylim(0, 100)
    axes[2].set_title("Per tier (device: tokens; others: block lookups)")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# compare


def compare_markdown(summaries: list[dict[str, Any]]) -> str:
    """One row per (workload, run): hit rate and TTFT p50/p95, for docs/benchmarks.md."""
    lines = ["| workload | run | requests | hit rate | TTFT p50 ms | TTFT p95 ms |", "|---|---|---:|---:|---:|---:|"]
    names = [n for n in WORKLOAD_ORDER if any(n in s["workloads"] for s in summaries)]
    for name in names:
        for s in summaries:
            r = s["workloads"].get(name)
            if r:
                lines.append(f"| {name} | {s['label']} | {r['requests']} | {_pct(r['hit_rate'])} "
                             f"| {_ms(r['ttft_p50_ms'])} | {_ms(r['ttft_p95_ms'])} |")
    lines += ["", "| run | requests | req/s | failures | all prompt tokens cached | "
              + " | ".join(f"{t} hit rate" for t in TIER_ORDER) + " |",
              "|---|---:|---:|---:|---:|" + "---:|" * len(TIER_ORDER)]
    for s in summaries:
        tiers = " | ".join(_pct((s["tiers"].get(t) or {}).get("hit_rate")) if t in s["tiers"] else "off"
                           for t in TIER_ORDER)
        lines.append(f"| {s['label']} | {s['requests']} | {s['requests_per_s']:.2f} | {s['failures']} "
                     f"| {_pct(s['hit_rate'])} | {tiers} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    keys = sub.add_parser("keys", help="print tenant keys (first of each tenant, comma-separated) or the admin key")
    keys.add_argument("config", type=Path)
    keys.add_argument("which", choices=["tenants", "admin"])
    warm = sub.add_parser("warmup", help="send one short completion (first-request costs stay out of the run)")
    warm.add_argument("url")
    warm.add_argument("--key", default="")
    snap = sub.add_parser("snapshot", help="save GET /admin/metrics as JSON")
    snap.add_argument("url")
    snap.add_argument("out", type=Path)
    snap.add_argument("--admin-key", default="")
    report = sub.add_parser("report", help="summary.json, summary.md and summary.png of one run folder")
    report.add_argument("folder", type=Path)
    report.add_argument("--label", default=None)
    compare = sub.add_parser("compare", help="several run folders side by side: a markdown table, JSON, PNG")
    compare.add_argument("folders", type=Path, nargs="+")
    compare.add_argument("--labels", default="", help="comma-separated names (default: each run's label)")
    compare.add_argument("--json", type=Path, default=None, help="write the runs' summaries here")
    compare.add_argument("--png", type=Path, default=None, help="write the plot here")
    args = parser.parse_args(argv)

    if args.command == "keys":
        print(config_keys(args.config, args.which))
    elif args.command == "warmup":
        warm_up(args.url, args.key)
    elif args.command == "snapshot":
        try:
            metrics = fetch_metrics(args.url, args.admin_key)
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise
            # a server without /admin/metrics (`kvgate route`, another OpenAI server): the run goes
            # on, and its summary has no per-tier figures
            print(f"summary: {args.url} has no /admin/metrics (404); the summary leaves out the cache tiers",
                  file=sys.stderr)
            return 0
        args.out.write_text(json.dumps(metrics, indent=1) + "\n")
    elif args.command == "report":
        summary = build_summary(args.folder, args.label)
        (args.folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        text = summary_markdown(summary)
        (args.folder / "summary.md").write_text(text)
        plot_runs([summary], args.folder / "summary.png")
        print(text, end="")
    else:
        labels = [x for x in args.labels.split(",") if x]
        summaries = [build_summary(f, labels[i] if i < len(labels) else None) for i, f in enumerate(args.folders)]
        if args.json:
            args.json.write_text(json.dumps({"runs": summaries}, indent=2) + "\n")
        if args.png:
            plot_runs(summaries, args.png)
        print(compare_markdown(summaries), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
