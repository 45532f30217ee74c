"""Pre-packed linear layers for CPU serving: each weight held once, in the layout of the kernel
that multiplies it.

`torch.nn.functional.linear` on CPU runs MKL's sgemm, which re-blocks the weight on every call;
for the few-row matmuls of a decode step that overhead dominates. `pack_model` reorders each
linear weight once into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``,
what inductor's CPU freezing pass uses), which oneDNN multiplies against any number of rows, and
fuses a gated MLP's gate and up projections into one matmul (one read of the input, one call).

Where the engine loaded its native kernels (CPU), `use_panel_kernel` repacks every float32 layer
into the sequential panels of KVGate's own matmul (engine/csrc/panel_gemm.cpp), and every
bfloat16 layer into those of its bfloat16 form where the CPU has AVX512-BF16 or AVX2
(panel_gemm_bf16.cpp); the kernel then takes every row count, and the panels replace oneDNN's
layout (or the plain weight, where oneDNN has none for bfloat16), so a layer still holds one copy.
Either form rebuilds the plain weight on demand (`PackedLinear.dense_weight`), so the kernels can
be switched both ways at run time.

Only on CPU, with oneDNN available and a float32/bfloat16 model; every replaced layer is checked
against ``F.linear`` on random input when packed, and left alone if the results disagree.
Call after the model's fingerprint is taken: packed layers hold buffers, not parameters.
Figures: docs/engine.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

_PACK_HINT_ROWS = 16  # oneDNN picks its blocking for this many rows; any row count works
_DTYPES = (torch.float32, torch.bfloat16)

# (linear, pack, gated) of one dtype's panel kernel: the matmul, the op that lays a weight out in
# its panels, and the gated matmul (None where there is none)
PanelOps = tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], Callable[..., torch.Tensor] | None]


def panel_ops(native: Any, dtype: torch.dtype) -> PanelOps | None:
    """The panel kernel that ``native`` (engine.kernels.NativeOps, or None) has for ``dtype``
    layers: float32 always, bfloat16 where it was built with bfloat16 panels."""
    if native is None:
        return None
    if dtype == torch.float32:
        return native.panel_linear, native.pack_panels, native.gated_panel_linear
    if dtype == torch.bfloat16 and native.bf16_panels:
        return native.panel_linear_bf16, native.pack_panels_bf16, native.gated_panel_linear_bf16
    return None


def onednn_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's layout on this CPU: float32 anywhere oneDNN runs; bfloat16 only where oneDNN has
    bf16 kernels (AVX-512 BF16/AVX-NE-CONVERT; elsewhere its reorder raises)."""
    if not (device.type == "cpu" and dtype in _DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.bfloat16:
        check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return bool(check()) if check is not None else False
    return True


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Packed layers on this device: any CPU float32/bfloat16 model. Where oneDNN has no layout for
    the dtype (bfloat16 on AVX2 CPUs) a layer holds its plain weight until the panel kernel takes
    it, and multiplies with ``F.linear`` meanwhile."""
    return device.type == "cpu" and dtype in _DTYPES


def _onednn_layout(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's blocked layout, or None where oneDNN has none for its dtype."""
    if not onednn_supported(weight.device, weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_HINT_ROWS)


def unpack_panels(panels: torch.Tensor, out_features: int, paired: bool = False) -> torch.Tensor:
    """The plain weight [out_features, in_features] that `pack_panels` laid out as ``panels``
    [P, in_features, width] (``paired``: a gated layer's panels, gate outputs in each panel's
    first half and the up outputs of the same indices in its second). An exact copy."""
    def columns(part: torch.Tensor, count: int) -> torch.Tensor:  # [P, K, w] -> [P * w, K][:count]
        return part.permute(0, 2, 1).reshape(-1, part.shape[1])[:count]

    if not paired:
        return columns(panels, out_features).contiguous()
    half = panels.shape[2] // 2
    return torch.cat([columns(panels[:, :, :half], out_features // 2),
                      columns(panels[:, :, half:], out_features // 2)])


def unpack_panels_bf16(panels: torch.Tensor, out_features: int, paired: bool = False) -> torch.Tensor:
    """The plain weight [out_features, in_features] that `pack_panels_bf16` laid out as ``panels``
    [P, in_features / 2, width, 2] (``paired`` as in `unpack_panels`). An exact copy."""
    def columns(part: torch.Tensor, count: int) -> torch.Tensor:  # [P, K2, w, 2] -> [P * w, 2 K2][:count]
        return part.permute(0, 2, 1, 3).reshape(-1, part.shape[1] * 2)[:count]

    if not paired:
        return columns(panels, out_features).contiguous()
    half = panels.shape[2] // 2
    return torch.cat([columns(panels[:, :, :half], out_features // 2),
                      columns(panels[:, :, half:], out_features // 2)])


class PackedLinear(nn.Module):
    """``y = x Wᵀ + b`` with W held once: in oneDNN's blocked layout (`packed`), as it is
    (`plain`, where oneDNN has no layout for the dtype), or with the native panel kernel attached
    (`use_panel_kernel`) in its panels (`panels`), which then take every row count. ``gated``: this is a gated MLP's gate|up layer (W = [gate; up], the
    intermediate size); with the gated panel kernel its panels pair each gate output with its up
    output, so `silu_mul` can apply the activation in the matmul's epilogue."""

    panel: Callable[..., torch.Tensor] | None = None
    gated_panel: Callable[..., torch.Tensor] | None = None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, gated: int | None = None,
                 panels: PanelOps | None = None) -> None:
        """``panels``: lay the weight out straight in this panel kernel's panels (where it takes
        the layer), not in oneDNN's layout first."""
        super().__init__()
        self.in_features = int(weight.shape[1])
        self.out_features = int(weight.shape[0])
        self.dtype = weight.dtype
        self.gated = gated
        self.packed: torch.Tensor | None
        self.plain: torch.Tensor | None
        self.panels: torch.Tensor | None
        self.bias: torch.Tensor | None
        self.panel_ops: PanelOps | None = None  # the ops whose panels it holds
        self.register_buffer("packed", None)
        self.register_buffer("plain", None)
        self.register_buffer("panels", None)
        self.register_buffer("bias", None if bias is None else bias.detach())
        if panels is not None and self.takes_panels():
            self._hold_panels(weight.detach(), panels)
        else:
            self.packed = _onednn_layout(weight)
            self.plain = weight.detach().contiguous() if self.packed is None else None

    def takes_panels(self) -> bool:
        """The panel kernels take float32 layers, and bfloat16 ones with an even input width."""
        return self.dtype == torch.float32 or (self.dtype == torch.bfloat16 and self.in_features % 2 == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.panels is not None:
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            if self.gated_panel is not None:
                y = self.gated_panel(rows, self.panels, self.bias, self.gated, False)
            else:
                assert self.panel is not None  # panels come with their kernel
                y = self.panel(rows, self.panels, self.bias, self.out_features)
        elif self.plain is not None:
            y = F.linear(rows, self.plain, self.bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self.packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``SiLU(gate) * up`` of this gated layer's output for ``x`` ([..., gated]), the activation
        computed in the panel kernel's epilogue: no [rows, 2 x gated] output written and read
        back. None where the layer cannot: not gated, or no gated panels."""
        if self.gated_panel is None or self.gated is None or self.panels is None:
            return None
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return self.gated_panel(rows, self.panels, self.bias, self.gated, True).reshape(*x.shape[:-1], self.gated)

    def dense_weight(self) -> torch.Tensor:
        """W [out_features, in_features] rebuilt from the form held (a new tensor: to repack the
        layer or to fuse it with others; exact)."""
        if self.panels is not None:
            unpack = unpack_panels_bf16 if self.panels.dim() == 4 else unpack_panels
            return unpack(self.panels, self.out_features, paired=self.gated_panel is not None)
        if self.plain is not None:
            return self.plain.clone()
        assert self.packed is not None
        return self.packed.to_dense()

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of W (indices of any shape → [..., in_features]) read from the panels (a
        tied output head's table, for `TiedEmbedding`)."""
        assert self.panels is not None and self.gated_panel is None, "rows are read from plain panels"
        width = self.panels.shape[2]
        if self.panels.dim() == 4:  # bfloat16 panels: feature pairs side by side
            return self.panels[index // width, :, index % width, :].flatten(-2)
        return self.panels[index // width, :, index % width]

    def to_panels(self, linear: Callable[..., torch.Tensor], pack: Callable[..., torch.Tensor],
                  gated: Callable[..., torch.Tensor] | None = None) -> None:
        """Hold the weight as the panel kernel's panels (``pack``), multiplied by ``linear`` (and
        ``gated`` for a gated layer's paired panels), instead of oneDNN's layout."""
        if self.panels is None:
            self._hold_panels(self.dense_weight(), (linear, pack, gated))
        self.panel = linear
        self.panel_ops = (linear, pack, gated)

    def _hold_panels(self, weight: torch.Tensor, ops: PanelOps) -> None:
        linear, pack, gated = ops
        pair = gated is not None and self.gated is not None
        self.panels = pack(weight, True) if pair else pack(weight)
        self.panel, self.gated_panel = linear, gated if pair else None
        self.packed = self.plain = None
        self.panel_ops = ops

    def to_onednn(self) -> None:
        """Hold the weight in oneDNN's layout again, or as it is where oneDNN has none for the
        dtype (the panel kernel taken away)."""
        if self.panels is not None:
            weight = self.dense_weight()
            self.packed = _onednn_layout(weight)
            self.plain = weight if self.packed is None else None
            self.panels = None
        self.panel = self.gated_panel = self.panel_ops = None


class TiedEmbedding(nn.Module):
    """The input embedding of a model whose output head shares its table (tied weights), once the
    head is packed: rows come from the head's panels where it holds them, so the table is held
    once; else from the plain table (oneDNN's layout is not read row by row), which
    `use_panel_kernel` drops and restores as the head changes form (`settle`)."""

    def __init__(self, head: PackedLinear, weight: torch.Tensor) -> None:
        super().__init__()
        self.head = head
        self.weight: torch.Tensor | None
        self.register_buffer("weight", weight.detach())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.embedding(input_ids, self.weight)
        return self.head.rows(input_ids)

    def settle(self) -> None:
        """Hold the plain table only while the head holds no panels to read rows from."""
        if self.head.panels is not None:
            self.weight = None
        elif self.weight is None:
            self.weight = self.head.dense_weight()


class FusedGateUpMLP(nn.Module):
    """A gated MLP (Llama/Qwen2/Mistral): ``down(act(gate(x)) * up(x))`` with gate|up in one matmul."""

    def __init__(self, mlp: Any, panels: PanelOps | None = None) -> None:
        super().__init__()
        self.intermediate = int(mlp.gate_proj.weight.shape[0])
        weight = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        bias = None
        if mlp.gate_proj.bias is not None:
            bias = torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
        self.gate_up = PackedLinear(weight, bias, gated=self.intermediate, panels=panels)
        del weight
        self.down = PackedLinear(mlp.down_proj.weight, mlp.down_proj.bias, panels=panels)
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


def pack_model(model: nn.Module, device: torch.device, dtype: torch.dtype, panels: PanelOps | None = None) -> int:
    """Replace the model's linear layers (and gated MLPs) by packed ones; returns how many.
    ``panels`` (`panel_ops`): lay the weights out in that panel kernel's panels at once, rather
    than in oneDNN's layout for `use_panel_kernel` to repack later. The
    replaced layers' own weights are released; a tied output head's table stays with the input
    embedding (`TiedEmbedding`) until the head holds panels. What stays of the model (embedding,
    norms, biases) is copied out of the weights file's memory map, so that the map goes: the
    pages that packing read would otherwise stay resident, a second copy of every weight."""
    if not packing_supported(device, dtype):
        return 0
    embedding, head = _tied_pair(model)
    replaced = _pack_children(model, dtype, panels)
    packed_head = _get(model, "get_output_embeddings")
    if embedding is not None and head is not packed_head and isinstance(packed_head, PackedLinear):
        model.set_input_embeddings(TiedEmbedding(packed_head, embedding.weight))  # type: ignore[operator]
    if replaced:
        _own_memory(model)
    return replaced


def _get(model: nn.Module, getter: str) -> Any:
    method = getattr(model, getter, None)
    return method() if callable(method) else None


def _tied_pair(model: nn.Module) -> tuple[Any, Any]:
    """(input embedding, output head) where the two share one table, else (None, None)."""
    embedding, head = _get(model, "get_input_embeddings"), _get(model, "get_output_embeddings")
    if type(embedding) is nn.Embedding and type(head) is nn.Linear and head.bias is None \
            and callable(getattr(model, "set_input_embeddings", None)) \
            and head.weight.shape == embedding.weight.shape \
            and head.weight.data_ptr() == embedding.weight.data_ptr():
        return embedding, head
    return None, None


def _own_memory(model: nn.Module) -> None:
    """Copy the model's parameters and plain buffers into memory of their own (loaders map the
    weights file and hand out views of the map, which lives while any view does)."""
    seen: set[int] = set()
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                param.data = param.data.clone()
        for name, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_mkldnn and id(buffer) not in seen:
                seen.add(id(buffer))
                module._buffers[name] = buffer.clone()


def use_panel_kernel(modules: Iterable[nn.Module], linear: Callable[..., torch.Tensor] | None,
                     pack: Callable[..., torch.Tensor] | None = None,
                     gated: Callable[..., torch.Tensor] | None = None, bf16: PanelOps | None = None) -> int:
    """Give the float32 packed layers among ``modules`` the native panel kernel (``linear``, with
    ``pack`` to repack their weights into its panels, which replace oneDNN's layout); returns
    how many. With ``gated`` (the gated panel kernel), gated MLP layers (`PackedLinear.gated`)
    get panels that pair gate and up outputs (``pack(weight, True)``), for
    `PackedLinear.silu_mul`. ``bf16`` = (linear, pack, gated) of the bfloat16 panel kernel: the
    bfloat16 layers with an even number of input features take it the same way. ``linear=None``
    takes the kernels away and packs the layers for oneDNN again. A layer listed twice is
    converted once. A `TiedEmbedding` among ``modules`` then reads its rows from its head's
    panels, or holds its table again."""
    if linear is not None and pack is None:
        raise ValueError("use_panel_kernel needs the pack op that lays out the kernel's panels")
    modules = list(modules)
    done: set[int] = set()
    for module in modules:
        if not isinstance(module, PackedLinear) or id(module) in done:
            continue
        if linear is None:
            if module.panels is not None:
                done.add(id(module))
                module.to_onednn()
            continue
        if module.dtype == torch.float32:
            assert pack is not None
            module.to_panels(linear, pack, gated)
        elif module.dtype == torch.bfloat16 and bf16 is not None and module.takes_panels():
            module.to_panels(*bf16)
        else:
            continue
        done.add(id(module))
    for module in modules:
        if isinstance(module, TiedEmbedding):
            module.settle()
    return len(done)


def _pack_children(parent: nn.Module, dtype: torch.dtype, panels: PanelOps | None) -> int:
    replaced = 0
    for name, child in list(parent.named_children()):
        new: nn.Module | None = None
        if hasattr(child, "act_fn") and all(isinstance(getattr(child, n, None), nn.Linear)
                                            for n in ("gate_proj", "up_proj", "down_proj")):
            mlp: Any = child
            new, width = FusedGateUpMLP(mlp, panels), int(mlp.gate_proj.weight.shape[1])
        elif type(child) is nn.Linear:
            new, width = PackedLinear(child.weight, child.bias, panels=panels), child.in_features
        if new is None:
            replaced += _pack_children(child, dtype, panels)
        elif _agrees(child, new, width, dtype):
            setattr(parent, name, new)
            replaced += 1
        else:
            logger.warning("packed %s disagrees with the original layer; keeping the original", name)
    return replaced
