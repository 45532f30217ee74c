"""Linear-layer bench (issue 36, items 1 and 2): the matmuls of a decode step and of prefill
chunks, as fractions of what this machine can do, all measured in one run.

    peaks    FMA GFLOP/s with every thread busy (engine/csrc/calibrate.cpp) and the rate at which
             all threads read memory (a 1 GiB tensor, the best of 5 passes)
    decode   one step's linear layers at 1-32 rows (every layer's q|k|v, o, gate|up with SiLU,
             down, then the output head): the weights stream from memory once per step (they are
             far larger than the caches), so the figure is weight bytes / step time, in GB/s and
             as a share of the measured read rate
    prefill  the layers' linears (no head) at 64-2,048 rows: 2 x rows x parameters / time, in
             GFLOP/s and as a share of the measured FMA peak (in bfloat16, of the measured
             `vdpbf16ps` rate where the CPU has it: two products per lane per instruction)

Backends, each holding its own copy of the same random weights: ``panel`` (KVGate's kernel,
engine/csrc/panel_gemm.cpp, what the engine runs in float32; in bfloat16 panel_gemm_bf16.cpp, on
CPUs with AVX512-BF16 or AVX2), ``onednn`` (the blocked layout
torch's mkldnn linear multiplies, engine/packing.py's fallback) and ``mkl`` (``F.linear`` on the
plain weight). The shapes default to SmolLM2-135M (the default model); ``--dtype bfloat16`` runs
the backends that take bfloat16 weights. Times are medians of ``--repeats`` after a warm-up.
The process runs as the engine's does: large tensors on transparent huge pages
(``THP_MEM_ALLOC_ENABLE=1`` unless set) and freed activations kept mapped (engine/heap.py), so a
2,048-row output is not written into freshly faulted pages every call.

    .venv/bin/python -m bench.linear_bench --json-out docs/bench_linear.json --plot-out docs/bench_linear.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

BACKENDS = ("panel", "onednn", "mkl")


def say(message: str) -> None:
    print(f"[linear_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.linear_bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Progress goes to stderr, the tables to stdout (markdown).")
    p.add_argument("--layers", type=int, default=30, help="decoder layers (default 30, SmolLM2-135M)")
    p.add_argument("--hidden", type=int, default=576, help="hidden size (default 576)")
    p.add_argument("--intermediate", type=int, default=1536, help="MLP intermediate size (default 1536)")
    p.add_argument("--q-heads", type=int, default=9, help="query heads (default 9)")
    p.add_argument("--kv-heads", type=int, default=3, help="key/value heads (default 3)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (default 64)")
    p.add_argument("--vocab", type=int, default=49152, help="output head rows (default 49152; 0 = no head)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="weight and activation dtype (default float32)")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help=f"comma-separated subset of {','.join(BACKENDS)} (default all that take the dtype)")
    p.add_argument("--decode-rows", default="1,4,8,16,32", help="rows of the decode steps (default 1,4,8,16,32)")
    p.add_argument("--prefill-rows", default="64,256,1024,2048",
                   help="rows of the prefill chunks (default 64,256,1024,2048)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per figure, the median counts (default 7)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    p.add_argument("--json-out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--plot-out", type=Path, default=None, help="write a PNG plot here (needs matplotlib)")
    args = p.parse_args(argv)
    args.backend_list = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in args.backend_list if b not in BACKENDS]
    if unknown:
        p.error(f"unknown backend(s) {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
    try:
        args.decode_list = [int(r) for r in args.decode_rows.split(",") if r.strip()]
        args.prefill_list = [int(r) for r in args.prefill_rows.split(",") if r.strip()]
    except ValueError:
        p.error("--decode-rows and --prefill-rows take comma-separated whole numbers, e.g. 1,8,16")
    if any(r <= 0 for r in args.decode_list + args.prefill_list) or args.repeats <= 0:
        p.error("row counts and --repeats must be positive")
    return args


@dataclass
class Layer:
    """One decoder layer's linears in one backend's form: x -> q|k|v, o, SiLU(gate) * up, down."""

    qkv: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    mlp_in: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]


def weights(args: argparse.Namespace, dtype: torch.dtype, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    qkv_out = (args.q_heads + 2 * args.kv_heads) * args.head_dim

    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=g) * 0.02).to(dtype)

    return [{"qkv": w(qkv_out, args.hidden), "o": w(args.hidden, args.q_heads * args.head_dim),
             "gate_up": w(2 * args.intermediate, args.hidden), "down": w(args.hidden, args.intermediate)}
            for _ in range(args.layers)]


def build(backend: str, tensors: list[dict[str, torch.Tensor]], head: torch.Tensor | None, intermediate: int,
          ops: Any) -> tuple[list[Layer], Callable[[torch.Tensor], torch.Tensor] | None]:
    from engine.packing import PackedLinear, use_panel_kernel

    if backend == "mkl":
        def plain(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
            return lambda x: F.linear(x, weight)

        def gated_plain(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
            def run(x: torch.Tensor) -> torch.Tensor:
                gate, up = F.linear(x, weight).split(intermediate, dim=-1)
                return F.silu(gate) * up
            return run

        layers = [Layer(plain(t["qkv"]), plain(t["o"]), gated_plain(t["gate_up"]), plain(t["down"])) for t in tensors]
        return layers, None if head is None else plain(head)
    modules: list[PackedLinear] = []

    def packed(weight: torch.Tensor, gated: int | None = None) -> PackedLinear:
        module = PackedLinear(weight, None, gated=gated)
        modules.append(module)
        return module

    layers_modules = [(packed(t["qkv"]), packed(t["o"]), packed(t["gate_up"], intermediate), packed(t["down"]))
                      for t in tensors]
    head_module = packed(head) if head is not None else None
    if backend == "panel":
        bf16 = (ops.panel_linear_bf16, ops.pack_panels_bf16, ops.gated_panel_linear_bf16) if ops.bf16_panels else None
        use_panel_kernel(modules, ops.panel_linear, ops.pack_panels, ops.gated_panel_linear, bf16)

    def mlp_in(module: PackedLinear) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(x: torch.Tensor) -> torch.Tensor:
            fused = module.silu_mul(x)
            if fused is not None:
                return fused
            gate, up = module(x).split(intermediate, dim=-1)
            return F.silu(gate) * up
        return run

    layers = [Layer(q, o, mlp_in(g), d) for q, o, g, d in layers_modules]
    return layers, head_module


def step(layers: list[Layer], head: Callable[[torch.Tensor], torch.Tensor] | None, x: torch.Tensor,
         attn: torch.Tensor, act: torch.Tensor) -> None:
    """Every linear of a forward pass over ``x``'s rows (inputs of the right widths, reused)."""
    for layer in layers:
        layer.qkv(x)
        layer.o(attn)
        layer.mlp_in(x)
        layer.down(act)
    if head is not None:
        head(x[-1:] if x.shape[0] > 64 else x)  # a prefill chunk samples from its last row only


def timed(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up: first-touch of outputs, oneDNN's primitive cache
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_peaks(ops: Any) -> dict[str, float]:
    big = torch.ones(1 << 28)  # 1 GiB of float32
    bandwidth = ops.read_bandwidth(big, 5) if ops is not None else 0.0
    if ops is None:
        best = 0.0
        for _ in range(5):
            t0 = time.perf_counter()
            big.sum()
            best = max(best, big.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        bandwidth = best
    del big
    fma = max(ops.fma_peak(20_000_000) for _ in range(3)) if ops is not None else 0.0
    bf16 = max(ops.bf16_dot_peak(10_000_000) for _ in range(3)) if ops is not None else 0.0
    a = torch.randn(2048, 2048)
    sgemm = 2 * 2048 ** 3 / timed(lambda: torch.mm(a, a), 5) / 1e9
    return {"read_gb_s": bandwidth, "fma_gflop_s": fma, "bf16_dot_gflop_s": bf16, "mkl_sgemm_2048_gflop_s": sgemm}


def measure_backend(args: argparse.Namespace, backend: str,
                    built: tuple[list[Layer], Callable[[torch.Tensor], torch.Tensor] | None], dtype: torch.dtype,
                    peaks: dict[str, float], weight_bytes: int, layer_params: int) -> tuple[dict, dict]:
    """One backend's decode and prefill figures."""
    layers, head_fn = built
    g = torch.Generator().manual_seed(2)

    def inputs(rows: int) -> tuple[torch.Tensor, ...]:
        return tuple(torch.randn(rows, n, generator=g).to(dtype)
                     for n in (args.hidden, args.q_heads * args.head_dim, args.intermediate))

    decode, prefill = {}, {}
    for rows in args.decode_list:
        x, attn, act = inputs(rows)
        with torch.inference_mode():
            seconds = timed(lambda: step(layers, head_fn, x, attn, act), args.repeats)  # noqa: B023
        gb_s = weight_bytes / seconds / 1e9
        decode[rows] = {"ms": seconds * 1e3, "weight_gb_s": gb_s, "of_read": gb_s / peaks["read_gb_s"]}
        say(f"{backend}: decode {rows:>4} rows {seconds * 1e3:7.1f} ms  {gb_s:5.1f} GB/s "
            f"({gb_s / peaks['read_gb_s']:.0%} of read)")
    for rows in args.prefill_list:
        x, attn, act = inputs(rows)
        with torch.inference_mode():
            seconds = timed(lambda: step(layers, None, x, attn, act), max(3, args.repeats // 2))  # noqa: B023
        gflop_s = 2 * rows * layer_params / seconds / 1e9
        peak = peaks["bf16_dot_gflop_s"] if dtype == torch.bfloat16 and peaks["bf16_dot_gflop_s"] else \
            peaks["fma_gflop_s"]
        of_peak = gflop_s / peak if peak else None
        prefill[rows] = {"ms": seconds * 1e3, "gflop_s": gflop_s, "of_fma_peak": of_peak}
        say(f"{backend}: prefill {rows:>4} rows {seconds * 1e3:7.1f} ms  {gflop_s:5.0f} GFLOP/s"
            + (f" ({of_peak:.0%} of peak)" if of_peak else ""))
    return decode, prefill


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine import kernels
    from engine.heap import keep_heap_memory
    from engine.packing import onednn_supported

    heap_kept = keep_heap_memory()  # as the engine does on CPU: activations reuse mapped pages
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    ops = kernels.load()
    panels = ops is not None and (dtype == torch.float32 or ops.bf16_panels)
    onednn = onednn_supported(torch.device("cpu"), dtype)
    backends = [b for b in args.backend_list if (b != "panel" or panels) and (b != "onednn" or onednn)]
    skipped = sorted(set(args.backend_list) - set(backends))
    if skipped:
        say(f"skipping {', '.join(skipped)}: no native kernels here (or none for bfloat16 panels: neither "
            f"AVX512-BF16 nor AVX2), or no oneDNN layout for {args.dtype} on this CPU")
    say("measuring the FMA peak and the memory read rate ...")
    peaks = measure_peaks(ops)
    say(f"FMA peak {peaks['fma_gflop_s']:.0f} GFLOP/s (bf16 dot {peaks['bf16_dot_gflop_s']:.0f}), "
        f"read {peaks['read_gb_s']:.1f} GB/s, "
        f"MKL sgemm 2048 {peaks['mkl_sgemm_2048_gflop_s']:.0f} GFLOP/s")
    tensors = weights(args, dtype, 0)
    g = torch.Generator().manual_seed(1)
    head = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).to(dtype) if args.vocab else None
    layer_params = sum(t.numel() for t in tensors[0].values()) * args.layers
    head_params = head.numel() if head is not None else 0
    weight_bytes = (layer_params + head_params) * tensors[0]["qkv"].element_size()
    out: dict[str, Any] = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                                       "torch": torch.__version__, "heap_kept": heap_kept,
                                       "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE")},
                           "args": {k: v for k, v in vars(args).items() if k not in ("json_out", "plot_out")},
                           "peaks": peaks, "weight_bytes": weight_bytes, "layer_params": layer_params,
                           "decode": {}, "prefill": {}}
    for backend in backends:
        say(f"{backend}: packing {weight_bytes / 1e6:.0f} MB of weights ...")
        out["decode"][backend], out["prefill"][backend] = measure_backend(
            args, backend, build(backend, tensors, head, args.intermediate, ops), dtype, peaks,
            weight_bytes, layer_params)
    out["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return out


def print_tables(result: dict[str, Any]) -> None:
    peaks = result["peaks"]
    print(f"Measured in the same run: FMA peak **{peaks['fma_gflop_s']:.0f} GFLOP/s** (bfloat16 dot products "
          f"{peaks['bf16_dot_gflop_s']:.0f}), memory read "
          f"**{peaks['read_gb_s']:.1f} GB/s** ({result['machine']['threads']} threads; MKL sgemm 2048³: "
          f"{peaks['mkl_sgemm_2048_gflop_s']:.0f} GFLOP/s); weights {result['weight_bytes'] / 1e6:.0f} MB "
          f"({result['args']['dtype']}).\n")
    backends = list(result["decode"])
    print("| decode rows | " + " | ".join(f"{b} ms | {b} GB/s (% of read)" for b in backends) + " |")
    print("|---:|" + "---:|---:|" * len(backends))
    for rows in result["args"]["decode_list"]:
        cells = []
        for b in backends:
            d = result["decode"][b].get(rows) or result["decode"][b].get(str(rows))
            cells.append(f"{d['ms']:.1f} | {d['weight_gb_s']:.1f} ({d['of_read']:.0%})")
        print(f"| {rows} | " + " | ".join(cells) + " |")
    print()
    print("| prefill rows | " + " | ".join(f"{b} ms | {b} GFLOP/s (% of peak)" for b in backends) + " |")
    print("|---:|" + "---:|---:|" * len(backends))
    for rows in result["args"]["prefill_list"]:
        cells = []
        for b in backends:
            d = result["prefill"][b].get(rows) or result["prefill"][b].get(str(rows))
            share = f" ({d['of_fma_peak']:.0%})" if d["of_fma_peak"] else ""
            cells.append(f"{d['ms']:.1f} | {d['gflop_s']:.0f}{share}")
        print(f"| {rows} | " + " | ".join(cells) + " |")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peaks = result["peaks"]
    fig, (dec, pre) = plt.subplots(1, 2, figsize=(12, 4.5))
    for backend, rows in result["decode"].items():
        xs = sorted(int(r) for r in rows)
        dec.plot(xs, [rows.get(r, rows.get(str(r)))["weight_gb_s"] for r in xs], marker="o", label=backend)
    dec.axhline(peaks["read_gb_s"], color="black", linestyle="--", label="measured read rate")
    dec.axhline(0.6 * peaks["read_gb_s"], color="grey", linestyle=":", label="60 % of it")
    dec.set_xlabel("rows (sequences in the decode step)")
    dec.set_ylabel("weight GB/s")
    dec.set_title("Decode step: weights streamed per second")
    for backend, rows in result["prefill"].items():
        xs = sorted(int(r) for r in rows)
        pre.plot(xs, [rows.get(r, rows.get(str(r)))["gflop_s"] for r in xs], marker="o", label=backend)
    peak = peaks["bf16_dot_gflop_s"] if result["args"]["dtype"] == "bfloat16" and peaks["bf16_dot_gflop_s"] \
        else peaks["fma_gflop_s"]
    if peak:
        pre.axhline(peak, color="black", linestyle="--", label="measured peak")
        pre.axhline(0.75 * peak, color="grey", linestyle=":", label="75 % of it")
    pre.set_xscale("log", base=2)
    pre.set_xlabel("rows (prompt tokens in the chunk)")
    pre.set_ylabel("GFLOP/s")
    pre.set_title("Prefill chunk: layer linears")
    for ax in (dec, pre):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Linear layers, {result['args']['dtype']}, {result['machine']['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    # as `kvgate` does before torch's first allocation (app/cli.py); the user's choice stands
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    args = parse_args(argv)
    result = run(args)
    print_tables(result)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot_out:
        plot(result, args.plot_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
