"""Weights bench: an engine's resident memory and its matmul-bound steps, for one or more source trees.

For each tree (``--tree NAME=PATH``, default: this checkout) a worker process imports KVGate from
that tree, builds an `EngineCore` with the server's defaults (native kernels loaded first, so the
engine starts on them) and reports its RSS; then the driver asks the workers in turn, alternating
their order each round and waiting for idle CPUs before each, for:

- **decode**: one step of 16 sequences decoding one token each at 128 tokens of context;
- **prefill1k** / **prefill2k**: one 1,024- / 2,048-token chunk of a cold prompt (its last token
  sampled; 2,048 is a step's default token budget).

Both run through `ModelRunner.execute`, the call a step makes. The figures are medians over every
round (``--rounds`` x ``--repeats`` timings per tree and kind); RSS is read from /proc after the
timings. Compare trees only within one run: the workers share the machine, never at once.

    .venv/bin/python -m bench.weights_bench --tree before=/tmp/before --tree after=.

Needs the default model (converted on first use) or ``--model``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_DECODE_SEQS, _DECODE_CONTEXT, _PREFILL_ROWS = 16, 128, (1024, 2048)


def _rss_mb() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS", "VmHWM", "RssAnon", "RssFile")):
            out[line.split(":")[0]] = int(line.split()[1]) >> 10
    return out


def worker(model: str) -> None:
    """Build the engine, then answer ``<kind> N`` (N timings of a step kind) and ``rss`` lines with JSON."""
    from engine import kernels
    from engine.config import EngineConfig
    from engine.core import EngineCore

    kernels.load()  # the build is at hand: the engine loads it at once instead of in the background
    core = EngineCore(EngineConfig(model=model))
    runner, bs = core.runner, core.block_size
    per_seq = -(-(_DECODE_CONTEXT + 1) // bs)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(_DECODE_SEQS)]
    first = _DECODE_SEQS * per_seq
    vocab = core.vocab_size
    prompts = [[(7 * j + 13 * i) % (vocab - 10) + 5 for j in range(_DECODE_CONTEXT)] for i in range(_DECODE_SEQS)]
    runner.execute(prompts, [0] * _DECODE_SEQS, tables, list(range(_DECODE_SEQS)))  # the decodes' context

    def decode() -> None:
        runner.execute([[5 + i] for i in range(_DECODE_SEQS)], [_DECODE_CONTEXT] * _DECODE_SEQS, tables,
                       list(range(_DECODE_SEQS)))

    def prefill(rows: int) -> Callable[[], None]:
        table = list(range(first, first + -(-rows // bs)))
        chunk = [(11 * j) % (vocab - 10) + 5 for j in range(rows)]
        return lambda: runner.execute([chunk], [0], [table], [0])

    steps = {"decode": decode, **{f"prefill{rows >> 10}k": prefill(rows) for rows in _PREFILL_ROWS}}
    for run in steps.values():
        run()
    print(json.dumps({"ready": True, "native": runner.paged_kernel is not None, "rss_mb": _rss_mb()}), flush=True)
    for line in sys.stdin:
        kind, _, count = line.strip().partition(" ")
        if kind == "rss":
            print(json.dumps({"rss_mb": _rss_mb()}), flush=True)
            continue
        times = []
        for _ in range(int(count or 1)):
            t0 = time.perf_counter()
            steps[kind]()
            times.append(time.perf_counter() - t0)
        print(json.dumps({"seconds": times}), flush=True)


def _idle(threshold: float = 0.9, window: float = 0.3, patience: float = 120.0) -> None:
    """Wait (up to ``patience`` s) until the CPUs were at least ``threshold`` idle over ``window`` s."""
    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]

    deadline = time.time() + patience
    while time.time() < deadline:
        total0, idle0 = sample()
        time.sleep(window)
        total1, idle1 = sample()
        if (idle1 - idle0) >= threshold * max(1, total1 - total0):
            return


class _Worker:
    def __init__(self, name: str, tree: Path, model: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
        self.name = name
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", "--model", model], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} exited with {self.proc.wait()}")
        return dict(json.loads(line))

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.weights_bench", description=__doc__.split("\n\n")[0],
        epilog="Each tree runs in a worker process of its own; compare trees only within one run, on a quiet machine.")
    parser.add_argument("--tree", action="append", default=[],
                        help="NAME=PATH of a KVGate source tree (repeatable; default: this checkout as 'this')")
    parser.add_argument("--model", default="default",
                        help="model: 'default' (SmolLM2-135M-Instruct, converted on first use), 'tiny', or a folder "
                             "(default: default)")
    parser.add_argument("--rounds", type=int, default=7,
                        help="rounds; each asks every tree in turn, the order alternating (default 7)")
    parser.add_argument("--repeats", type=int, default=3, help="timings per kind, tree and round (default 3)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.model)
        return
    trees = [tuple(t.split("=", 1)) for t in args.tree] or [("this", str(Path(__file__).resolve().parents[1]))]
    workers = []
    for name, path in trees:  # one at a time: each start reads and packs the weights
        workers.append(_Worker(name, Path(path), args.model))
        print(f"{name}: ready, native={workers[-1].ready['native']}, rss {workers[-1].ready['rss_mb']}",
              file=sys.stderr, flush=True)
    kinds = ("decode", *(f"prefill{rows >> 10}k" for rows in _PREFILL_ROWS))
    times: dict[str, dict[str, list[float]]] = {w.name: {kind: [] for kind in kinds} for w in workers}
    for r in range(args.rounds):
        for w in workers if r % 2 == 0 else workers[::-1]:
            for kind in kinds:
                _idle()
                times[w.name][kind] += w.ask(f"{kind} {args.repeats}")["seconds"]
    result = {}
    for w in workers:
        result[w.name] = {
            "rss_mb": w.ask("rss")["rss_mb"],
            **{f"{kind}_ms": round(1e3 * statistics.median(v), 2) for kind, v in times[w.name].items()},
            **{f"{kind}_ms_range": [round(1e3 * min(v), 2), round(1e3 * max(v), 2)] for kind, v in times[w.name].items()},
        }
        w.close()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
