"""P/D bench (issue 35, item 3): TTFT and inter-token latency of streamed chats while long
prefills run, a Disaggregated-Pipeline (one prefill and one decode replica) against two mixed
replicas, both behind `kvgate route`.

Each setup starts afresh in a temporary folder (bench/cluster.py): a private redis-server on a free
port, two `kvgate serve` replicas with the same config but `[server] role` ("prefill" + "decode",
or "both" twice), then `kvgate route --policy prefix` over them. One asyncio client (httpx) then
runs, for the same duration and seed in both setups:

    chat clients (--chats, 4)      /v1/chat/completions, streamed: a ~100-token user message,
                                   --chat-tokens (64) tokens out, greedy, EOS ignored, again and again
    document clients (--docs, 2)   /v1/completions, streamed: --doc-tokens (2,000) token ids that
                                   no other prompt shares, 4 tokens out, again and again

Every request's prompt is fixed by (seed, client, iteration), so both setups send the same chats in
the same order. Reported per setup: chat TTFT p50/p95 (send → first token chunk), inter-token
latency p50/p95/p99 (the gap between consecutive token chunks of one stream), chat output
tokens/s (all chat tokens / the load's wall time), documents done and their TTFT, failures; and
whether every chat both setups completed came out identical.

    .venv/bin/python -m bench.pd_bench --json-out docs/bench_pd.json --plot-out docs/bench_pd.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.cluster import (
    TENANT_KEYS,
    Child,
    Cluster,
    complete,
    config_text,
    delta,
    get_json,
    machine,
    metrics,
    router_state,
)

SETUPS = {"disaggregated": ("prefill", "decode"), "mixed": ("both", "both")}
WORDS = """the of and to in is you that it he was for on are as with his they at be this have from or one had
by word but not what all were we when your can said there use an each which she do how their if will up other
about out many then them these so some her would make like him into time has look two more write go see number
no way could people my than first water been call who oil its now find long down day did get come made may
part over new sound take only little work know place year live me back give most very after thing our just name
good sentence man think say great where help through much before line right too mean old any same tell boy
follow came want show also around form three small set put end does another well large must big even such
because turn here why ask went men read need land different home us move try kind hand picture again change
off play spell air away animal house point page letter mother answer found study still learn should world""".split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.pd_bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1] + "\nTwo setups of --duration each, plus "
                                "start-up: about 4-5 minutes with the defaults. Exit status 1 when a request "
                                "failed or a chat's output differed between the setups.")
    p.add_argument("--model", default="default", help="model of both replicas: default, small, tiny or a folder "
                                                      "(default: default)")
    p.add_argument("--duration", type=float, default=90.0, help="seconds of load per setup (default 90)")
    p.add_argument("--chats", type=int, default=4, help="concurrent chat streams (default 4)")
    p.add_argument("--chat-words", type=int, default=75,
                   help="words of each chat message, about 100 tokens with the chat template (default 75)")
    p.add_argument("--chat-tokens", type=int, default=64, help="tokens each chat streams back (default 64)")
    p.add_argument("--docs", type=int, default=2, help="concurrent document clients (default 2; 0: none)")
    p.add_argument("--doc-tokens", type=int, default=2000, help="prompt tokens of each document (default 2000)")
    p.add_argument("--doc-max-tokens", type=int, default=4, help="tokens each document request asks (default 4)")
    p.add_argument("--setups", default=",".join(SETUPS),
                   help=f"comma-separated setups to run, in order (default: {','.join(SETUPS)})")
    p.add_argument("--seed", type=int, default=0, help="seed of every prompt (default 0)")
    p.add_argument("--device-blocks", type=int, default=1024, help="device pool of each replica in blocks "
                                                                   "(default 1024)")
    p.add_argument("--host-mb", type=int, default=256, help="host tier of each replica in MiB (default 256)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per replica ([engine] num_threads; default 1: two replicas, two cores)")
    p.add_argument("--keep", type=Path, default=None,
                   help="keep each setup's folder (configs, logs) here instead of a temporary one")
    p.add_argument("--json-out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--plot-out", type=Path, default=None, help="write a PNG plot here (needs matplotlib)")
    args = p.parse_args(argv)
    args.setup_list = [s for s in args.setups.split(",") if s]
    if not args.setup_list or any(s not in SETUPS for s in args.setup_list):
        p.error(f"--setups: choose from {', '.join(SETUPS)}")
    if args.chats < 1 or args.duration <= 0 or args.docs < 0:
        p.error("--chats must be >= 1, --docs >= 0 and --duration > 0")
    return args


def say(message: str) -> None:
    print(f"[pd_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def chat_message(seed: int, client: int, turn: int, words: int) -> str:
    rng = random.Random(f"{seed}:chat:{client}:{turn}")
    return f"Chat {client}.{turn}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def doc_ids(seed: int, client: int, turn: int, tokens: int) -> list[int]:
    rng = random.Random(f"{seed}:doc:{client}:{turn}")
    return [rng.randrange(100, 1000) for _ in range(tokens)]  # ids every model here has (tiny: 1,024)


async def stream(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed request: the time of every token chunk (from the send), the text, the usage."""
    start = time.perf_counter()
    times: list[float] = []
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", path, json={**body, "stream": True,
                                                 "stream_options": {"include_usage": True}}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message", "error event"))
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta")
                if delta is not None and "role" in delta and not delta.get("content"):
                    continue  # the chat role chunk comes before any token
                times.append(time.perf_counter() - start)
                text.append((delta or {}).get("content") or choice.get("text") or "")
            usage = chunk.get("usage") or usage
    if not times:
        raise RuntimeError("no token came back")
    return {"times": times, "text": "".join(text), "usage": usage}


async def load(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The chat and document clients against ``url`` for ``args.duration`` seconds."""
    chats: list[dict[str, Any]] = []
    docs: list[dict[str, Any]] = []
    failures: dict[str, list[str]] = {"chat": [], "doc": []}
    start = time.perf_counter()
    deadline = start + args.duration
    limits = httpx.Limits(max_connections=args.chats + args.docs + 4)
    headers = {"Authorization": f"Bearer {TENANT_KEYS['tenant-a']}"}

    async def chat_client(i: int, client: httpx.AsyncClient) -> None:
        turn = 0
        while time.perf_counter() < deadline:
            message = chat_message(args.seed, i, turn, args.chat_words)
            body = {"model": model, "messages": [{"role": "user", "content": message}],
                    "max_tokens": args.chat_tokens, "temperature": 0, "ignore_eos": True}
            try:
                got = await stream(client, "/v1/chat/completions", body)
                chats.append({"key": f"{i}.{turn}", "ttft_s": got["times"][0], "times": got["times"],
                              "text": got["text"], "tokens": got["usage"].get("completion_tokens", 0),
                              "prompt_tokens": got["usage"].get("prompt_tokens", 0), "end": time.perf_counter()})
            except (httpx.HTTPError, RuntimeError, ValueError) as exc:
                failures["chat"].append(f"{i}.{turn}: {exc}")
            turn += 1

    async def doc_client(i: int, client: httpx.AsyncClient) -> None:
        turn = 0
        while time.perf_counter() < deadline:
            body = {"model": model, "prompt": doc_ids(args.seed, i, turn, args.doc_tokens),
                    "max_tokens": args.doc_max_tokens, "temperature": 0, "ignore_eos": True}
            try:
                got = await stream(client, "/v1/completions", body)
                docs.append({"key": f"{i}.{turn}", "ttft_s": got["times"][0], "e2e_s": got["times"][-1],
                             "cached_tokens": (got["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")})
            except (httpx.HTTPError, RuntimeError, ValueError) as exc:
                failures["doc"].append(f"{i}.{turn}: {exc}")
            turn += 1

    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        watch = asyncio.create_task(progress(chats, docs, failures, start, args.duration))
        await asyncio.gather(*(chat_client(i, client) for i in range(args.chats)),
                             *(doc_client(i, client) for i in range(args.docs)))
        watch.cancel()
    wall = (max(c["end"] for c in chats) if chats else time.perf_counter()) - start
    return {"chats": chats, "docs": docs, "failures": failures, "wall_s": wall}


async def progress(chats: list, docs: list, failures: dict, start: float, duration: float) -> None:
    while True:
        await asyncio.sleep(15)
        say(f"  {time.perf_counter() - start:.0f}/{duration:.0f} s: {len(chats)} chats, {len(docs)} documents, "
            f"{sum(len(f) for f in failures.values())} failures")


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank on the sorted values), or None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


def figures(raw: dict[str, Any]) -> dict[str, Any]:
    chats, docs = raw["chats"], raw["docs"]
    ttft = [c["ttft_s"] * 1000 for c in chats]
    itl = [(b - a) * 1000 for c in chats for a, b in zip(c["times"], c["times"][1:], strict=False)]
    doc_ttft = [d["ttft_s"] * 1000 for d in docs]
    tokens = sum(c["tokens"] for c in chats)
    return {"chats": len(chats), "chat_tokens": tokens, "chat_tokens_per_s": tokens / raw["wall_s"],
            "chat_prompt_tokens_mean": statistics.fmean(c["prompt_tokens"] for c in chats) if chats else None,
            "chat_chunks_per_stream": statistics.fmean(len(c["times"]) for c in chats) if chats else None,
            "ttft_p50_ms": pct(ttft, 50), "ttft_p95_ms": pct(ttft, 95),
            "itl_p50_ms": pct(itl, 50), "itl_p95_ms": pct(itl, 95), "itl_p99_ms": pct(itl, 99),
            "itl_max_ms": max(itl) if itl else None, "itl_samples": len(itl),
            "docs": len(docs), "doc_ttft_p50_ms": pct(doc_ttft, 50), "doc_ttft_p95_ms": pct(doc_ttft, 95),
            "failures": {k: len(v) for k, v in raw["failures"].items()},
            "failure_examples": [f for v in raw["failures"].values() for f in v[:3]], "wall_s": raw["wall_s"]}


def run(name: str, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    roles = SETUPS[name]
    with Cluster(f"pd-bench-{name}", say, args.keep / name if args.keep else None) as cluster:
        redis_url = cluster.start_redis()
        replicas = []
        for replica_name, role in zip(("p", "d") if roles[0] == "prefill" else ("a", "b"), roles, strict=True):
            config = cluster.work / f"{replica_name}.toml"
            config.write_text(config_text(args.model, redis_url, role=role, device_blocks=args.device_blocks,
                                          host_mb=args.host_mb, threads=args.threads))
            replicas.append(cluster.start_replica(replica_name, config))
        router = cluster.start_router(cluster.work / f"{replicas[-1].name}.toml", replicas, "prefix")
        say(f"{name}: starting replicas ({' + '.join(roles)}, {args.model}) and the router; logs in {cluster.work}")
        t0 = time.monotonic()
        cluster.wait_ready(replicas)
        cluster.wait_ready([router], replicas=2)
        say(f"{name}: replicas and `kvgate route` ready after {time.monotonic() - t0:.0f} s")
        key = TENANT_KEYS["tenant-a"]
        model = get_json(router.url + "/v1/models", key)["data"][0]["id"]
        for target in (*replicas, router):  # first-request costs stay out of the figures
            complete(target.url, key, {"model": model, "prompt": "Warm-up request.", "max_tokens": 2})
        before = [metrics(r) for r in replicas]
        state_before = router_state(router)
        say(f"{name}: load for {args.duration:.0f} s: {args.chats} chat streams, {args.docs} document clients")
        raw = asyncio.run(load(router.url, model, args))
        out = figures(raw)
        state = router_state(router)
        out["decisions"] = {k: v - state_before["decisions"].get(k, 0) for k, v in state["decisions"].items()}
        out["replicas"] = [replica_figures(r, b, roles[i]) for i, (r, b) in enumerate(zip(replicas, before,
                                                                                              strict=True))]
        say(f"{name}: {out['chats']} chats (TTFT p50 {ms(out['ttft_p50_ms'])} ms, ITL p50/p95/p99 "
            f"{ms(out['itl_p50_ms'], 1)}/{ms(out['itl_p95_ms'], 1)}/{ms(out['itl_p99_ms'], 1)} ms, "
            f"{out['chat_tokens_per_s']:.1f} tok/s), {out['docs']} documents, failures {out['failures']}")
        return out, {c["key"]: c["text"] for c in raw["chats"]}


def replica_figures(replica: Child, before: dict[str, Any], role: str) -> dict[str, Any]:
    after = metrics(replica)
    bs = after.get("block_size") or 16

    def d(*path: str) -> float:
        return delta(after, before, *path)

    info = get_json(replica.url + "/admin/replica")
    return {"name": replica.name, "role": role, "requests": d("requests_finished"),
            "prompt_tokens": d("prompt_tokens"), "computed_tokens": d("computed_tokens"),
            "cached_prompt_tokens": d("cached_prompt_tokens"), "generated_tokens": d("generated_tokens"),
            "redis_tokens_loaded": d("tiers", "remote", "hits") * bs,
            "redis_load_timeouts": d("tiers", "remote", "timeouts"), "redis_errors": d("tiers", "remote", "errors"),
            "shipped": info.get("shipped")}


def compare(texts: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Chats both setups completed: how many came out identical, and which did not."""
    names = list(texts)
    if len(names) < 2:
        return {"compared": 0, "identical": 0, "different": []}
    a, b = texts[names[0]], texts[names[1]]
    common = sorted(set(a) & set(b), key=lambda k: tuple(int(x) for x in k.split(".")))
    different = [k for k in common if a[k] != b[k]]
    return {"compared": len(common), "identical": len(common) - len(different), "different": different}


def ms(x: float | None, digits: int = 0) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def print_table(result: dict[str, Any]) -> None:
    setups = result["setups"]
    print("| setup | chats | chat TTFT p50 / p95 ms | ITL p50 / p95 / p99 ms | ITL max ms | chat tok/s "
          "| documents | document TTFT p50 / p95 ms | failures |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, s in setups.items():
        print(f"| {name} | {s['chats']} | {ms(s['ttft_p50_ms'])} / {ms(s['ttft_p95_ms'])} "
              f"| {ms(s['itl_p50_ms'], 1)} / {ms(s['itl_p95_ms'], 1)} / {ms(s['itl_p99_ms'], 1)} | {ms(s['itl_max_ms'])} "
              f"| {s['chat_tokens_per_s']:.1f} | {s['docs']} | {ms(s['doc_ttft_p50_ms'])} / {ms(s['doc_ttft_p95_ms'])} "
              f"| {sum(s['failures'].values())} |")
    c = result["outputs"]
    if c["compared"]:
        print(f"\nGreedy chat outputs: {c['identical']} of {c['compared']} chats both setups completed are identical"
              + (f" (different: {', '.join(c['different'][:10])})" if c["different"] else "") + ".")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = result["setups"]
    fig, (itl, ttft) = plt.subplots(1, 2, figsize=(12, 4.3))
    colors = {"disaggregated": "#27a", "mixed": "#a72"}
    keys = [("itl_p50_ms", "p50"), ("itl_p95_ms", "p95"), ("itl_p99_ms", "p99")]
    width = 0.8 / len(setups)
    for i, (name, s) in enumerate(setups.items()):
        x = [g + (i - (len(setups) - 1) / 2) * width for g in range(len(keys))]
        bars = itl.bar(x, [s[k] or 0 for k, _ in keys], width, label=name, color=colors.get(name))
        itl.bar_label(bars, fmt="%.0f", fontsize=8)
        x = [g + (i - (len(setups) - 1) / 2) * width for g in range(3)]
        values = [(s[k] or 0) / 1000 for k in ("ttft_p50_ms", "ttft_p95_ms", "doc_ttft_p50_ms")]
        bars = ttft.bar(x, values, width, label=name, color=colors.get(name))
        ttft.bar_label(bars, fmt="%.2f", fontsize=8)
    itl.set_xticks(range(len(keys)), [label for _, label in keys])
    itl.set_yscale("log")
    itl.set_ylim(bottom=1)
    itl.set_ylabel("ms between token chunks (log)")
    itl.set_title("Chat inter-token latency while documents prefill")
    ttft.set_xticks(range(3), ["chat TTFT p50", "chat TTFT p95", "document TTFT p50"])
    ttft.set_ylabel("seconds")
    ttft.set_title("Time to first token")
    for ax in (itl, ttft):
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    args = result["args"]
    fig.suptitle(f"Disaggregated vs mixed ({args['model']}, {args['chats']} chats + {args['docs']} documents of "
                 f"{args['doc_tokens']} tokens, {args['duration']:.0f} s each)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {"machine": machine(), "args": {k: str(v) if isinstance(v, Path) else v
                                                              for k, v in vars(args).items()}, "setups": {}}
    texts: dict[str, dict[str, str]] = {}
    for name in args.setup_list:
        result["setups"][name], texts[name] = run(name, args)
    result["outputs"] = compare(texts)
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    print_table(result)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")
        say(f"results written to {args.json_out}")
    if args.plot_out is not None:
        plot(result, args.plot_out)
        say(f"plot written to {args.plot_out}")
    failed = any(sum(s["failures"].values()) for s in result["setups"].values())
    return 1 if failed or result["outputs"]["different"] else 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        say("interrupted: every process it started is stopped, its folders removed")
        raise SystemExit(130) from None
