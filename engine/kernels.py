"""KVGate's native CPU kernels: built once per machine from `engine/csrc`, loaded as torch ops.

`paged_attention` (engine/csrc/paged_attention.cpp) computes attention for rows that are few per
sequence — decodes and short prefill chunks — straight from the paged KV pool: no gather of the
context into a contiguous copy, each block read once per KV head for all the query heads that
share it. `chunk_attention` (engine/csrc/chunk_attention.cpp) takes the longer prefill chunks,
GEMM-shaped, also without a gather. `fused_ops.cpp` holds the fused steps of
engine.fast_decoder, `panel_gemm.cpp` the matmul of engine.packing's layers, for any number of
rows, on the weights' only copy (docs/engine.md has the figures), `panel_gemm_bf16.cpp` its
bfloat16 form where the CPU has AVX512-BF16 or AVX2; `calibrate.cpp` measures the
machine's FMA rate and memory read rate, which bench/linear_bench.py compares the matmuls with.

The source is compiled by one call of the machine's C++ compiler (against torch's headers, no
build system, on idle CPU time) the first time an engine starts into
`$KVGATE_CACHE_DIR/kernels/<digest>` (or `$KVGATE_KERNEL_DIR/<digest>`), where the digest covers the source, the torch version, the
compiler and its flags and the CPU's instruction set flags, so a cache folder shared between machines never loads a binary built for another CPU.
Without a compiler, if the build fails, or if the build computes anything other than what PyTorch
computes on small inputs (engine/kernel_check.py, once per process), `load()` logs why once and
returns None: the engine then runs the PyTorch path, which gives the same results
(tests/engine/test_kernels.py).
`[engine] native_kernels = false` skips the build.

`load()` builds in the caller's thread (tests, benchmarks). An engine calls `load_or_build()`:
with a build at hand it gets the ops at once; without one it gets a `KernelBuild` running the
compiler in the background, serves on the PyTorch path meanwhile, and its step loop switches the
ops in between two steps once the build is done (engine/loop.py, docs/engine.md).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import platform
import shutil
import signal
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
            for name in ("paged_attention.cpp", "chunk_attention.cpp", "fused_ops.cpp", "panel_gemm.cpp",
                         "panel_gemm_bf16.cpp", "calibrate.cpp")]
# -fno-trapping-math lets GCC vectorise loops with float compares (the exp clamps, masks); the
# kernels never read floating-point exception flags.
_CFLAGS = ["-O3", "-fopenmp", "-march=native", "-fno-trapping-math", "-fno-math-errno"]
_LDFLAGS = ["-fopenmp"]
_LIBRARY = "kvgate_kernels.so"
_lock = threading.Lock()
_loaded: dict[str, NativeOps | None] = {}
_building: dict[Path, KernelBuild] = {}  # builds under way, by library path


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
    pack_panels_bf16: Callable[..., torch.Tensor]  # these three: where bf16_panels (AVX512-BF16 or AVX2)
    panel_linear_bf16: Callable[..., torch.Tensor]
    gated_panel_linear_bf16: Callable[..., torch.Tensor]
    bf16_panels: bool  # whether the build multiplies bfloat16 panels (engine/csrc/panel_gemm_bf16.cpp)
    fma_peak: Callable[[int], float]  # GFLOP/s of float32 FMAs on every thread (engine/csrc/calibrate.cpp)
    read_bandwidth: Callable[[torch.Tensor, int], float]  # GB/s of all threads reading a tensor
    bf16_dot_peak: Callable[[int], float]  # GFLOP/s of bfloat16 dot products (vdpbf16ps), 0 without them


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
    """The native ops, building them first (in this thread) if this machine has no build yet;
    None if they cannot be built here (the reason is logged once per process). A background build
    under way in this process is waited for, not repeated."""
    with _lock:
        under_way = [build for build in _building.values() if not build.cancelled]
    if under_way:
        under_way[0].wait()
        ops = under_way[0].take()
        if not under_way[0].cancelled:
            return ops
    with _lock:
        if "ops" not in _loaded:
            _loaded["ops"] = _build_and_load()
        return _loaded["ops"]


def load_built() -> NativeOps | None:
    """The native ops where this machine has a build already (loaded and self-checked in this
    thread, as `load_or_build` does), else None; never starts a compile."""
    with _lock:
        if "ops" in _loaded:
            return _loaded["ops"]
        if not (build_dir() / _LIBRARY).exists():
            return None
    return load_or_build()[0]


def load_or_build() -> tuple[NativeOps | None, KernelBuild | None]:
    """For an engine that must not wait for a compiler: ``(ops, None)`` where this machine has a
    build (loaded and self-checked in this thread, milliseconds), ``(None, build)`` while one
    compiles in the background (`KernelBuild.take` gives its ops later), ``(None, None)`` where
    none can be made (the reason is logged)."""
    with _lock:
        if "ops" in _loaded:
            return _loaded["ops"], None
        compiler = _usable_compiler()
        if compiler is None:
            _loaded["ops"] = None
            return None, None
        folder = build_dir()
        library = folder / _LIBRARY
        if library.exists():
            _loaded["ops"] = _load_checked(compiler, folder, library)
            return _loaded["ops"], None
        build = _building.get(library)
        if build is None or build.cancelled:
            build = _building[library] = KernelBuild(compiler, folder, library)
        return None, build


class KernelBuild:
    """One compile of the kernels on a background thread, while the engine serves without them.

    Only the compilers (subprocesses on idle CPU time) work in the background; loading the library and the
    self-check run torch ops, so they happen in `take`, on the thread that calls it (the step
    loop: one OpenMP pool per process). Engines of one process share one build.
    """

    def __init__(self, compiler: str, folder: Path, library: Path) -> None:
        self.compiler, self.folder, self.library = compiler, folder, library
        self.seconds: float | None = None  # how long the compiler took, once done
        self.error: str | None = None  # why the compile failed
        self.cancelled = False
        self._processes: list[Any] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvgate-kernel-build", daemon=True)
        try:
            self._plan: _Plan | None = _plan(compiler, folder, background=True)
        except OSError as exc:  # an unwritable cache folder: failed before it began
            self._plan, self.error, self.seconds = None, _first_error(exc), 0.0
            self._done.set()
            return
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            _compile(self.compiler, self.folder, self.library, started=self._started, plan=self._plan)
        except Exception as exc:
            self.error = _first_error(exc)
        finally:
            self.seconds = time.perf_counter() - t0
            self._done.set()

    def _started(self, process: Any) -> None:
        self._processes.append(process)
        if self.cancelled:
            _kill_group(process)

    def done(self) -> bool:
        """True once the compiler has finished (or failed, or was cancelled)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def take(self) -> NativeOps | None:
        """The build's ops, loaded and self-checked in this thread; None if the compile failed
        (logged once per process) or was cancelled. Call once `done()`."""
        assert self.done(), "take() before the build is done"
        with _lock:
            _building.pop(self.library, None)
            if self.cancelled:
                return None
            if "ops" not in _loaded:
                if self.error is not None:
                    _log_build_failure(self.error, self.folder)
                    _loaded["ops"] = None
                else:
                    _loaded["ops"] = _load_checked(self.compiler, self.folder, self.library)
            return _loaded["ops"]

    def cancel(self, timeout: float = 10.0) -> None:
        """Stop the compiler (an engine that stops before its build is done) and wait for the
        thread, which removes the half-written output."""
        self.cancelled = True
        for process in list(self._processes):
            _kill_group(process)
        if self._thread.is_alive():
            self._thread.join(timeout)


def _kill_group(process: Any) -> None:
    if process.poll() is None:
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)


@atexit.register
def _cancel_builds() -> None:
    """A process that exits with a build under way stops its compilers (they run in sessions of
    their own, so nothing else would) rather than leave them running and their temp folder behind."""
    for build in list(_building.values()):
        build.cancel()


def _usable_compiler() -> str | None:
    """The C++ compiler to build with; None (and why, logged) where the kernels cannot be built."""
    if platform.system() != "Linux":
        logger.info("native CPU kernels are built on Linux only; using the PyTorch attention path")
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C++ compiler found (install g++ or set CXX): KVGate's native CPU attention "
                       "kernel is not built and decode steps use the slower PyTorch path")
    return compiler


def _build_and_load() -> NativeOps | None:
    compiler = _usable_compiler()
    if compiler is None:
        return None
    folder = build_dir()
    library = folder / _LIBRARY
    if not library.exists():
        try:
            _compile(compiler, folder, library)
        except Exception as exc:  # a compiler error, a missing header
            _log_build_failure(_first_error(exc), folder)
            return None
    return _load_checked(compiler, folder, library)


def _first_error(exc: Exception) -> str:
    lines = str(exc).strip().splitlines() or [""]
    return f"{type(exc).__name__}: {next((line for line in lines if 'error' in line), lines[0])}"


def _log_build_failure(reason: str, folder: Path) -> None:
    logger.warning("could not build or load KVGate's native CPU kernels (%s); decode steps use "
                   "the slower PyTorch path. Delete %s to rebuild.", reason, folder)


def _load_checked(compiler: str, folder: Path, library: Path) -> NativeOps | None:
    """Load a finished build and run its self-check (torch ops: on the thread that steps the model)."""
    try:
        torch.ops.load_library(str(library))
        ns: Any = torch.ops.kvgate
        ops = NativeOps(paged_attention=ns.paged_attention, chunk_attention=ns.chunk_attention, add_rms_norm=ns.add_rms_norm, rms_norm=ns.rms_norm,
                        rope_write_kv=ns.rope_write_kv, silu_mul=ns.silu_mul,
                        pack_panels=ns.pack_panels, panel_linear=ns.panel_linear,
                        gated_panel_linear=ns.gated_panel_linear, pack_panels_bf16=ns.pack_panels_bf16,
                        panel_linear_bf16=ns.panel_linear_bf16, gated_panel_linear_bf16=ns.gated_panel_linear_bf16,
                        bf16_panels=bool(ns.bf16_panels_built()), fma_peak=ns.fma_peak,
                        read_bandwidth=ns.read_bandwidth, bf16_dot_peak=ns.bf16_dot_peak)
    except Exception as exc:  # a broken cache folder, a library from another torch
        _log_build_failure(_first_error(exc), folder)
        return None
    mismatch = kernel_check.first_mismatch(ops)
    if mismatch is not None:
        logger.warning("KVGate's native CPU kernels built in %s compute wrong results on this machine (%s); "
                       "the engine uses the PyTorch path instead. Please report the compiler (%s) and torch %s.",
                       folder, mismatch, compiler, torch.__version__)
        return None
    return ops


@dataclass(frozen=True)
class _Plan:
    """The compiler calls of one build: each source to an object in ``work``, then the link."""

    work: Path
    compiles: list[list[str]]
    link: list[str]
    output: Path


def _plan(compiler: str, folder: Path, background: bool = False) -> _Plan:
    """Prepare a build (imports, paths, the temp folder) in the calling thread, so that a
    background build's thread only waits on compilers (it never competes for the GIL or an
    import lock with a model loading meanwhile)."""
    import tempfile

    from torch.utils import cpp_extension

    folder.mkdir(parents=True, exist_ok=True)
    logger.info("building KVGate's native CPU kernels (once per machine)%s", " in the background, on CPU time "
                "the server leaves idle; until they are in, requests run on the slower PyTorch path"
                if background else "", extra={"path": str(folder)})
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    includes = [flag for path in cpp_extension.include_paths() for flag in ("-isystem", path)]
    libs = cpp_extension.library_paths()
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=folder))
    objects = [work / f"{source.stem}.o" for source in _SOURCES]
    output = work / _LIBRARY
    return _Plan(
        work=work,
        compiles=[[compiler, "-std=c++20", "-fPIC", *_CFLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes,
                   "-c", str(source), "-o", str(obj)] for source, obj in zip(_SOURCES, objects, strict=True)],
        link=[compiler, "-shared", *map(str, objects), "-o", str(output), *[f"-L{path}" for path in libs],
              "-lc10", "-ltorch_cpu", *_LDFLAGS],
        output=output)


def _compile(compiler: str, folder: Path, library: Path, started: Callable[[Any], None] | None = None,
             plan: _Plan | None = None) -> None:
    """Compile each source file in its own compiler process, as many at once as there are CPUs
    (the build takes ~1/N of the time one call took), then link; at the lowest CPU priority
    (`_LOW_PRIORITY`), so a server answering meanwhile keeps the CPU. No build system. The
    library appears atomically, so processes that build at the same time never load a
    half-written file. ``started(process)`` gets each `subprocess.Popen` (to cancel the build)."""
    plan = plan or _plan(compiler, folder)
    t0 = time.perf_counter()
    try:
        _run_all(plan.compiles, compiler, started)
        _run_all([plan.link], compiler, started)
        os.chmod(plan.output, 0o755)  # readable by every user of a shared cache
        os.replace(plan.output, library)
    finally:
        shutil.rmtree(plan.work, ignore_errors=True)
    logger.info("native CPU kernels compiled in %.0f s", time.perf_counter() - t0)


def _low_priority() -> list[str]:
    """The prefix that runs a command on idle CPU time only: Linux's SCHED_IDLE (`chrt`), which a
    process stepping a model with spinning OpenMP threads needs (`nice` alone still takes a share
    of a core from it, and each parallel region waits for its slowest thread); else `nice`."""
    chrt, nice = shutil.which("chrt"), shutil.which("nice")
    if chrt is not None:
        return [chrt, "--idle", "0"]
    return [nice, "-n", "19"] if nice is not None else []


def _run_all(commands: list[list[str]], compiler: str, started: Callable[[Any], None] | None) -> None:
    """Run ``commands`` at low priority, at most one per CPU at a time; RuntimeError with the compiler's
    message if one fails (the others are killed). Each runs in a session of its own, so killing
    its group also stops the compiler's own children (cc1plus, as, ld)."""
    import subprocess

    prefix = _low_priority()
    pending, running = list(commands), list[Any]()
    try:
        while pending or running:
            while pending and len(running) < (os.cpu_count() or 1):
                command = pending.pop(0)
                process = subprocess.Popen([*prefix, *command], text=True,
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
                running.append(process)
                if started is not None:
                    started(process)
            process = running.pop(0)
            output = process.communicate(timeout=600)[0]
            if process.returncode != 0:
                raise RuntimeError(f"{Path(compiler).name} exited with {process.returncode}: {output.strip()[-2000:]}")
    finally:
        for process in running:
            _kill_group(process)
            process.wait()
