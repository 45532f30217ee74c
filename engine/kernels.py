"""KVGate's native CPU kernels: built once per machine from `engine/csrc`, loaded as torch ops.

`paged_attention` (engine/csrc/paged_attention.cpp) computes attention for rows that are few per
sequence — decodes and short prefill chunks — straight from the paged KV pool: no gather of the
context into a contiguous copy, each block read once per KV head for all the query heads that
share it. Measured on a 2-core AMD EPYC (docs/benchmarks.md): a 16-sequence decode layer at 176
tokens of context 2.2 ms → 0.18 ms (gather + SDPA vs the kernel), 5 rows over 2,053 tokens
1.0 → 0.6 ms. `chunk_attention` (engine/csrc/chunk_attention.cpp) takes the longer prefill chunks,
GEMM-shaped: a 64-row chunk over 2,048 keys 2.6 → 1.9 ms per layer against PyTorch's flash
attention with its gather, a causal 2,048-token prompt 43 → 30 ms per layer.
`fused_ops.cpp` holds the fused steps of engine.fast_decoder, `panel_gemm.cpp` the matmul of
engine.packing's layers for 1 to a few hundred rows (docs/engine.md has the figures).

The source is compiled by one call of the machine's C++ compiler (against torch's headers, no
build system) the first time an engine starts (~15 s on 2 cores) into
`$KVGATE_CACHE_DIR/kernels/<digest>` (or `$KVGATE_KERNEL_DIR/<digest>`), where the digest covers the source, the torch version, the
compiler and its flags and the CPU's instruction set flags, so a cache folder shared between machines never loads a binary built for another CPU.
Without a compiler, if the build fails, or if the build computes anything other than what PyTorch
computes on small inputs (engine/kernel_check.py, once per process), `load()` logs why once and
returns None: the engine then runs the PyTorch path, which gives the same results
(tests/engine/test_kernels.py).
`[engine] native_kernels = false` skips the build.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine import kernel_check
from engine.tiny_model import cache_root

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name("csrc") / name
            for name in ("paged_attention.cpp", "chunk_attention.cpp", "fused_ops.cpp", "panel_gemm.cpp")]
# -fno-trapping-math lets GCC vectorise loops with float compares (the exp clamps, masks); the
# kernels never read floating-point exception flags.
_CFLAGS = ["-O3", "-fopenmp", "-march=native", "-fno-trapping-math", "-fno-math-errno"]
_LDFLAGS = ["-fopenmp"]
_lock = threading.Lock()
_loaded: dict[str, NativeOps | None] = {}


@dataclass(frozen=True)
class NativeOps:
    """The ops of one loaded build (signatures in engine/csrc/*.cpp)."""

    paged_attention: Callable[..., torch.Tensor]
    chunk_attention: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    rope_write_kv: Callable[..., None]
    silu_mul: Callable[..., torch.Tensor]
    pack_panels: Callable[..., torch.Tensor]
    panel_linear: Callable[..., torch.Tensor]
    gated_panel_linear: Callable[..., torch.Tensor]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def build_dir() -> Path:
    """Where this machine's build of the kernels lives (one folder per source/torch/CPU digest)."""
    digest = hashlib.blake2b(digest_size=8)
    for part in (*(source.read_bytes() for source in sorted(_SOURCES[0].parent.iterdir())
                   if source.suffix in (".cpp", ".h")),
                 torch.__version__.encode(), " ".join(_CFLAGS + _LDFLAGS).encode(),
                 (_compiler() or "").encode(),
                 _cpu_flags().encode(), platform.machine().encode()):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    base = os.environ.get("KVGATE_KERNEL_DIR")
    return (Path(base).expanduser() if base else cache_root() / "kernels") / digest.hexdigest()


def load() -> NativeOps | None:
    """The native ops, building them first if this machine has no build yet; None if they cannot
    be built here (the reason is logged once per process)."""
    with _lock:
        if "ops" not in _loaded:
            _loaded["ops"] = _build_and_load()
        return _loaded["ops"]


def _build_and_load() -> NativeOps | None:
    if platform.system() != "Linux":
        logger.info("native CPU kernels are built on Linux only; using the PyTorch attention path")
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C++ compiler found (install g++ or set CXX): KVGate's native CPU attention "
                       "kernel is not built and decode steps use the slower PyTorch path")
        return None
    folder = build_dir()
    library = folder / "kvgate_kernels.so"
    try:
        if not library.exists():
            _compile(compiler, folder, library)
        torch.ops.load_library(str(library))
        ns: Any = torch.ops.kvgate
        ops = NativeOps(paged_attention=ns.paged_attention, chunk_attention=ns.chunk_attention, add_rms_norm=ns.add_rms_norm, rms_norm=ns.rms_norm,
                        rope_write_kv=ns.rope_write_kv, silu_mul=ns.silu_mul,
                        pack_panels=ns.pack_panels, panel_linear=ns.panel_linear,
                        gated_panel_linear=ns.gated_panel_linear)
    except Exception as exc:  # a compiler error, a missing header, a broken cache folder
        lines = str(exc).strip().splitlines() or [""]
        reason = next((line for line in lines if "error" in line), lines[0])
        logger.warning("could not build or load KVGate's native CPU kernels (%s: %s); decode steps use "
                       "the slower PyTorch path. Delete %s to rebuild.", type(exc).__name__, reason, folder)
        return None
    mismatch = kernel_check.first_mismatch(ops)
    if mismatch is not None:
        logger.warning("KVGate's native CPU kernels built in %s compute wrong results on this machine (%s); "
                       "the engine uses the PyTorch path instead. Please report the compiler (%s) and torch %s.",
                       folder, mismatch, compiler, torch.__version__)
        return None
    return ops


def _compile(compiler: str, folder: Path, library: Path) -> None:
    """One compiler call (no build system); the library appears atomically, so processes that
    build at the same time never load a half-written file."""
    import subprocess
    import tempfile

    from torch.utils import cpp_extension

    folder.mkdir(parents=True, exist_ok=True)
    logger.info("building KVGate's native CPU kernels (one time per machine, ~15 s)", extra={"path": str(folder)})
    t0 = time.perf_counter()
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    includes = [flag for path in cpp_extension.include_paths() for flag in ("-isystem", path)]
    libs = cpp_extension.library_paths()
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
    os.close(fd)
    command = [compiler, "-std=c++20", "-fPIC", "-shared", *_CFLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes,
               *(str(source) for source in _SOURCES), "-o", tmp, *[f"-L{path}" for path in libs], "-lc10", "-ltorch_cpu", *_LDFLAGS]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} exited with {result.returncode}: "
                               f"{(result.stderr or result.stdout).strip()[-2000:]}")
        os.chmod(tmp, 0o755)  # mkstemp made it private; the cache is meant to be readable
        os.replace(tmp, library)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("native CPU kernels built", extra={"seconds": round(time.perf_counter() - t0, 1)})
