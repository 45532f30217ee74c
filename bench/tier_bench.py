"""Tier benchmark: TTFT of a 2,048-token prompt whose first 1,984 tokens sit in exactly one tier.

In process, one EngineCore (SmolLM2-135M-Instruct float32 by default) with the host and disk
tiers on (the disk tier in a temporary folder). For each repeat, a fresh random prompt prefix:

  recompute  nothing cached: the full prefill;
  device     the prefix's blocks are cached in the device pool;
  host       they were demoted to the host tier and dropped from the device;
  disk       they were written to the disk tier and dropped from device and host.

The measured request is the prefix plus 64 new tokens, one greedy token; TTFT is from
``add_request`` to the first token, with the engine driven as its loop drives it (disk loads run
on the I/O thread while the loop polls). Beside each tier's load rate, the machine's ceiling in
the same run: a memcpy of the same bytes (host), a plain read of the same files into a buffer that
holds them all (disk; a load must keep the bytes, see docs/benchmarks.md) and the
same pipelined GETs over a plain socket, nothing parsed (Redis).

``--revisit`` adds the revisit workload: 40 documents of ~1,500 tokens, each visited three
times in shuffled order with the default device pool, then once more after a restart (a new
engine on the same disk folder); mean TTFT per pass.

``--codecs none,bf16,fp16,int8`` repeats all of it once per KV codec of the disk and Redis tiers
(a fresh engine, disk folder and prompts for each; Redis emptied between them when it is the
private one), and reports the codecs side by side: TTFT and speed-up per tier, and the bytes per
block written to and read from each tier.

    .venv/bin/python -m bench.tier_bench --json-out docs/bench_tiers.json --plot-out docs/bench_tiers.png
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy
import torch

from cache.tiers.kv_codec import CODECS
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams

# the store key of this run's deployment (a server derives it from its secret): every core the
# bench makes shares it, so each one loads what the others wrote to Redis
STORE_MAC_KEY = os.urandom(32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.tier_bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Run it on a quiet machine; figures are medians over --repeats.")
    p.add_argument("--model", default="default", help="model: 'default', 'tiny', 'small' or a folder")
    p.add_argument("--repeats", type=int, default=3, help="repeats per tier (default 3)")
    p.add_argument("--prompt-tokens", type=int, default=2048, help="measured prompt length (default 2048)")
    p.add_argument("--cached-tokens", type=int, default=1984, help="tokens held in the tier (default 1984)")
    p.add_argument("--host-mb", type=int, default=1024, help="host tier size in MiB (default 1024)")
    p.add_argument("--redis-url", default=None,
                   help="also measure the remote tier on this Redis (default: start a private redis-server "
                        "on a free port when the binary exists; 'off' to skip)")
    p.add_argument("--copy-host", action="store_true",
                   help="give the host tier a slab of its own and copy blocks to and from the device, instead "
                        "of sharing the device pool's tensor and trading rows (the default on CPU)")
    p.add_argument("--revisit", action="store_true", help="also run the 40-document revisit workload")
    p.add_argument("--codecs", default="none",
                   help="comma-separated KV codecs of the disk and Redis tiers, each measured in turn: none, "
                        "bf16, fp16, int8 (default none)")
    p.add_argument("--docs", type=int, default=40, help="revisit: number of documents (default 40)")
    p.add_argument("--doc-tokens", type=int, default=1500, help="revisit: tokens per document (default 1500)")
    p.add_argument("--json-out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--plot-out", type=Path, default=None, help="write a PNG plot here")
    args = p.parse_args(argv)
    args.codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    for codec in args.codecs:
        if codec not in CODECS:
            p.error(f"--codecs: unknown codec {codec!r}; choose from {', '.join(CODECS)}")
    return args


def say(message: str) -> None:
    print(f"[tier_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Bench:
    def __init__(self, args: argparse.Namespace, disk_dir: str, codec: str = "none", seed: int = 0) -> None:
        self.args = args
        self.disk_dir = disk_dir
        self.codec = codec
        self.core = self.new_core()
        self.rng = random.Random(seed)
        self.n = 0

    def new_core(self, num_blocks: int = 1024) -> EngineCore:
        return EngineCore(EngineConfig(model=self.args.model, host_cache_mb=self.args.host_mb,
                                       share_host_slab=not self.args.copy_host,
                                       disk_cache_path=self.disk_dir, num_blocks=num_blocks,
                                       remote_cache_url=self.args.redis_url, remote_timeout_s=5.0,
                                       disk_codec=self.codec, remote_codec=self.codec,
                                       store_mac_key=STORE_MAC_KEY))

    def ids(self, n: int) -> list[int]:
        vocab = self.core.vocab_size
        return [self.rng.randrange(100, vocab - 1) for _ in range(n)]

    def ttft(self, ids: list[int], core: EngineCore | None = None) -> tuple[float, int]:
        core = core or self.core
        self.n += 1
        t0 = time.perf_counter()
        core.add_request(GenerateRequest(f"r{self.n}", ids, SamplingParams(max_tokens=1, temperature=0)))
        first, cached = None, 0
        while core.has_work() or core.is_loading():
            core.poll_loads()
            if not core.has_work():
                time.sleep(0.0005)
                continue
            for out in core.step():
                if first is None:
                    first, cached = time.perf_counter() - t0, out.num_cached_tokens
        assert first is not None
        return first, cached

    def drop_device(self) -> int:
        """Demote every idle cached device block to the next tier and forget it on the device."""
        return self.core.spill_device()

    def drop_host_to_disk(self) -> None:
        chain = self.core.chain
        chain.flush([], timeout_s=120)
        chain.drain_writes(120)
        chain.memory.clear()


def tier_section(bench: Bench) -> dict[str, Any]:
    args = bench.args
    core = bench.core
    block_bytes = core.storage.block_nbytes
    nblocks = args.cached_tokens // core.block_size
    tiers = ["recompute", "device", "host", "disk"] + (["remote"] if core.chain.shared is not None else [])
    results: dict[str, list[dict[str, float]]] = {k: [] for k in tiers}
    bench.ttft(bench.ids(args.prompt_tokens))  # warm-up
    for r in range(args.repeats):
        for tier in tiers:
            prefix = bench.ids(args.cached_tokens)
            if tier != "recompute":
                bench.ttft(prefix + bench.ids(args.prompt_tokens - args.cached_tokens))
                if tier in ("host", "disk", "remote"):
                    bench.drop_device()
                if tier == "disk":
                    bench.drop_host_to_disk()
                if tier == "remote":  # written through as computed; now only Redis holds it
                    core.chain.drain_writes(120)
                    core.chain.memory.clear()
            # background writes must not overlap the measured request: the priming request's
            # write-through to Redis, host victims an earlier request spilled to disk
            core.chain.drain_writes(120)
            host0 = dict(core.chain.memory.stats.snapshot())
            disk0 = dict(core.chain.store.stats.snapshot())
            remote0 = dict(core.chain.shared.stats.snapshot()) if core.chain.shared is not None else {}
            wait0 = core.chain.stats.prefetch_wait_s
            t, cached = bench.ttft(prefix + bench.ids(args.prompt_tokens - args.cached_tokens))
            row: dict[str, float] = {"ttft_s": t, "cached_tokens": cached}
            if tier == "host":
                s = core.chain.memory.stats
                row["load_s"] = s.read_time_s - host0["read_time_s"]
                row["load_bytes"] = s.bytes_read - host0["bytes_read"]
                row["handovers"] = s.handovers - host0["handovers"]
            if tier == "disk":  # reads overlap: the rate is bytes over the batch's wall time
                s = core.chain.store.stats
                row["load_s"] = core.chain.stats.prefetch_wait_s - wait0
                row["load_bytes"] = s.bytes_read - disk0["bytes_read"]
            if tier == "remote":
                s = core.chain.shared.stats
                row["load_s"] = s.read_time_s - remote0["read_time_s"]
                row["load_bytes"] = s.bytes_read - remote0["bytes_read"]
            results[tier].append(row)
            say(f"repeat {r + 1}/{args.repeats} {tier:9s} TTFT {t * 1000:8.1f} ms  cached {cached}")
    # ceilings, same bytes, same run; each the median of 3 passes after a warm-up pass
    src = torch.empty(nblocks * block_bytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)

    def memcpy() -> int:
        dst.copy_(src)
        return src.numel()

    memcpy_bps = median_rate(memcpy)
    files = sorted(Path(core.chain.store.dir).glob("*.kvb"))[:nblocks]

    # A load has to leave the bytes in memory, so the ceiling reads every file into its own part
    # of one buffer as large as all of them (touched first, like a used host slab). Reading each
    # file into a fresh bytes object is also reported: glibc hands the same freed chunk back
    # every time, so those reads land in a cache-resident buffer and run faster than any read
    # whose bytes are kept (docs/benchmarks.md, tier chain).
    sink = numpy.ones(sum(path.stat().st_size for path in files), dtype=numpy.uint8)

    def read_files() -> int:
        total = 0
        for path in files:
            with path.open("rb", buffering=0) as f:
                total += f.readinto(memoryview(sink)[total:])
        return total

    def read_files_discarding() -> int:
        total = 0
        for path in files:
            with path.open("rb") as f:
                total += len(f.read())
        return total

    read_bps = median_rate(read_files)
    discard_bps = median_rate(read_files_discarding)
    redis_bps = redis_one_bps = redis_py_bps = None
    if core.chain.shared is not None:
        redis_bps, redis_one_bps, redis_py_bps = redis_ceilings(args.redis_url, nblocks, core.chain.shared.fmt.record_size)
    per_block = bytes_per_block(core)
    med = {tier: statistics.median(r["ttft_s"] for r in rows) for tier, rows in results.items()}
    copied = [r["load_bytes"] / r["load_s"] for r in results["host"] if r.get("load_s") and r["load_bytes"]]
    host_bps = statistics.median(copied) if copied else None  # None: rows traded, nothing copied
    handover_s = statistics.median(r["load_s"] for r in results["host"]) if not copied else None
    disk_bps = statistics.median(r["load_bytes"] / r["load_s"] for r in results["disk"] if r.get("load_s"))
    return {"raw": results, "ttft_median_s": med, "speedup_vs_recompute": {t: med["recompute"] / v for t, v in med.items()},
            "host_load_bytes_per_s": host_bps, "disk_load_bytes_per_s": disk_bps,
            "host_handovers": statistics.median(r.get("handovers", 0) for r in results["host"]),
            "host_handover_s": handover_s,
            "host_shares_the_slab": bool(core.chain.memory.shared),
            "memcpy_bytes_per_s": memcpy_bps, "file_read_bytes_per_s": read_bps,
            "file_read_discarding_bytes_per_s": discard_bps, "redis_get_bytes_per_s": redis_bps,
            "redis_get_one_pipeline_bytes_per_s": redis_one_bps,
            "redis_py_get_bytes_per_s": redis_py_bps,
            "remote_load_bytes_per_s": statistics.median(r["load_bytes"] / r["load_s"] for r in results["remote"]
                                                         if r.get("load_s")) if "remote" in results else None,
            "block_bytes": block_bytes, "blocks": nblocks, "bytes_per_block": per_block}


def bytes_per_block(core: EngineCore) -> dict[str, float | None]:
    """Mean bytes per block written to and read from the disk and Redis tiers so far (records:
    header and encoded values)."""
    chain = core.chain
    out: dict[str, float | None] = {}
    for name, tier, count in (("disk", chain.store, "writes"), ("remote", chain.shared, "puts")):
        s = tier.stats if tier is not None else None
        out[f"{name}_written"] = s.bytes_written / getattr(s, count) if s and getattr(s, count) else None
        out[f"{name}_read"] = s.bytes_read / s.hits if s and s.hits else None
    return out


def median_rate(run: Any, passes: int = 3) -> float:
    """Bytes per second of ``run()`` (which returns the bytes it moved): the median of ``passes``
    timed passes after one untimed warm-up pass (first-touch page faults are not the ceiling)."""
    run()
    rates = []
    for _ in range(passes):
        t0 = time.perf_counter()
        nbytes = run()
        rates.append(nbytes / max(time.perf_counter() - t0, 1e-9))
    return statistics.median(rates)


def redis_ceilings(url: str, nblocks: int, value_bytes: int) -> tuple[float, float, float]:
    """What the machine can move out of Redis: the same number of GETs of values of the same size
    over a plain socket, the replies received into one warm buffer, nothing parsed — (1) sent in
    windows as the remote tier sends them (`cache.tiers.resp.WINDOW_BYTES`, `WINDOWS_IN_FLIGHT`),
    (2) as one pipeline — and (3) with redis-py's blocking client (one pipeline); medians of 3.
    The ceiling is the better of (1) and (2)."""
    import socket
    from urllib.parse import urlparse

    import redis

    from cache.tiers.resp import WINDOW_BYTES, WINDOWS_IN_FLIGHT

    client = redis.Redis.from_url(url)
    names = [f"kvgate-bench-ceiling:{i}".encode() for i in range(nblocks)]
    value = bytes(value_bytes)
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.set(name, value, ex=300)
    pipe.execute()
    per = max(1, WINDOW_BYTES // value_bytes)
    windows = [b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(n), n) for n in names[i:i + per])
               for i in range(0, nblocks, per)]
    one_reply = len(b"$%d\r\n" % value_bytes) + value_bytes + 2
    reply = nblocks * one_reply
    buf = bytearray(reply)
    windowed, raw, py = [], [], []
    where = urlparse(url)

    def receive(sock: socket.socket, in_flight: int) -> float:
        """Send the windows with at most ``in_flight`` unanswered, receive every reply; bytes/s."""
        view, got, sent = memoryview(buf), 0, 0
        t0 = time.perf_counter()
        while sent < min(in_flight, len(windows)):
            sock.sendall(windows[sent])
            sent += 1
        while got < reply:
            n = sock.recv_into(view[got:])
            if not n:
                raise ConnectionError("redis closed the connection")
            got += n
            while sent < len(windows) and got >= min(nblocks, (sent - in_flight + 1) * per) * one_reply:
                sock.sendall(windows[sent])
                sent += 1
        return reply / (time.perf_counter() - t0)

    try:
        with socket.create_connection((where.hostname or "127.0.0.1", where.port or 6379)) as sock:
            for _ in range(3):
                windowed.append(receive(sock, WINDOWS_IN_FLIGHT))
                raw.append(receive(sock, len(windows)))
        for _ in range(3):
            t0 = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            got_values = pipe.execute()
            py.append(sum(len(g) for g in got_values) / (time.perf_counter() - t0))
    finally:
        client.delete(*names)
        client.close()
    return max(statistics.median(windowed), statistics.median(raw)), statistics.median(raw), statistics.median(py)


def revisit_section(bench: Bench) -> dict[str, Any]:
    args = bench.args
    docs = [bench.ids(args.doc_tokens) for _ in range(args.docs)]
    passes: list[list[float]] = []
    cached: list[list[int]] = []
    for p in range(3):
        order = list(range(args.docs))
        random.Random(p).shuffle(order)
        times, hits = [], []
        for i in order:
            t, c = bench.ttft(docs[i] + bench.ids(8))
            times.append(t)
            hits.append(c)
        passes.append(times)
        cached.append(hits)
        say(f"revisit pass {p + 1}: mean TTFT {statistics.mean(times) * 1000:.0f} ms, "
            f"mean cached {statistics.mean(hits):.0f} tokens")
    say("revisit: restart (new engine on the same disk folder)")
    bench.core.close()
    bench.core = bench.new_core()
    times, hits = [], []
    for i in range(args.docs):
        t, c = bench.ttft(docs[i] + bench.ids(8))
        times.append(t)
        hits.append(c)
    passes.append(times)
    cached.append(hits)
    say(f"revisit after restart: mean TTFT {statistics.mean(times) * 1000:.0f} ms")
    return {"mean_ttft_s": [statistics.mean(t) for t in passes], "mean_cached_tokens": [statistics.mean(c) for c in cached],
            "labels": ["pass 1", "pass 2", "pass 3", "after restart"]}


def print_tables(out: dict[str, Any]) -> None:
    t = out["tiers"]
    med, speed = t["ttft_median_s"], t["speedup_vs_recompute"]
    print(f"TTFT of a {out['args']['prompt_tokens']}-token prompt, {out['args']['cached_tokens']} tokens in one "
          f"tier ({t['blocks']} blocks of {t['block_bytes'] / 1024:.0f} KiB), medians of {out['args']['repeats']}\n")
    print("| where the prefix is | TTFT | vs recompute |")
    print("|---|---:|---:|")
    for tier in med:
        print(f"| {tier} | {med[tier] * 1000:.1f} ms | {speed[tier]:.1f}× |")
    print("\n| tier load | rate | ceiling (same bytes, same run) | share |")
    print("|---|---:|---:|---:|")
    if t["host_load_bytes_per_s"] is None:
        moved = t["host_handovers"] * t["block_bytes"]
        print(f"| host → device | {t['host_handovers']:.0f} blocks handed over in {t['host_handover_s'] * 1000:.2f} ms, "
              f"0 bytes copied (one slab): {moved / t['host_handover_s'] / 1e9:.0f} GB/s effective "
              f"| memcpy {t['memcpy_bytes_per_s'] / 1e9:.2f} GB/s | {moved / t['host_handover_s'] / t['memcpy_bytes_per_s']:.0%} |")
    else:
        print(f"| host → device | {t['host_load_bytes_per_s'] / 1e9:.2f} GB/s | memcpy {t['memcpy_bytes_per_s'] / 1e9:.2f} GB/s "
              f"| {t['host_load_bytes_per_s'] / t['memcpy_bytes_per_s']:.0%} |")
    print(f"| disk → host | {t['disk_load_bytes_per_s'] / 1e9:.2f} GB/s | plain read of the files into memory "
          f"{t['file_read_bytes_per_s'] / 1e9:.2f} GB/s (into one reused buffer "
          f"{t['file_read_discarding_bytes_per_s'] / 1e9:.2f} GB/s) "
          f"| {t['disk_load_bytes_per_s'] / t['file_read_bytes_per_s']:.0%} |")
    if t.get("remote_load_bytes_per_s") and t.get("redis_get_bytes_per_s"):
        one = t.get("redis_get_one_pipeline_bytes_per_s")
        print(f"| Redis → host | {t['remote_load_bytes_per_s'] / 1e9:.2f} GB/s | GETs on a plain socket, nothing parsed "
              f"{t['redis_get_bytes_per_s'] / 1e9:.2f} GB/s (as one pipeline {one / 1e9 if one else float('nan'):.2f}, "
              f"redis-py {t['redis_py_get_bytes_per_s'] / 1e9:.2f} GB/s) "
              f"| {t['remote_load_bytes_per_s'] / t['redis_get_bytes_per_s']:.0%} |")
    if "revisit" in out:
        rv = out["revisit"]
        print("\n| revisit workload | mean TTFT | mean cached tokens |")
        print("|---|---:|---:|")
        for label, ttft, c in zip(rv["labels"], rv["mean_ttft_s"], rv["mean_cached_tokens"], strict=True):
            print(f"| {label} | {ttft * 1000:.0f} ms | {c:.0f} |")


def print_codec_tables(out: dict[str, Any]) -> None:
    codecs = out["codecs"]
    names = list(codecs)
    first = codecs[names[0]]["tiers"]
    print(f"\nBy KV codec of the disk and Redis tiers: TTFT (speed-up vs recompute in the same engine), medians "
          f"of {out['args']['repeats']}\n")
    print("| where the prefix is | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for tier in first["ttft_median_s"]:
        cells = [f"{c['tiers']['ttft_median_s'][tier] * 1000:.0f} ms ({c['tiers']['speedup_vs_recompute'][tier]:.1f}×)"
                 for c in codecs.values()]
        print(f"| {tier} | " + " | ".join(cells) + " |")
    print("\n| bytes per block | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for key in first["bytes_per_block"]:
        cells = [f"{v / 1024:.0f} KiB" if (v := c["tiers"]["bytes_per_block"][key]) else "n/a" for c in codecs.values()]
        print(f"| {key.replace('_', ' ')} | " + " | ".join(cells) + " |")
    if "revisit" in first or "revisit" in codecs[names[0]]:
        labels = codecs[names[0]]["revisit"]["labels"]
        print("\n| revisit: mean TTFT | " + " | ".join(names) + " |")
        print("|---|" + "---:|" * len(names))
        for i, label in enumerate(labels):
            print(f"| {label} | " + " | ".join(f"{c['revisit']['mean_ttft_s'][i] * 1000:.0f} ms"
                                            for c in codecs.values()) + " |")


def plot(out: dict[str, Any], path: Path) -> None:
    """TTFT per tier (log scale) and, with --revisit, mean TTFT per pass; one bar per codec."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    codecs = out.get("codecs") or {"none": {"tiers": out["tiers"], **({"revisit": out["revisit"]}
                                                                      if "revisit" in out else {})}}
    names = list(codecs)
    colors = ["#27a", "#2a7", "#a72", "#a27"]
    width = 0.8 / len(names)
    panels = 2 if "revisit" in out else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.2))
    axes = axes if panels > 1 else [axes]
    tiers = list(out["tiers"]["ttft_median_s"])
    for j, name in enumerate(names):
        med = codecs[name]["tiers"]["ttft_median_s"]
        axes[0].bar([i + (j - (len(names) - 1) / 2) * width for i in range(len(tiers))],
                    [med[t] * 1000 for t in tiers], width, label=name, color=colors[j % len(colors)])
    axes[0].set_xticks(range(len(tiers)), tiers)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("TTFT, ms (log)")
    axes[0].set_title(f"{out['args']['cached_tokens']} of {out['args']['prompt_tokens']} tokens cached in one tier")
    if len(names) > 1:
        axes[0].legend(title="disk/Redis codec", fontsize=8)
    if "revisit" in out:
        labels = out["revisit"]["labels"]
        for j, name in enumerate(names):
            axes[1].bar([i + (j - (len(names) - 1) / 2) * width for i in range(len(labels))],
                        [t * 1000 for t in codecs[name]["revisit"]["mean_ttft_s"]], width, label=name,
                        color=colors[j % len(colors)])
        axes[1].set_xticks(range(len(labels)), labels)
        axes[1].set_ylabel("mean TTFT, ms")
        axes[1].set_title(f"revisit: {out['args']['docs']} docs × 3 passes, then restart")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    redis_proc = None
    if args.redis_url == "off":
        args.redis_url = None
    elif args.redis_url is None and shutil.which("redis-server"):
        redis_proc, args.redis_url = start_redis()
    try:
        return run(args, private_redis=redis_proc is not None)
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)


def start_redis(log: Callable[[str], None] = say) -> tuple[subprocess.Popen, str]:
    """A private redis-server on a free loopback port (never the machine's shared one); ``log``
    tells the user (the calling benchmark's progress lines)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        if subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).stdout.strip() == b"PONG":
            break
        time.sleep(0.05)
    log(f"private redis-server on port {port}")
    return proc, f"redis://127.0.0.1:{port}/0"


def run(args: argparse.Namespace, private_redis: bool = False) -> int:
    out: dict[str, Any] = {"args": vars(args) | {"json_out": None, "plot_out": None}, "codecs": {}}
    for i, codec in enumerate(args.codecs):
        if private_redis and i:
            subprocess.run(["redis-cli", "-u", args.redis_url, "flushall"], check=True, capture_output=True)
        with tempfile.TemporaryDirectory(prefix="kvgate-tier-bench-") as disk_dir:
            say(f"codec {codec}: loading {args.model}; disk tier in {disk_dir}")
            bench = Bench(args, disk_dir, codec, seed=i)
            part: dict[str, Any] = {}
            try:
                part["tiers"] = tier_section(bench)
                if args.revisit:
                    part["revisit"] = revisit_section(bench)
            finally:
                bench.core.close()
        out["codecs"][codec] = part
    out.update(out["codecs"][args.codecs[0]])  # the first codec's figures, in the single-codec layout
    print_tables(out)
    if len(args.codecs) > 1:
        print_codec_tables(out)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(out, indent=1, default=str))
    if args.plot_out is not None:
        plot(out, args.plot_out)
        say(f"plot written to {args.plot_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
