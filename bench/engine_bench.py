"""KVGate engine benchmark: throughput and prefix-reuse TTFT against plain transformers.

One run measures, on the same model and the same prompts:

1. Output tokens/s at several concurrency levels for
   - ``plain``:  ``model.generate`` per request, one request at a time (the loop a user writes);
   - ``hf-cb``:  transformers' own continuous batching (``model.generate_batch``, paged cache);
   - ``kvgate``: KVGate's ``EngineCore`` (all requests submitted at once, ``max_num_seqs`` = concurrency).
   Every request is greedy and produces exactly ``--max-tokens`` tokens (EOS ignored); prompts are
   distinct random token ids so prefix caching cannot help.
2. Time to first token of a long prompt, cold vs. with most of it already cached (a second prompt
   sharing the first ``--cached-tokens`` tokens), plus an exact repeat of the cold prompt.

Progress goes to stderr; the markdown tables go to stdout (and optionally JSON and a PNG plot).

    .venv/bin/python -m bench.engine_bench --model small --json-out /tmp/bench.json \\
        --plot-out docs/bench_engine.png

See bench/README.md for what every column means.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import random
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SYSTEMS = ("plain", "hf-cb", "kvgate")
SYSTEM_LABELS = {
    "plain": "plain `model.generate` loop",
    "hf-cb": "transformers continuous batching (`generate_batch`)",
    "kvgate": "KVGate EngineCore",
}

# Full-size defaults (DESIGN.md "The performance bar") and the --quick smoke-test sizes.
DEFAULTS: dict[str, Any] = {
    "concurrency": "1,4,16", "num_requests": 16, "prompt_tokens": 135, "max_tokens": 32,
    "long_prompt_tokens": 2048, "cached_tokens": 1984, "repeats": 3,
}
QUICK: dict[str, Any] = {
    "concurrency": "1,4", "num_requests": 4, "prompt_tokens": 24, "max_tokens": 4,
    "long_prompt_tokens": 160, "cached_tokens": 128, "repeats": 1,
}

_T0 = time.perf_counter()


def log(message: str) -> None:
    """A progress line on stderr, stamped with seconds since start."""
    print(f"[bench {time.perf_counter() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------
class _DefaultsFormatter(argparse.HelpFormatter):
    """Append "(default: X)" to every option that has a real default and does not say it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default:" in text or action.default is None or action.default is False \
                or action.default is argparse.SUPPRESS:
            return text
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine_bench",
        description=(
            "Benchmark KVGate's EngineCore against plain transformers (model.generate per request) and "
            "transformers' continuous batching (generate_batch) on the same model and prompts: output "
            "tokens/s at several concurrency levels, and time-to-first-token of a long prompt cold vs. "
            "with its prefix cached. Progress on stderr, markdown tables on stdout."),
        epilog=(
            "Full-size defaults follow DESIGN.md: 16 requests per level of ~135 random prompt tokens and 32 "
            "greedy new tokens (EOS ignored), concurrency 1,4,16; a 2,048-token prompt whose first 1,984 "
            "tokens are then reused. --quick shrinks everything for a seconds-long smoke test; explicit "
            "options still override it. Example: python -m bench.engine_bench --model small "
            "--json-out /tmp/bench_engine.json --plot-out docs/bench_engine.png"),
        formatter_class=_DefaultsFormatter,
    )
    p.add_argument("--model", default="small",
                   help="model alias (tiny | small | default = SmolLM2-135M-Instruct) or a local HF folder")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and KV dtype, the same for every system")
    p.add_argument("--device", default="cpu", help="torch device for every system (cpu, cuda, auto)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads for every system (default: torch's own choice)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--concurrency", default=None,
                   help=f"comma-separated concurrency levels (default: {DEFAULTS['concurrency']})")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per concurrency level, rounded up to a multiple of the level "
                        f"(default: {DEFAULTS['num_requests']})")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help=f"prompt length of each throughput request (default: {DEFAULTS['prompt_tokens']})")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"new tokens per throughput request, exactly (default: {DEFAULTS['max_tokens']})")
    p.add_argument("--long-prompt-tokens", type=int, default=None,
                   help=f"length of the TTFT prompt (default: {DEFAULTS['long_prompt_tokens']})")
    p.add_argument("--cached-tokens", type=int, default=None,
                   help="prefix the second TTFT prompt shares with the first (ideally a multiple of "
                        f"--block-size) (default: {DEFAULTS['cached_tokens']})")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"runs per measurement; tables report the median (default: {DEFAULTS['repeats']})")
    p.add_argument("--skip-throughput", action="store_true", help="skip the throughput section")
    p.add_argument("--skip-ttft", action="store_true", help="skip the prefix-reuse TTFT section")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes for a smoke test: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    p.add_argument("--block-size", type=int, default=16, help="KVGate KV block size (tokens)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KVGate KV pool blocks (default: 1024, or more if the workload needs it)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="per-step token budget of KVGate, also hf-cb's max_batch_tokens")
    p.add_argument("--hf-cb-page-size", type=int, default=256,
                   help="page size (tokens) of transformers' paged cache; 256 is transformers' own default")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--json-out", type=Path, default=None, help="also write all results as JSON here")
    p.add_argument("--plot-out", type=Path, default=None,
                   help="also draw a PNG plot here (needs matplotlib), e.g. docs/bench_engine.png")
    return p


def resolve_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else DEFAULTS
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    except ValueError:
        parser.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    args.system_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.system_list if s not in SYSTEMS]
    if unknown or not args.system_list:
        parser.error(f"--systems must be a subset of {','.join(SYSTEMS)}, got {args.systems!r}")
    if not args.levels or any(c <= 0 for c in args.levels):
        parser.error("--concurrency levels must be positive integers")
    for name in ("num_requests", "prompt_tokens", "max_tokens", "long_prompt_tokens", "repeats",
                 "block_size", "max_num_batched_tokens", "hf_cb_page_size"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.threads is not None and args.threads <= 0:
        parser.error("--threads must be positive")
    if not 0 < args.cached_tokens < args.long_prompt_tokens:
        parser.error("--cached-tokens must be between 1 and --long-prompt-tokens - 1")
    if args.cached_tokens % args.block_size:
        log(f"note: --cached-tokens {args.cached_tokens} is not a multiple of --block-size "
            f"{args.block_size}; KVGate caches only full blocks")
    return args


# ---------------------------------------------------------------------------------------------
# machine facts and prompts
# ---------------------------------------------------------------------------------------------
def machine_facts(torch: Any, transformers: Any) -> dict[str, Any]:
    cpu_model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count()
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover
        load = None
    return {
        "cpu_model": cpu_model, "cpu_count": os.cpu_count(), "usable_cores": usable,
        "load_avg_1m": load, "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "platform": platform.platform(),
    }


class PromptMaker:
    """Distinct random prompts over the tokenizer's ordinary (non-special) token ids."""

    def __init__(self, vocab_size: int, special_ids: Sequence[int], seed: int) -> None:
        special = set(special_ids)
        self.ids = [i for i in range(vocab_size) if i not in special]
        self.seed = seed

    def make(self, tag: str, count: int, length: int) -> list[list[int]]:
        rng = random.Random(f"{self.seed}/{tag}")
        prompts, seen = [], set()
        while len(prompts) < count:
            p = [rng.choice(self.ids) for _ in range(length)]
            if tuple(p[:16]) not in seen:  # distinct from the first block on: no prefix sharing
                seen.add(tuple(p[:16]))
                prompts.append(p)
        return prompts


def median_or_none(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


# ---------------------------------------------------------------------------------------------
# the three systems
# ---------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    output_tokens: int
    wall_s: float
    outputs: list[list[int]]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else float("nan")


class PlainHF:
    """``model.generate`` one request at a time."""

    def __init__(self, torch: Any, model: Any, pad_id: int, eos_ids: list[int]) -> None:
        self.torch, self.model, self.pad_id, self.eos_ids = torch, model, pad_id, eos_ids

    def _config(self, max_new: int) -> Any:
        from transformers import GenerationConfig

        # min_new_tokens = max_new_tokens: EOS is suppressed, every request yields exactly max_new.
        return GenerationConfig(do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
                                pad_token_id=self.pad_id, eos_token_id=self.eos_ids or None)

    def generate_one(self, prompt: list[int], max_new: int) -> list[int]:
        torch = self.torch
        ids = torch.tensor([prompt], device=self.model.device)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      generation_config=self._config(max_new))
        return out[0, len(prompt):].tolist()

    def throughput(self, prompts: list[list[int]], max_new: int, concurrency: int) -> RunResult:
        del concurrency  # the plain loop serves outstanding requests one after another
        t0 = time.perf_counter()
        outputs = [self.generate_one(p, max_new) for p in prompts]
        wall = time.perf_counter() - t0
        return RunResult(sum(len(o) for o in outputs), wall, outputs)

    def ttft(self, prompt: list[int]) -> float:
        t0 = time.perf_counter()
        self.generate_one(prompt, 1)
        return time.perf_counter() - t0


class HFContinuousBatching:
    """transformers' ``generate_batch`` (paged cache, continuous batching)."""

    def __init__(self, model: Any, args: argparse.Namespace) -> None:
        from transformers import GenerationConfig

        try:
            from transformers import ContinuousBatchingConfig
        except ImportError:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
        if not hasattr(model, "generate_batch"):
            raise RuntimeError(f"transformers has no generate_batch on {type(model).__name__}")
        self.model, self.args = model, args
        self.GenerationConfig, self.CBConfig = GenerationConfig, ContinuousBatchingConfig
        self.orig_attn = getattr(model.config, "_attn_implementation", None)

    def _restore_attn(self) -> None:
        """generate_batch may switch the attention implementation; put the plain one back."""
        now = getattr(self.model.config, "_attn_implementation", None)
        if self.orig_attn and now != self.orig_attn and hasattr(self.model, "set_attn_implementation"):
            self.model.set_attn_implementation(self.orig_attn)

    def _num_pages(self, lengths: Sequence[int]) -> int:
        page = self.args.hf_cb_page_size
        return sum(-(-n // page) for n in lengths) + 8

    def _generate(self, prompts: list[list[int]], max_new: int, cb_config: Any, **kw: Any) -> dict[str, Any]:
        gen = self.GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=-1)
        try:
            out = self.model.generate_batch(prompts, generation_config=gen,
                                            continuous_batching_config=cb_config, progress_bar=False, **kw)
        finally:
            self._restore_attn()
        results = list(out.values())
        errors = [r.error for r in results if r.error]
        if len(results) != len(prompts) or errors:
            raise RuntimeError(f"generate_batch returned {len(results)}/{len(prompts)} results; "
                               f"errors: {errors[:2]}")
        return out

    def throughput(self, prompts: list[list[int]], max_new: int, concurrency: int) -> RunResult:
        cb = self.CBConfig(
            max_requests_per_batch=concurrency, max_batch_tokens=self.args.max_num_batched_tokens,
            page_size=self.args.hf_cb_page_size,
            num_blocks=self._num_pages([len(p) + max_new for p in prompts]))
        t0 = time.perf_counter()
        out = self._generate(prompts, max_new, cb)
        wall = time.perf_counter() - t0
        # Results come back keyed by request id in input order; timestamps are perf_counter seconds.
        results = list(out.values())
        start = min(r.created_time for r in results)
        end = max(r.lifespan[1] for r in results)
        span = end - start if end > start else wall
        outputs = [list(r.generated_tokens) for r in results]
        # tok/s uses the in-manager span (first request created -> last finished), which leaves out
        # generate_batch's manager setup/teardown; the full call time is kept as wall_incl_setup_s.
        return RunResult(sum(len(o) for o in outputs), span, outputs, {"wall_incl_setup_s": wall})

    # TTFT through a persistent manager, so its prefix cache survives between calls.
    def ttft_setup(self, long_len: int, repeats: int) -> None:
        self.ttft_cb = self.CBConfig(max_batch_tokens=self.args.max_num_batched_tokens,
                                     page_size=self.args.hf_cb_page_size,
                                     num_blocks=self._num_pages([long_len + 1] * (3 * repeats + 2)))

    def ttft(self, prompt: list[int]) -> float:
        out = self._generate([prompt], 1, self.ttft_cb, persistent_manager=True, record_timestamps=True)
        r = next(iter(out.values()))
        first = r.timestamps[0] if r.timestamps else r.lifespan[1]
        return first - r.created_time

    def close(self) -> None:
        destroy = getattr(self.model, "destroy_cached_continuous_batching_manager", None)
        if destroy is not None:
            destroy()
        self._restore_attn()


class KVGate:
    """KVGate's EngineCore: submit every request at once, step until all are done."""

    def __init__(self, torch: Any, loaded: Any, args: argparse.Namespace) -> None:
        from engine.config import EngineConfig
        from engine.core import EngineCore
        from engine.outputs import GenerateRequest
        from engine.sampling_params import SamplingParams

        self.torch, self.loaded, self.args = torch, loaded, args
        self.EngineConfig, self.EngineCore = EngineConfig, EngineCore
        self.GenerateRequest, self.SamplingParams = GenerateRequest, SamplingParams
        self._ids = 0
        self.warmup_prompt: list[int] = [1 + i for i in range(8)]

    def _blocks_for(self, lengths: Sequence[int]) -> int:
        need = sum(-(-n // self.args.block_size) for n in lengths) + 16
        return self.args.num_blocks or max(1024, need)

    def new_engine(self, max_num_seqs: int, lengths: Sequence[int]) -> Any:
        args = self.args
        config = self.EngineConfig(
            model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
            num_blocks=self._blocks_for(lengths), max_num_seqs=max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.threads,
            max_model_len=max(4096, args.long_prompt_tokens + 1, args.prompt_tokens + args.max_tokens))
        core = self.EngineCore(config, loaded=self.loaded)
        self._run(core, [self.warmup_prompt], 2, salt="warmup")  # lazy init, not timed
        return core

    def _submit(self, core: Any, prompts: list[list[int]], max_new: int, salt: str) -> list[str]:
        params = self.SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
        ids = []
        for p in prompts:
            self._ids += 1
            rid = f"bench-{self._ids}"
            core.add_request(self.GenerateRequest(rid, list(p), params, cache_salt=salt))
            ids.append(rid)
        return ids

    def _run(self, core: Any, prompts: list[list[int]], max_new: int, salt: str) -> list[list[int]]:
        ids = self._submit(core, prompts, max_new, salt)
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        while core.has_work():
            for out in core.step():
                tokens[out.request_id].append(out.token_id)
        return [tokens[rid] for rid in ids]

    def throughput(self, core: Any, prompts: list[list[int]], max_new: int, salt: str) -> RunResult:
        c0 = _counter_snapshot(core)
        t0 = time.perf_counter()
        outputs = self._run(core, prompts, max_new, salt)
        wall = time.perf_counter() - t0
        c1 = _counter_snapshot(core)
        extra = {k: c1[k] - c0[k] for k in c1}
        return RunResult(sum(len(o) for o in outputs), wall, outputs, extra)

    def ttft(self, core: Any, prompt: list[int], salt: str) -> tuple[float, int]:
        """Add one request, step until its first token: (seconds, cached prompt tokens)."""
        t0 = time.perf_counter()
        self._submit(core, [prompt], 1, salt)
        first: float | None = None
        cached = 0
        while core.has_work():
            outs = core.step()
            if outs and first is None:
                first = time.perf_counter() - t0
                cached = int(getattr(outs[0], "num_cached_tokens", 0) or 0)
        if first is None:
            raise RuntimeError("the engine finished without producing a token")
        return first, cached


def _counter_snapshot(core: Any) -> dict[str, float]:
    c = core.counters
    return {k: getattr(c, k) for k in ("steps", "step_time_s", "forward_time_s", "sample_time_s",
                                       "computed_tokens", "generated_tokens") if hasattr(c, k)}


# ---------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------
def _fail(results: dict[str, Any], key: str, system: str, exc: BaseException) -> None:
    reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    results.setdefault(key, {})[system] = reason
    log(f"{system} failed: {reason}")
    traceback.print_exc(file=sys.stderr)


def bench_throughput(args: argparse.Namespace, prompts: PromptMaker, plain: PlainHF | None,
                     hfcb: HFContinuousBatching | None, kvgate: KVGate | None,
                     failures: dict[str, Any]) -> dict[str, Any]:
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {s: {c: [] for c in args.levels} for s in SYSTEMS}
    agreement: dict[str, dict[int, list[int]]] = {s: {c: [] for c in args.levels} for s in SYSTEMS}
    dead: set[str] = set()
    for r in range(args.repeats):
        for c in args.levels:
            n = -(-max(args.num_requests, c) // c) * c
            batch = prompts.make(f"throughput/c{c}/r{r}", n, args.prompt_tokens)
            reference: list[list[int]] | None = None
            for system in args.system_list:
                if system in dead:
                    continue
                try:
                    if system == "plain" and plain is not None:
                        res = plain.throughput(batch, args.max_tokens, c)
                    elif system == "hf-cb" and hfcb is not None:
                        res = hfcb.throughput(batch, args.max_tokens, c)
                    elif system == "kvgate" and kvgate is not None:
                        core = kvgate.new_engine(c, [len(p) + args.max_tokens for p in batch])
                        res = kvgate.throughput(core, batch, args.max_tokens, salt=f"tp-c{c}-r{r}")
                        del core
                        gc.collect()
                    else:
                        continue
                except Exception as exc:  # noqa: BLE001 - reported in the table
                    _fail(failures, "throughput", system, exc)
                    dead.add(system)
                    continue
                if any(len(o) != args.max_tokens for o in res.outputs):
                    log(f"warning: {system} produced {sorted({len(o) for o in res.outputs})} tokens "
                        f"per request, expected {args.max_tokens}")
                if system == "plain":
                    reference = res.outputs
                if reference is not None and system != "plain":
                    agree = sum(a == b for a, b in zip(reference, res.outputs, strict=True))
                    agreement[system][c].append(agree)
                runs[system][c].append({"requests": n, "output_tokens": res.output_tokens,
                                        "wall_s": res.wall_s, "tok_s": res.tok_s, **res.extra})
                log(f"throughput r{r + 1}/{args.repeats} c={c:<3} {system:<7} {res.output_tokens} tokens "
                    f"in {res.wall_s:.2f}s = {res.tok_s:.1f} tok/s")
    summary: dict[str, Any] = {}
    for system in args.system_list:
        if system in failures.get("throughput", {}):
            summary[system] = {"error": failures["throughput"][system]}
            continue
        summary[system] = {}
        for c in args.levels:
            rs = runs[system][c]
            summary[system][str(c)] = {
                "median_tok_s": median_or_none([x["tok_s"] for x in rs]),
                **({"median_tok_s_incl_setup": median_or_none(
                    [x["output_tokens"] / x["wall_incl_setup_s"] for x in rs])} if system == "hf-cb" else {}),
                "runs": rs,
                "greedy_agreement_with_plain": agreement[system][c] or None,
            }
    return summary


def bench_ttft(args: argparse.Namespace, prompts: PromptMaker, plain: PlainHF | None,
               hfcb: HFContinuousBatching | None, kvgate: KVGate | None,
               failures: dict[str, Any]) -> dict[str, Any]:
    L, K, R = args.long_prompt_tokens, args.cached_tokens, args.repeats
    warm = prompts.make("ttft/warmup", 1, L)[0]
    pairs = []
    for r in range(R):
        cold = prompts.make(f"ttft/cold/r{r}", 1, L)[0]
        tail = prompts.make(f"ttft/tail/r{r}", 1, L - K)[0]
        if tail[0] == cold[K]:
            tail[0] = next(t for t in prompts.ids if t != cold[K])
        pairs.append((cold, cold[:K] + tail))
    out: dict[str, Any] = {}

    if plain is not None:
        try:
            log(f"ttft plain: warm-up on a {L}-token prompt")
            plain.ttft(warm)
            cold_s = []
            for r, (cold, _shared) in enumerate(pairs):
                cold_s.append(plain.ttft(cold))
                log(f"ttft r{r + 1}/{R} plain   cold {cold_s[-1]:.3f}s")
            out["plain"] = {"cold_s": cold_s, "cached_s": [], "repeat_s": [], "cached_tokens": []}
        except Exception as exc:  # noqa: BLE001
            _fail(failures, "ttft", "plain", exc)

    if hfcb is not None:
        try:
            hfcb.ttft_setup(L, R)
            log(f"ttft hf-cb: warm-up on a {L}-token prompt (persistent manager)")
            hfcb.ttft(warm)
            res: dict[str, list[Any]] = {"cold_s": [], "cached_s": [], "repeat_s": [], "cached_tokens": []}
            for r, (cold, shared) in enumerate(pairs):
                res["cold_s"].append(hfcb.ttft(cold))
                res["cached_s"].append(hfcb.ttft(shared))
                res["repeat_s"].append(hfcb.ttft(cold))
                log(f"ttft r{r + 1}/{R} hf-cb   cold {res['cold_s'][-1]:.3f}s  shared-prefix "
                    f"{res['cached_s'][-1]:.3f}s  exact repeat {res['repeat_s'][-1]:.3f}s")
            out["hf-cb"] = res
        except Exception as exc:  # noqa: BLE001
            _fail(failures, "ttft", "hf-cb", exc)
        finally:
            try:
                hfcb.close()
            except Exception:  # noqa: BLE001
                pass

    if kvgate is not None:
        try:
            core = kvgate.new_engine(16, [L + 1] * (3 * R + 1))
            log(f"ttft kvgate: warm-up on a {L}-token prompt")
            kvgate.ttft(core, warm, salt="ttft-warmup")
            res = {"cold_s": [], "cached_s": [], "repeat_s": [], "cached_tokens": [],
                   "cold_cached_tokens": [], "repeat_cached_tokens": []}
            for r, (cold, shared) in enumerate(pairs):
                salt = f"ttft-r{r}"  # a fresh salt per repeat: the cold run is really cold
                t, n0 = kvgate.ttft(core, cold, salt)
                res["cold_s"].append(t)
                res["cold_cached_tokens"].append(n0)
                t, n1 = kvgate.ttft(core, shared, salt)
                res["cached_s"].append(t)
                res["cached_tokens"].append(n1)
                t, n2 = kvgate.ttft(core, cold, salt)
                res["repeat_s"].append(t)
                res["repeat_cached_tokens"].append(n2)
                log(f"ttft r{r + 1}/{R} kvgate  cold {res['cold_s'][-1]:.3f}s ({n0} cached)  shared-prefix "
                    f"{res['cached_s'][-1]:.3f}s ({n1} cached)  exact repeat {res['repeat_s'][-1]:.3f}s "
                    f"({n2} cached)")
            out["kvgate"] = res
            del core
            gc.collect()
        except Exception as exc:  # noqa: BLE001
            _fail(failures, "ttft", "kvgate", exc)

    for res in out.values():
        cold_m, cached_m = median_or_none(res["cold_s"]), median_or_none(res["cached_s"])
        res["median_cold_s"] = cold_m
        res["median_cached_s"] = cached_m
        res["median_repeat_s"] = median_or_none(res["repeat_s"])
        res["cold_over_cached"] = cold_m / cached_m if cold_m and cached_m else None
        res["median_cached_tokens"] = median_or_none(res["cached_tokens"])
    for system, reason in failures.get("ttft", {}).items():
        out[system] = {"error": reason}
    return out


# ---------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------
def _fmt(x: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "—" if x is None else f"{x:{spec}}{suffix}"


def _tok_s(tp: dict[str, Any], system: str, c: int) -> float | None:
    entry = tp.get(system, {})
    return None if "error" in entry else entry.get(str(c), {}).get("median_tok_s")


def _ratio(a: float | None, b: float | None) -> str:
    return "—" if not a or not b else f"{a / b:.2f}×"


def render(args: argparse.Namespace, facts: dict[str, Any], tp: dict[str, Any] | None,
           ttft: dict[str, Any] | None) -> str:
    lines = [f"## KVGate engine benchmark — model `{args.model}` ({args.dtype}, {args.device})", ""]
    lines.append(
        f"Machine: {facts['cpu_model'] or 'unknown CPU'}; {facts['usable_cores']} usable cores "
        f"({facts['cpu_count']} total), torch threads {facts['torch_threads']}, torch {facts['torch']}, "
        f"transformers {facts['transformers']}, Python {facts['python']}, load avg at start "
        f"{_fmt(facts['load_avg_1m'], '.2f')}. Medians over {args.repeats} run(s).")
    lines.append("")
    if tp is not None:
        lines += [f"### Throughput: output tokens/s ({args.num_requests} requests per level of "
                  f"{args.prompt_tokens} random prompt tokens, {args.max_tokens} greedy new tokens each)", ""]
        head = "| system | " + " | ".join(f"c={c}" for c in args.levels) + " |"
        lines += [head, "|---|" + "---:|" * len(args.levels)]
        for system in args.system_list:
            entry = tp.get(system, {})
            if "error" in entry:
                cells = [f"n/a ({entry['error']})"] + [""] * (len(args.levels) - 1)
            else:
                cells = [_fmt(_tok_s(tp, system, c)) for c in args.levels]
            lines.append(f"| {SYSTEM_LABELS[system]} | " + " | ".join(cells) + " |")
            if system == "hf-cb" and "error" not in entry:
                cells = [_fmt(entry.get(str(c), {}).get("median_tok_s_incl_setup")) for c in args.levels]
                lines.append("| ↳ same, counting `generate_batch` setup/teardown | " + " | ".join(cells) + " |")
        if "kvgate" in args.system_list:
            for base in ("plain", "hf-cb"):
                if base in args.system_list:
                    cells = [_ratio(_tok_s(tp, "kvgate", c), _tok_s(tp, base, c)) for c in args.levels]
                    lines.append(f"| **ratio KVGate / {base}** | " + " | ".join(cells) + " |")
        agree_notes = []
        for system in ("hf-cb", "kvgate"):
            entry = tp.get(system, {})
            if system in args.system_list and "error" not in entry and "plain" in args.system_list:
                parts = []
                for c in args.levels:
                    ag = entry.get(str(c), {}).get("greedy_agreement_with_plain")
                    runs = entry.get(str(c), {}).get("runs", [])
                    if ag:
                        parts.append(f"c={c}: {min(ag)}/{runs[0]['requests']}")
                if parts:
                    agree_notes.append(f"{system} " + ", ".join(parts))
        if agree_notes:
            lines += ["", "Greedy outputs identical to the plain loop's (worst run): " + "; ".join(agree_notes)
                      + ". Batched float math may flip near-ties, so a few differences are not a bug by "
                        "themselves."]
        lines.append("")
    if ttft is not None:
        lines += [f"### Prefix reuse: TTFT of a {args.long_prompt_tokens}-token prompt", "",
                  f"cold = nothing cached; cached = a second prompt sharing the first {args.cached_tokens} "
                  "tokens; exact repeat = the cold prompt again.", "",
                  "| system | cold (s) | cached (s) | cold / cached | cached tokens | exact repeat (s) |",
                  "|---|---:|---:|---:|---:|---:|"]
        for system in args.system_list:
            res = ttft.get(system)
            if res is None:
                continue
            if "error" in res:
                lines.append(f"| {SYSTEM_LABELS[system]} | n/a ({res['error']}) | | | | |")
                continue
            cached_tok = res["median_cached_tokens"]
            if system == "plain":
                cached_cell, ratio_cell, tok_cell, rep_cell = "— (no reuse)", "—", "0", "—"
            else:
                cached_cell = _fmt(res["median_cached_s"], ".3f")
                ratio_cell = _fmt(res["cold_over_cached"], ".1f", "×")
                tok_cell = "not reported" if system == "hf-cb" else _fmt(cached_tok, ".0f")
                rep_cell = _fmt(res["median_repeat_s"], ".3f")
            lines.append(f"| {SYSTEM_LABELS[system]} | {_fmt(res['median_cold_s'], '.3f')} | {cached_cell} | "
                         f"{ratio_cell} | {tok_cell} | {rep_cell} |")
        lines.append("")
    return "\n".join(lines)


def plot(path: Path, args: argparse.Namespace, tp: dict[str, Any] | None, ttft: dict[str, Any] | None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot. Lead: add matplotlib to the `dev` extra in pyproject.toml")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"plain": "#888888", "hf-cb": "#e69f00", "kvgate": "#0072b2"}
    systems = [s for s in args.system_list]
    ax = axes[0]
    if tp is not None:
        width = 0.8 / max(len(systems), 1)
        for i, s in enumerate(systems):
            vals = [_tok_s(tp, s, c) or 0.0 for c in args.levels]
            xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(args.levels))]
            bars = ax.bar(xs, vals, width, label=s, color=colors[s])
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(range(len(args.levels)), [f"c={c}" for c in args.levels])
        ax.set_ylabel("output tokens/s (median)")
        ax.set_title(f"Throughput ({args.prompt_tokens}-token prompts, {args.max_tokens} new tokens)")
        ax.margins(y=0.12)
        ax.legend(loc="upper left", fontsize=8)
    else:
        ax.set_axis_off()
    ax = axes[1]
    if ttft is not None:
        names, cold, cached_x, cached = [], [], [], []
        for s in systems:
            res = ttft.get(s)
            if not res or "error" in res or not res.get("median_cold_s"):
                continue
            names.append(s)
            cold.append(res["median_cold_s"])
            if res.get("median_cached_s"):  # the plain loop has no reuse: no bar
                cached_x.append(len(names) - 1)
                cached.append(res["median_cached_s"])
        xs = list(range(len(names)))
        b1 = ax.bar([x - 0.2 for x in xs], cold, 0.4, label="cold", color="#cc79a7")
        b2 = ax.bar([x + 0.2 for x in cached_x], cached, 0.4, label=f"{args.cached_tokens} tokens cached",
                    color="#009e73")
        ax.bar_label(b1, fmt="%.2f", fontsize=8)
        ax.bar_label(b2, fmt="%.3f", fontsize=8)
        ax.set_xticks(xs, names)
        ax.set_yscale("log")
        ax.set_ylabel("time to first token, s (median, log scale)")
        ax.set_title(f"TTFT of a {args.long_prompt_tokens}-token prompt")
        ax.margins(y=0.15)
        ax.legend(loc="lower left", fontsize=8)
    else:
        ax.set_axis_off()
    fig.suptitle(f"KVGate engine benchmark — {args.model}, {args.dtype}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log(f"wrote plot {path}")


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def _quiet_libraries() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:  # pragma: no cover
        pass
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning, module="transformers")


def _safe(label: str, build: Callable[[], Any], failures: dict[str, Any], system: str) -> Any:
    try:
        return build()
    except Exception as exc:  # noqa: BLE001
        for key in ("throughput", "ttft"):
            failures.setdefault(key, {})[system] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        log(f"{label} unavailable: {exc}")
        traceback.print_exc(file=sys.stderr)
        return None


def main(argv: Sequence[str] | None = None) -> int:
    args = resolve_args(argv)
    import torch
    import transformers

    from engine.model import load_model

    _quiet_libraries()
    if args.threads:
        torch.set_num_threads(args.threads)
    facts = machine_facts(torch, transformers)
    log("machine: " + ", ".join(f"{k}={v}" for k, v in facts.items()))
    log(f"config: model={args.model} dtype={args.dtype} systems={','.join(args.system_list)} "
        f"concurrency={args.levels} requests/level={args.num_requests} prompt={args.prompt_tokens} "
        f"max_tokens={args.max_tokens} long_prompt={args.long_prompt_tokens} cached={args.cached_tokens} "
        f"repeats={args.repeats}")

    failures: dict[str, Any] = {}
    t = time.perf_counter()
    hf_loaded = load_model(args.model, args.dtype, args.device)  # plain + hf-cb share these weights
    log(f"loaded {hf_loaded.name} from {hf_loaded.path} in {time.perf_counter() - t:.1f}s "
        f"({sum(p.numel() for p in hf_loaded.model.parameters()) / 1e6:.1f}M params)")
    tok = hf_loaded.tokenizer
    vocab = min(int(hf_loaded.config.vocab_size), len(tok))
    prompts = PromptMaker(vocab, getattr(tok, "all_special_ids", []) or [], args.seed)
    eos = list(hf_loaded.eos_token_ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0)
    short = prompts.make("warmup", 1, args.prompt_tokens)[0]  # warm-up: workload-shaped, 2 new tokens

    plain = hfcb = kvgate = None
    if "plain" in args.system_list:
        plain = _safe("plain", lambda: PlainHF(torch, hf_loaded.model, pad, eos), failures, "plain")
        if plain is not None:
            log("warm-up: plain")
            plain.generate_one(short, 2)
    if "hf-cb" in args.system_list:
        hfcb = _safe("hf-cb", lambda: HFContinuousBatching(hf_loaded.model, args), failures, "hf-cb")
        if hfcb is not None:
            log("warm-up: hf-cb")
            try:
                hfcb.throughput([short], 2, 1)
            except Exception as exc:  # noqa: BLE001
                _fail(failures, "throughput", "hf-cb", exc)
                failures.setdefault("ttft", {})["hf-cb"] = failures["throughput"]["hf-cb"]
                hfcb = None
    if "kvgate" in args.system_list:
        # KVGate installs its own attention on the model it runs, so it gets its own copy.
        def build_kvgate() -> KVGate:
            return KVGate(torch, load_model(args.model, args.dtype, args.device), args)

        log("loading a second copy of the model for kvgate")
        kvgate = _safe("kvgate", build_kvgate, failures, "kvgate")
        if kvgate is not None:
            kvgate.warmup_prompt = short

    tp = None
    if not args.skip_throughput:
        log("== throughput ==")
        tp = bench_throughput(args, prompts, plain, hfcb, kvgate, failures)
    ttft = None
    if not args.skip_ttft:
        log("== prefix-reuse TTFT ==")
        ttft = bench_ttft(args, prompts, plain, hfcb, kvgate, failures)

    report = render(args, facts, tp, ttft)
    print(report, flush=True)
    if args.json_out:
        payload = {
            "machine": facts,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "throughput": tp, "ttft": ttft, "failures": failures,
            "model": {"name": hf_loaded.name, "path": hf_loaded.path},
        }
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(payload, indent=2, default=str))
        log(f"wrote {args.json_out}")
    if args.plot_out:
        plot(args.plot_out, args, tp, ttft)
    hard = {s for section in ("throughput", "ttft") for s in failures.get(section, {}) if s != "hf-cb"}
    return 1 if hard else 0


if __name__ == "__main__":
    sys.exit(main())
