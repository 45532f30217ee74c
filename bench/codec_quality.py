"""Codec quality benchmark: what each KV codec (none, bf16, fp16, int8) costs in output quality.

Two measurements per codec, on the default model (SmolLM2-135M-Instruct, float32) unless told:

  next-token  English prose documents (bench/data/codec_quality, each read after the one before
              it, as two documents in one prompt) are cut into windows: a prefix of a multiple of
              16 tokens and the continuation after it. The model runs over the prefix; its KV
              cache is laid out as the engine's blocks (layers, 2, 16, kv_heads, head_dim), each
              block encoded and decoded with `cache.tiers.kv_codec`, and the continuation is then
              run teacher-forced over the decoded cache. At every continuation position the
              next-token distribution is compared with the one over the same cache not encoded:
              top-1 agreement, KL(p_none || p_codec), and the change in the negative
              log-likelihood of the text's next token.
  greedy      through the real data path: an `EngineCore` whose disk tier uses the codec runs
              each prompt cold (greedy, EOS ignored), its blocks are pushed out of the device and
              host memory into the disk's encoded records, and the same prompt runs again with
              its prefix loaded from them. Counted: how many warm continuations equal the cold.
              The prompts are those of the greedy tests (tests/app/test_greedy.py,
              tests/engine/test_core.py, tests/engine/test_tier_codecs_engine.py); the text ones
              follow a prose excerpt so that most of the prompt sits in full blocks.

Progress goes to stderr, the markdown table to stdout.

    .venv/bin/python -m bench.codec_quality --threads 2 \\
        --json-out docs/bench_codec_quality.json --plot-out docs/bench_codec_quality.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy
import torch

from cache.tiers import kv_codec
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model import load_model
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams

DATA_DIR = Path(__file__).resolve().parent / "data" / "codec_quality"
BLOCK_TOKENS = EngineConfig().block_size
# tests/app/test_greedy.py: its completion prompts and its chat
GREEDY_TEXTS = ["def add(a, b):", "The weather today is", "1, 2, 3, 4,"]
GREEDY_CHAT = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "2 + 2?"}]
# tests/engine/test_core.py (`varied_prompts`): the distinct texts longer than a word
_SYSTEM = "You are a careful assistant. Answer briefly and cite the rules you follow. " * 2
CORE_TEXTS = [_SYSTEM + f"Question {i}: what is {i} plus {i * 3}?" for i in range(3)] + [
    "The quick brown fox jumps over the lazy dog " * 4,
    "Numbers: " + " ".join(str(k) for k in range(40)),
]
CORE_LABELS = [f"careful assistant, question {i}" for i in range(3)] + ["quick brown fox x4", "Numbers: 0 .. 39"]
# tests/engine/test_tier_codecs_engine.py (`prompt`): random ids in [3, 1000), 121 of them
RANDOM_SEEDS = (31, 32)
RANDOM_LEN = 121
HOST_MB = 256  # the greedy engines' host tier: more than one prompt's blocks of the default model


# ---- arguments and output ------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(prog="python -m bench.codec_quality", description=doc.split("\n\n")[0],
                                epilog=doc.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default",
                   help="model: 'default' (SmolLM2-135M-Instruct), 'tiny', 'small', a folder or a hub id "
                        "(default: default)")
    p.add_argument("--codecs", default=",".join(kv_codec.CODECS),
                   help=f"comma-separated codecs to measure (default: {','.join(kv_codec.CODECS)})")
    p.add_argument("--docs", type=Path, nargs="+", default=[DATA_DIR],
                   help="text files, or folders of .txt files, to cut windows from (default: bench/data/codec_quality)")
    p.add_argument("--positions", type=int, default=8192,
                   help="next-token positions to measure at least; windows are added until reached (default 8192: "
                        "with the default documents and lengths, every document at every prefix length)")
    p.add_argument("--prefixes", default="384,768,1152,1536",
                   help="prefix lengths in tokens, multiples of the block size; each document's windows cycle "
                        "through those that fit (default 384,768,1152,1536)")
    p.add_argument("--continuation", type=int, default=256,
                   help="teacher-forced continuation tokens per window (default 256)")
    p.add_argument("--greedy-prompts", type=int, default=None,
                   help="how many of the greedy tests' prompts to run (default: all 11; 0 skips the greedy part)")
    p.add_argument("--greedy-tokens", type=int, default=32, help="greedy tokens generated per prompt (default 32)")
    p.add_argument("--greedy-context", type=int, default=480,
                   help="prose tokens placed before each text prompt of the greedy part (default 480)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads, also the engine's (default: torch's own, one per core)")
    p.add_argument("--no-native-kernels", action="store_true",
                   help="greedy part: run the engine on its PyTorch path instead of building and loading the "
                        "native CPU kernels first")
    p.add_argument("--json-out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--plot-out", type=Path, default=None, help="write a PNG plot here (needs matplotlib)")
    args = p.parse_args(argv)
    args.codecs = [kv_codec.check_codec(c.strip()) for c in args.codecs.split(",") if c.strip()]
    args.prefixes = [int(x) for x in args.prefixes.split(",") if x.strip()]
    if any(n <= 0 or n % BLOCK_TOKENS for n in args.prefixes):
        p.error(f"--prefixes must be positive multiples of {BLOCK_TOKENS}")
    if args.continuation < 1 or args.positions < 1:
        p.error("--continuation and --positions must be positive")
    return args


def say(message: str) -> None:
    """A progress line on stderr (the tables go to stdout)."""
    print(f"[codec_quality {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- documents and windows -----------------------------------------------------------------------
@dataclass(frozen=True)
class Window:
    """One measured stretch of a document: ``ids[:prefix]`` is cached (and encoded), the next
    ``continuation`` tokens are fed teacher-forced, and ``ids`` ends with the token after them
    (the target of the last position)."""

    doc: str
    ids: list[int]
    prefix: int
    continuation: int


def load_documents(paths: Iterable[Path]) -> list[tuple[str, str]]:
    """(name, text) of every .txt file named or inside a named folder, sorted by name."""
    files: list[Path] = []
    for path in paths:
        files += sorted(path.glob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise SystemExit(f"no documents found in {', '.join(map(str, paths))}")
    return [(f.stem, f.read_text(encoding="utf-8").strip()) for f in files]


def streams(docs: list[tuple[str, list[int]]], separator: list[int]) -> list[tuple[str, list[int]]]:
    """Each document after the one before it (cyclically), as two documents in one prompt: long
    prefixes reach into the second, short ones end in the first."""
    return [(f"{docs[d - 1][0]}+{name}", docs[d - 1][1] + separator + ids) if len(docs) > 1 else (name, ids)
            for d, (name, ids) in enumerate(docs)]


def plan_windows(docs: list[tuple[str, list[int]]], prefixes: list[int], continuation: int,
                 positions: int) -> list[Window]:
    """Windows in rounds over the documents until ``positions`` are covered. Document d takes, in
    round r, the ((d + r) mod k)-th of the k prefix lengths that fit it, so a short run still
    spreads over documents and prefix lengths alike."""
    fits = [[p for p in prefixes if p + continuation + 1 <= len(ids)] for _, ids in docs]
    windows: list[Window] = []
    total = 0
    for r in range(max(map(len, fits), default=0)):
        for d, ((name, ids), lengths) in enumerate(zip(docs, fits, strict=True)):
            if total >= positions:
                return windows
            if r < len(lengths):
                p = lengths[(d + r) % len(lengths)]
                windows.append(Window(name, ids[: p + continuation + 1], p, continuation))
                total += continuation
    if total < positions:
        say(f"the documents hold windows for only {total} of {positions} positions")
    return windows


# ---- the KV cache as the engine's blocks ---------------------------------------------------------
def cache_to_blocks(layers: list[tuple[torch.Tensor, torch.Tensor]], block_tokens: int) -> torch.Tensor:
    """Per-layer (K, V) of shape (1, kv_heads, tokens, head_dim) as engine blocks,
    (blocks, layers, 2, block_tokens, kv_heads, head_dim), contiguous."""
    kv = torch.stack([torch.stack([k[0], v[0]]) for k, v in layers])  # (L, 2, H, T, D)
    n_layers, _, heads, tokens, dim = kv.shape
    kv = kv.permute(0, 1, 3, 2, 4).reshape(n_layers, 2, tokens // block_tokens, block_tokens, heads, dim)
    return kv.permute(2, 0, 1, 3, 4, 5).contiguous()


def blocks_to_cache(blocks: torch.Tensor) -> Any:
    """A fresh `DynamicCache` holding ``blocks`` (the inverse of `cache_to_blocks`)."""
    from transformers import DynamicCache

    n_blocks, n_layers, _, block_tokens, heads, dim = blocks.shape
    kv = blocks.permute(1, 2, 4, 0, 3, 5).reshape(n_layers, 2, heads, n_blocks * block_tokens, dim)
    cache = DynamicCache()
    for layer in range(n_layers):
        cache.update(kv[layer, 0][None].contiguous(), kv[layer, 1][None].contiguous(), layer)
    return cache


def round_trip(codec: str, block: torch.Tensor) -> torch.Tensor:
    """``block`` (float32, the engine's layout) encoded and decoded with the store tiers' codec."""
    shape = tuple(block.shape)
    payload = block.contiguous().numpy().data.cast("B")
    body = kv_codec.encode(codec, "float32", shape, payload)
    dest = bytearray(payload.nbytes)
    kv_codec.decode_into(codec, "float32", shape, body, memoryview(dest))
    return torch.frombuffer(dest, dtype=torch.float32).view(shape)


def bytes_per_value(codec: str, block_shape: tuple[int, ...]) -> float:
    """Encoded bytes per float32 value of one engine block (int8 counts its scales)."""
    return kv_codec.encoded_size(codec, "float32", block_shape) / int(numpy.prod(block_shape))


# ---- next-token measurement ----------------------------------------------------------------------
def prefix_blocks(model: Any, prefix: list[int], block_tokens: int) -> torch.Tensor:
    """The model's KV cache over ``prefix``, as engine blocks."""
    out = model(input_ids=torch.tensor([prefix]), use_cache=True, logits_to_keep=1)
    layers = [(layer.keys, layer.values) for layer in out.cache.layers]
    return cache_to_blocks(layers, block_tokens)


def continuation_logprobs(model: Any, blocks: torch.Tensor, continuation: list[int]) -> torch.Tensor:
    """Next-token log-probabilities (float64, one row per continuation token) of ``continuation``
    run teacher-forced over the cache ``blocks``."""
    out = model(input_ids=torch.tensor([continuation]), cache=blocks_to_cache(blocks), use_cache=True)
    return torch.log_softmax(out.logits[0].double(), dim=-1)


@dataclass
class Comparison:
    """Per position of one or more windows: whether the argmax agrees with the unencoded cache's,
    KL(p_none || p_codec), the text's next-token NLL over the unencoded cache and its change
    (codec minus none); and the largest absolute error the codec put into a KV value."""

    agree: numpy.ndarray
    kl: numpy.ndarray
    nll_none: numpy.ndarray
    nll_delta: numpy.ndarray
    max_abs_err: float = 0.0

    @classmethod
    def join(cls, parts: list[Comparison]) -> Comparison:
        def joined(name: str) -> numpy.ndarray:
            return numpy.concatenate([getattr(p, name) for p in parts])

        return cls(joined("agree"), joined("kl"), joined("nll_none"), joined("nll_delta"),
                   max((p.max_abs_err for p in parts), default=0.0))


def compare(ref: torch.Tensor, other: torch.Tensor, targets: torch.Tensor) -> Comparison:
    """Two windows' next-token log-probabilities (positions × vocabulary) compared position by position."""
    kl = (ref.exp() * (ref - other)).sum(-1).clamp_min(0.0)
    nll_ref = -ref.gather(1, targets[:, None])[:, 0]
    nll_other = -other.gather(1, targets[:, None])[:, 0]
    return Comparison((ref.argmax(-1) == other.argmax(-1)).numpy(), kl.numpy(), nll_ref.numpy(),
                      (nll_other - nll_ref).numpy())


def measure_window(model: Any, window: Window, codecs: list[str], block_tokens: int) -> dict[str, Comparison]:
    """Every codec's per-position comparison on one window."""
    ids, p, c = window.ids, window.prefix, window.continuation
    continuation, targets = ids[p: p + c], torch.tensor(ids[p + 1: p + c + 1])
    with torch.inference_mode():
        blocks = prefix_blocks(model, ids[:p], block_tokens)
        ref = continuation_logprobs(model, blocks, continuation)
        found = {}
        for codec in codecs:
            decoded = torch.stack([round_trip(codec, b) for b in blocks])
            found[codec] = compare(ref, continuation_logprobs(model, decoded, continuation), targets)
            found[codec].max_abs_err = float((decoded - blocks).abs().max())
    return found


def measure_next_token(model: Any, windows: list[Window], codecs: list[str], block_tokens: int) -> dict[str, Comparison]:
    """Per codec, every window's comparisons joined."""
    parts: dict[str, list[Comparison]] = {c: [] for c in codecs}
    t0 = time.perf_counter()
    for i, w in enumerate(windows, 1):
        for codec, found in measure_window(model, w, codecs, block_tokens).items():
            parts[codec].append(found)
        say(f"next-token window {i}/{len(windows)}: {w.doc}, prefix {w.prefix}, "
            f"{w.continuation} positions ({time.perf_counter() - t0:.0f} s)")
    return {codec: Comparison.join(found) for codec, found in parts.items()}


def summarise_next_token(found: Comparison) -> dict[str, Any]:
    """One codec's figures over all positions."""
    kl, agree = found.kl, found.agree
    return {"positions": int(kl.size), "top1_agreement": float(agree.mean()), "top1_disagreements": int((~agree).sum()),
            "mean_kl": float(kl.mean()), "median_kl": float(numpy.median(kl)),
            "p99_kl": float(numpy.percentile(kl, 99)), "max_kl": float(kl.max()),
            "mean_nll_none": float(found.nll_none.mean()), "mean_nll_delta": float(found.nll_delta.mean()),
            "max_abs_value_error": found.max_abs_err}


# ---- greedy continuations through the engine --------------------------------------------------
def greedy_prompts(tokenizer: Any, docs: list[tuple[str, list[int]]], context: int) -> list[tuple[str, list[int]]]:
    """(label, ids) of the greedy tests' prompts: each text one (and the chat, templated) after
    ``context`` tokens of a document, the documents taken in turn; then the random-id prompts."""
    chat = tokenizer.apply_chat_template(GREEDY_CHAT, tokenize=False, add_generation_prompt=True)
    texts = [*GREEDY_TEXTS, chat, *CORE_TEXTS]
    labels = [*GREEDY_TEXTS, "chat: 2 + 2?", *CORE_LABELS]
    out = []
    for i, (label, text) in enumerate(zip(labels, texts, strict=True)):
        name, doc_ids = docs[i % len(docs)]
        out.append((f"{name} + {label!r}", doc_ids[:context] + _ids(tokenizer, "\n\n") + _ids(tokenizer, text)))
    for seed in RANDOM_SEEDS:
        rng = random.Random(seed)
        out.append((f"random ids (seed {seed})", [rng.randrange(3, 1000) for _ in range(RANDOM_LEN)]))
    return out


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def generate(core: EngineCore, request_id: str, ids: list[int], max_tokens: int, salt: str) -> tuple[list[int], int]:
    """Greedy tokens of one request and its cached prompt tokens, driven as the engine loop does."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    core.add_request(GenerateRequest(request_id, ids, params, cache_salt=salt))
    tokens: list[int] = []
    cached = 0
    while core.has_work() or core.is_loading():
        core.poll_loads()
        if not core.has_work():
            time.sleep(0.0005)  # waiting on disk reads
            continue
        for out in core.step():
            cached = out.num_cached_tokens if not tokens else cached
            tokens.append(out.token_id)
    return tokens, cached


def push_to_disk(core: EngineCore) -> None:
    """Move every cached block out of the device and host memory into the disk tier's records."""
    chain = core.chain
    assert chain is not None and chain.memory is not None
    core.spill_device()
    chain.flush([], timeout_s=120)
    chain.drain_writes(120)
    chain.memory.clear()


def greedy_one_codec(model: str, codec: str, prompts: list[tuple[str, list[int]]], max_tokens: int,
                     threads: int | None, native: bool, folder: str) -> list[dict[str, Any]]:
    """Cold, then warm from the codec's disk records, for every prompt on one engine."""
    longest = max(len(ids) for _, ids in prompts) + max_tokens
    config = EngineConfig(model=model, num_blocks=4 * (longest // BLOCK_TOKENS + 2), host_cache_mb=HOST_MB,
                          disk_cache_path=folder, disk_codec=codec, num_threads=threads, native_kernels=native)
    core = EngineCore(config)
    rows = []
    try:
        for i, (label, ids) in enumerate(prompts):
            salt = f"codec-quality-{i}"
            cold, _ = generate(core, f"cold-{i}", ids, max_tokens, salt)
            push_to_disk(core)
            hits = core.stats()["tiers"]["disk"]["hits"]
            warm, cached = generate(core, f"warm-{i}", ids, max_tokens, salt)
            rows.append({"prompt": label, "prompt_tokens": len(ids), "cached_tokens": cached,
                         "disk_hits": core.stats()["tiers"]["disk"]["hits"] - hits,
                         "identical": warm == cold, "first_divergence": _first_difference(cold, warm),
                         "cold": cold, "warm": warm, "cold_text": _text(core, cold), "warm_text": _text(core, warm)})
    finally:
        core.close()
    return rows


def _text(core: EngineCore, tokens: list[int]) -> str:
    return str(core.loaded.tokenizer.decode(tokens, skip_special_tokens=False))


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def measure_greedy(args: argparse.Namespace, prompts: list[tuple[str, list[int]]]) -> dict[str, list[dict[str, Any]]]:
    """Per codec, each prompt's cold and warm greedy continuation."""
    if not args.no_native_kernels:
        from engine import kernels

        say("loading the native CPU kernels (compiled once per machine when missing)")
        kernels.load()
    found = {}
    with tempfile.TemporaryDirectory(prefix="kvgate-codec-quality-") as root:
        for codec in args.codecs:
            t0 = time.perf_counter()
            found[codec] = greedy_one_codec(args.model, codec, prompts, args.greedy_tokens, args.threads,
                                            not args.no_native_kernels, os.path.join(root, codec))
            same = sum(r["identical"] for r in found[codec])
            say(f"greedy {codec}: {same}/{len(prompts)} identical ({time.perf_counter() - t0:.0f} s)")
    return found


# ---- the run --------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    """Everything measured, as the JSON document."""
    if args.threads:
        torch.set_num_threads(args.threads)
    say(f"loading {args.model}")
    loaded = load_model(args.model, "float32", "cpu")
    docs = [(name, _ids(loaded.tokenizer, text)) for name, text in load_documents(args.docs)]
    windows = plan_windows(streams(docs, _ids(loaded.tokenizer, "\n\n")), args.prefixes, args.continuation,
                           args.positions)
    say(f"{len(docs)} documents, {len(windows)} windows, {sum(w.continuation for w in windows)} positions, "
        f"codecs {', '.join(args.codecs)}, {torch.get_num_threads()} threads")
    t0 = time.perf_counter()
    found = measure_next_token(loaded.model, windows, args.codecs, BLOCK_TOKENS)
    next_token_s = time.perf_counter() - t0
    n_prompts = args.greedy_prompts
    prompts = greedy_prompts(loaded.tokenizer, docs, args.greedy_context)[:n_prompts]
    block_shape = (loaded.num_layers, 2, BLOCK_TOKENS, loaded.num_kv_heads, loaded.head_dim)
    model = {"name": loaded.name, "path": str(loaded.path), "dtype": "float32", "block_shape": list(block_shape)}
    del loaded
    t0 = time.perf_counter()
    greedy = measure_greedy(args, prompts) if prompts else {}
    return report(args, model, docs, windows, found, greedy,
                  {"next_token_s": next_token_s, "greedy_s": time.perf_counter() - t0})


METHOD = {
    "next_token": "prefix run once; its KV as engine blocks, each encoded and decoded with the codec; the "
                  "continuation teacher-forced over the decoded cache and over the unencoded one; per "
                  "continuation position: argmax agreement, KL(p_none || p_codec) in nats, NLL change of the "
                  "text's next token",
    "greedy": "EngineCore with a disk tier of the codec: prompt run cold (greedy, EOS ignored), device "
              "blocks spilled to host, host flushed to disk and cleared, prompt run again with its full "
              "blocks loaded from the encoded records; identical = warm tokens equal cold tokens",
}


def report(args: argparse.Namespace, model: dict[str, Any], docs: list[tuple[str, list[int]]],
           windows: list[Window], found: dict[str, Comparison], greedy: dict[str, list[dict[str, Any]]],
           wall: dict[str, float]) -> dict[str, Any]:
    """The JSON document: setting, method, and per codec its figures."""
    block_shape = tuple(model["block_shape"])
    codecs: dict[str, Any] = {}
    for codec in args.codecs:
        rows = greedy.get(codec, [])
        codecs[codec] = {"bytes_per_value": bytes_per_value(codec, block_shape),
                         "block_bytes": kv_codec.encoded_size(codec, "float32", block_shape),
                         **summarise_next_token(found[codec]),
                         "greedy_identical": sum(r["identical"] for r in rows), "greedy_prompts": len(rows),
                         "greedy": rows,
                         "kl_quantiles": _quantiles(found[codec].kl),
                         "by_prefix": by_prefix(windows, found[codec])}
    return {
        "model": model, "method": METHOD,
        "machine": {"cpu": _cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": platform.python_version()},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                 if k not in ("json_out", "plot_out", "docs")} | {"docs": [str(d) for d in args.docs]},
        "documents": [{"name": n, "tokens": len(ids)} for n, ids in docs],
        "windows": [{"doc": w.doc, "prefix": w.prefix, "continuation": w.continuation} for w in windows],
        "wall_s": wall, "codecs": codecs,
    }


def by_prefix(windows: list[Window], found: Comparison) -> dict[str, dict[str, float]]:
    """Top-1 agreement and mean KL per prefix length (does the cost grow with the encoded context?)."""
    groups: dict[int, list[int]] = {}
    start = 0
    for w in windows:  # the comparisons hold the windows' positions in order
        groups.setdefault(w.prefix, []).extend(range(start, start + w.continuation))
        start += w.continuation
    return {str(p): {"positions": len(at), "top1_agreement": float(found.agree[at].mean()),
                     "mean_kl": float(found.kl[at].mean())} for p, at in sorted(groups.items())}


def _quantiles(kl: numpy.ndarray) -> dict[str, float]:
    """KL at a ladder of quantiles (what the plot's distribution is drawn from)."""
    qs = [0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.995, 0.999, 1.0]
    return {f"{q:g}": float(numpy.quantile(kl, q)) for q in qs}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def table(out: dict[str, Any]) -> str:
    """The markdown table of the figures."""
    lines = ["| codec | bytes/value | top-1 agreement | mean KL | p99 KL | max KL | greedy identical |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for codec, c in out["codecs"].items():
        greedy = f"{c['greedy_identical']}/{c['greedy_prompts']}" if c["greedy_prompts"] else "—"
        lines.append(f"| `{codec}` | {_bytes(c['bytes_per_value'])} | {100 * c['top1_agreement']:.2f} % "
                     f"({c['positions'] - c['top1_disagreements']:,}/{c['positions']:,}) | {c['mean_kl']:.2e} | "
                     f"{c['p99_kl']:.2e} | {c['max_kl']:.2e} | {greedy} |")
    return "\n".join(lines)


def _bytes(value: float) -> str:
    return f"{value:.0f}" if value == int(value) else f"{value:.3f}"


def plot(out: dict[str, Any], path: Path) -> None:
    """Left: the KL distribution per lossy codec; right: top-1 agreement and greedy identity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"none": "#999", "bf16": "#27a", "fp16": "#2a7", "int8": "#a72"}
    for codec, c in out["codecs"].items():
        q = c["kl_quantiles"]
        if c["max_kl"] > 0:
            left.plot([max(v, 1e-12) for v in q.values()], [100 * float(k) for k in q], marker="o", ms=3,
                      label=f"{codec} (mean {c['mean_kl']:.1e})", color=colors.get(codec))
    left.set_xscale("log")
    left.set_xlabel("KL(p_none || p_codec), nats (log)")
    left.set_ylabel("positions at or below, %")
    left.set_title(f"next-token KL over {_positions(out):,} positions")
    left.legend(fontsize=8)
    names = list(out["codecs"])
    disagree = [100 * (1 - out["codecs"][n]["top1_agreement"]) for n in names]
    bars = right.bar(names, disagree, color=[colors.get(n, "#555") for n in names])
    for bar, n in zip(bars, names, strict=True):
        c = out["codecs"][n]
        note = f"greedy {c['greedy_identical']}/{c['greedy_prompts']}" if c["greedy_prompts"] else ""
        right.annotate(f"{100 * c['top1_agreement']:.2f} %\n{note}", (bar.get_x() + bar.get_width() / 2,
                       bar.get_height()), ha="center", va="bottom", fontsize=8)
    right.set_ylabel("top-1 disagreement with none, %")
    right.set_ylim(0, max(disagree + [0.1]) * 1.35)
    right.set_title(f"{out['model']['name']}: top-1 and greedy vs none")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _positions(out: dict[str, Any]) -> int:
    return max((c["positions"] for c in out["codecs"].values()), default=0)


def write_outputs(out: dict[str, Any], json_out: Path | None, plot_out: Path | None,
                  log: Callable[[str], None] = say) -> None:
    """The JSON and the plot, where asked for."""
    if json_out is not None:
        json_out.write_text(json.dumps(out, indent=1) + "\n")
        log(f"results written to {json_out}")
    if plot_out is not None:
        plot(out, plot_out)
        log(f"plot written to {plot_out}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    out = run(args)
    out["wall_s"]["total_s"] = time.perf_counter() - t0
    print(table(out))
    write_outputs(out, args.json_out, args.plot_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
