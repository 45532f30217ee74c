"""Pre-packed linear layers for CPU serving: oneDNN's blocked weight layout, reordered once.

`torch.nn.functional.linear` on CPU runs MKL's sgemm, which re-blocks the weight on every call;
for the few-row matmuls of a decode step that overhead dominates. oneDNN can reorder a weight
once into its own blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's
CPU freezing pass uses) and then multiply any number of rows against it. Measured on the serving
model (docs/benchmarks.md): a 16-sequence SmolLM2 decode step 113 → 93 ms, with greedy tokens
unchanged. The MLP's gate and up projections are also fused into one matmul (one read of the
input, one kernel call instead of two).

Where the engine loaded its native kernels (float32 on CPU), `use_panel_kernel` gives every packed
layer KVGate's own matmul for 1 to 256 rows (engine/csrc/panel_gemm.cpp), on the weight repacked
into sequential panels that replace oneDNN's copy: a 16-sequence decode step 31.8 → 23.7 ms on a
Zen 5 VM against the few-row kernel it replaced (docs/engine.md); oneDNN keeps the larger matmuls.

Only on CPU, with oneDNN available and a float32/bfloat16 model; every replaced layer is checked
against ``F.linear`` on random input when packed, and left alone if the results disagree.
Call after the model's fingerprint is taken: packed layers hold buffers, not parameters.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

_PACK_HINT_ROWS = 16  # oneDNN picks its blocking for this many rows; any row count works
_CALIBRATION_ROWS = 1024  # a prefill-sized matmul, timed once per model to choose the kernel
_MKL_ROWS = 512  # where MKL won the calibration, it takes matmuls from this many rows on
_MKL_MARGIN = 0.93  # ... and only where it took at most this share of oneDNN's time
_DTYPES = (torch.float32, torch.bfloat16)


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing on this CPU: float32 anywhere oneDNN runs; bfloat16 only where oneDNN has
    bf16 kernels (AVX-512 BF16/AVX-NE-CONVERT; elsewhere its reorder raises)."""
    if not (device.type == "cpu" and dtype in _DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.bfloat16:
        check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return bool(check()) if check is not None else False
    return True


class PackedLinear(nn.Module):
    """``y = x Wᵀ + b``: oneDNN's packed W for few rows (decode); for many rows (prefill) whichever
    of oneDNN and MKL's sgemm `pack_model` measured faster on this CPU (``mkl_rows``: from how
    many rows MKL is used; None = never).

    Few rows: oneDNN is 15-100 % faster everywhere we measured. Many rows: on an Intel Xeon MKL
    was 3-10 % faster past ~512 rows; on an AMD EPYC (Zen 4) oneDNN is 10-40 % faster at every
    size (MKL does not pick its AVX-512 kernels there). The plain weight is kept for MKL and for
    `_agrees`, one more copy of each linear weight in host memory (docs/engine.md). With the native
    panel kernel attached (`use_panel_kernel`) it takes every matmul of up to `panel_rows` rows.
    """

    mkl_rows: int | None = _MKL_ROWS
    # The native panel kernel (engine/csrc/panel_gemm.cpp, `use_panel_kernel`) where the engine
    # loaded it takes 1 to `panel_rows` rows: SmolLM2's 30 layers at 16 rows 18.8 → 12.1 ms against
    # the few-row kernel it replaced, at 64 rows 36-37 → 29-31 ms against oneDNN (weights streamed
    # from memory); from ~512 rows oneDNN is faster.
    panel: Callable[..., torch.Tensor] | None = None
    panel_rows: int = 256
    # A gated MLP's gate|up layer (`gated`: the intermediate size, W = [gate; up]) with the gated
    # panel kernel (`use_panel_kernel`) has panels that pair each gate output with its up output,
    # so `silu_mul` can apply the activation in the matmul's epilogue.
    gated_panel: Callable[..., torch.Tensor] | None = None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = int(weight.shape[1])
        self.out_features = int(weight.shape[0])
        weight = weight.detach().contiguous()
        self.weight: torch.Tensor
        self.packed: torch.Tensor
        self.bias: torch.Tensor | None
        self.register_buffer("weight", weight)
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT_ROWS))
        self.register_buffer("bias", None if bias is None else bias.detach())
        self.panels: torch.Tensor | None
        self.register_buffer("panels", None)
        self.gated: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._panel_input(x)
        if rows is not None:
            if self.gated_panel is not None:
                y = self.gated_panel(rows, self.panels, self.bias, self.gated, False)
            else:
                assert self.panel is not None  # _panel_input returned rows
                y = self.panel(rows, self.panels, self.bias, self.out_features)
            return y.reshape(*x.shape[:-1], self.out_features)
        rows = x.reshape(-1, self.in_features)
        if self.mkl_rows is not None and rows.shape[0] >= self.mkl_rows:
            return F.linear(x, self.weight, self.bias)
        return self.onednn(rows.contiguous()).reshape(*x.shape[:-1], self.out_features)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``SiLU(gate) * up`` of this gated layer's output for ``x`` ([..., gated]), the activation
        computed in the panel kernel's epilogue: no [rows, 2 x gated] output written and read back
        (a 64-row chunk through SmolLM2's 30 MLPs 34.4 → 33.0 ms on a Zen 4). None where the layer
        cannot: not gated, no gated panels, or more than `panel_rows` rows."""
        if self.gated_panel is None or self.gated is None:
            return None
        rows = self._panel_input(x)
        if rows is None:
            return None
        return self.gated_panel(rows, self.panels, self.bias, self.gated, True).reshape(*x.shape[:-1], self.gated)

    def _panel_input(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x`` as rows with a unit column stride, for the panel kernel; None where the kernel
        does not take it (none attached, or more than `panel_rows` rows)."""
        rows = x.reshape(-1, self.in_features)
        if self.panel is None or rows.shape[0] > self.panel_rows:
            return None
        return rows if rows.stride(-1) == 1 else rows.contiguous()

    def onednn(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` [n, in_features], contiguous, times the packed weight."""
        return torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")


class FusedGateUpMLP(nn.Module):
    """A gated MLP (Llama/Qwen2/Mistral): ``down(act(gate(x)) * up(x))`` with gate|up in one matmul."""

    def __init__(self, mlp: Any) -> None:
        super().__init__()
        self.intermediate = int(mlp.gate_proj.weight.shape[0])
        weight = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        bias = None
        if mlp.gate_proj.bias is not None:
            bias = torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
        self.gate_up = PackedLinear(weight, bias)
        self.gate_up.gated = self.intermediate
        self.down = PackedLinear(mlp.down_proj.weight, mlp.down_proj.bias)
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down(self.act_fn(gate) * up)


def _agrees(original: nn.Module, packed: nn.Module, in_features: int, dtype: torch.dtype) -> bool:
    x = torch.randn(3, in_features, dtype=dtype, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected, got = original(x), packed(x)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    scale = float(expected.abs().max()) or 1.0
    return bool(torch.allclose(expected, got, rtol=tol, atol=tol * scale))


def pack_model(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Replace the model's linear layers (and gated MLPs) by packed ones; returns how many."""
    if not packing_supported(device, dtype):
        return 0
    replaced = _pack_children(model, dtype)
    if replaced:
        packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
        mkl_rows = _calibrate(_calibration_layers(model, packed))
        for layer in packed:
            layer.mkl_rows = mkl_rows
        # a detail of how the matmuls run, for whoever measures them (docs/engine.md)
        logger.debug("packed %d linear layers for oneDNN; many-row matmuls use %s", replaced,
                     "oneDNN too" if mkl_rows is None else f"MKL from {mkl_rows} rows")
    return replaced


def use_panel_kernel(modules: Iterable[nn.Module], linear: Callable[..., torch.Tensor] | None,
                     pack: Callable[..., torch.Tensor] | None = None,
                     gated: Callable[..., torch.Tensor] | None = None) -> int:
    """Give the float32 packed layers among ``modules`` the native panel kernel (``linear``, with
    ``pack`` to repack their weights into its panels); returns how many. The panels replace
    oneDNN's packed copy, so a layer still holds two copies of its weight: oneDNN then multiplies
    the many-row matmuls past `PackedLinear.panel_rows` from the plain weight, reordering it per
    call (measured alike at 512-2,048 rows: the reorder is a small part of such a matmul).
    With ``gated`` (the gated panel kernel), gated MLP layers (`PackedLinear.gated`) get panels
    that pair gate and up outputs (``pack(weight, True)``), for `PackedLinear.silu_mul`.
    ``linear=None`` takes the kernels away and restores oneDNN's packed copy."""
    if linear is not None and pack is None:
        raise ValueError("use_panel_kernel needs the pack op that lays out the kernel's panels")
    count = 0
    for module in modules:
        if not isinstance(module, PackedLinear) or module.weight.dtype != torch.float32:
            continue
        if linear is None:
            if module.panel is not None:
                module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight, _PACK_HINT_ROWS)
                module.panels = None
            module.gated_panel = None
        elif module.panel is None:
            assert pack is not None
            pair = gated is not None and module.gated is not None
            module.panels = pack(module.weight, True) if pair else pack(module.weight)
            module.gated_panel = gated if pair else None
            module.packed = module.weight
        module.panel = linear
        count += 1
    return count


def _calibration_layers(model: nn.Module, packed: list[PackedLinear]) -> list[PackedLinear]:
    """One packed layer of each weight shape, without the output head: a prefill runs every
    decoder shape over all its rows but the head over the last row only. (Timing the largest
    layer alone picked the head, and on an AMD EPYC Zen 3 that chose oneDNN where MKL runs the
    decoder's shapes 10 % faster at 2,040 rows.)"""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    by_shape: dict[tuple[int, int], PackedLinear] = {}
    for layer in packed:
        if layer is not head:
            by_shape.setdefault((layer.out_features, layer.in_features), layer)
    return list(by_shape.values()) or packed[:1]


def _calibrate(layers: list[PackedLinear], repeats: int = 3) -> int | None:
    """Time ``layers`` (the model's own weights) at a prefill-sized row count with both kernels
    (per layer, one untimed call each, then best of ``repeats``; summed): `_MKL_ROWS` (MKL from
    there on) if MKL is clearly faster (`_choose`), else None (oneDNN for every size)."""
    gen = torch.Generator().manual_seed(0)
    kernels: dict[str, Callable[[PackedLinear, torch.Tensor], torch.Tensor]] = {
        "onednn": lambda layer, x: layer.onednn(x), "mkl": lambda layer, x: F.linear(x, layer.weight, layer.bias)}
    total = dict.fromkeys(kernels, 0.0)
    with torch.inference_mode():
        for layer in layers:
            x = torch.randn(_CALIBRATION_ROWS, layer.in_features, dtype=layer.weight.dtype, generator=gen)
            for run in kernels.values():  # a kernel's first call per shape sets it up (oneDNN: its primitive)
                run(layer, x)
            best = dict.fromkeys(kernels, float("inf"))
            for _ in range(repeats):  # the kernels alternate, so a busy moment hits both
                for name, run in kernels.items():
                    t0 = time.perf_counter()
                    run(layer, x)
                    best[name] = min(best[name], time.perf_counter() - t0)
            for name in total:
                total[name] += best[name]
    return _choose(total)


def _choose(seconds: dict[str, float]) -> int | None:
    """MKL from `_MKL_ROWS` rows only where it took at most `_MKL_MARGIN` of oneDNN's time. Where
    MKL won, it won by 3-10 % (an Intel Xeon; 10 % on a Zen 3 without AVX-512); where it lost, by
    2.3x (Zen 5: MKL does not pick its AVX-512 kernels on AMD) — and one start on a noisy Zen 5 VM
    timed oneDNN that slow for a while, chose MKL by 3 %, and that process's 2,048-token prompts
    took 2.4 s instead of 1.3. A wrong MKL costs up to 2.3x, a wrong oneDNN under 7 %."""
    return _MKL_ROWS if seconds["mkl"] <= _MKL_MARGIN * seconds["onednn"] else None


def _pack_children(parent: nn.Module, dtype: torch.dtype) -> int:
    replaced = 0
    for name, child in list(parent.named_children()):
        new: nn.Module | None = None
        if hasattr(child, "act_fn") and all(isinstance(getattr(child, n, None), nn.Linear)
                                            for n in ("gate_proj", "up_proj", "down_proj")):
            mlp: Any = child
            new, width = FusedGateUpMLP(mlp), int(mlp.gate_proj.weight.shape[1])
        elif type(child) is nn.Linear:
            new, width = PackedLinear(child.weight, child.bias), child.in_features
        if new is None:
            replaced += _pack_children(child, dtype)
        elif _agrees(child, new, width, dtype):
            setattr(parent, name, new)
            replaced += 1
        else:
            logger.warning("packed %s disagrees with the original layer; keeping the original", name)
    return replaced
