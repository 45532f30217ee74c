"""The decoder stack of a Llama-family model (Llama, Mistral, Qwen2) run without transformers'
per-module Python, on the model's own weights.

transformers' decoder layer spends a decode step's time in ~40 small ops and a dozen module
calls per layer (RMSNorm alone is six ops); at 16 decode rows those cost more than the layer's
attention. `FastDecoder` runs the same arithmetic as one short loop per layer:

    x, residual = add_rms_norm(h, residual)          # residual add fused into the norm
    q, k, v     = qkv(x)                             # q/k/v projections as one matmul
    rope_write_kv(q, k, v)                           # rotary in place + K/V into the paged pool
    h           = o_proj(attend(q, k, v))            # engine.attention (native kernel or SDPA)
    x, residual = add_rms_norm(h, residual)
    h           = down(silu_mul(gate_up(x)))       # SiLU in the matmul's epilogue (packing.py)

With the native CPU ops (engine.kernels, float32 or bfloat16, the latter rounding where
transformers' bfloat16 modules round) each fused step is one op; without them (no compiler,
CUDA, float16) the same steps run as the PyTorch ops transformers' modules use.
Rotary cos/sin come from the model's own rotary module (so every RoPE scaling type transformers
knows stays right). `FastDecoder.unsupported` says why a model cannot take this path (another
architecture, an activation other than SiLU, q/k norms); the runner then keeps transformers'
modules. Measured: docs/engine.md.

Fusing q/k/v (and gate/up, where packing did not) concatenates their weights once; the fused
layer then stands in for the originals in transformers' module tree too (`_Part`: a slice of its
output), so the model holds each weight once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, attend, write_kv
from engine.direct_model import rotate_half
from engine.kernels import NativeOps
from engine.packing import FusedGateUpMLP, PackedLinear

_ARCHITECTURES = ("llama", "mistral", "qwen2")


class _PlainLinear(nn.Module):
    """``y = x Wᵀ + b`` on a plain weight: a fused layer where the layers fused were not packed."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _Part(nn.Module):
    """Output columns ``start:end`` of a fused layer, in place of the projection fused into it:
    transformers' modules (a forward outside the fast decoder) still compute that projection,
    and no second copy of its weight stays alive."""

    def __init__(self, fused: nn.Module, start: int, end: int) -> None:
        super().__init__()
        self.fused, self.start, self.end = fused, start, end

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)[..., self.start : self.end].contiguous()


def _fuse(parent: Any, names: tuple[str, ...], gated: bool = False) -> nn.Module:
    """The linear layers ``parent.<names>`` (over one input) as one layer, their weights
    concatenated once, each original replaced by a `_Part` of it. ``gated``: the layers are a
    gated MLP's gate and up projections, in that order. Packed layers fuse into a packed layer.
    A parent fused before (another decoder over the same model) gives its fused layer again."""
    layers = [getattr(parent, name) for name in names]
    if all(isinstance(layer, _Part) for layer in layers) and len({id(layer.fused) for layer in layers}) == 1:
        return layers[0].fused
    weights = [layer.dense_weight() if isinstance(layer, PackedLinear) else layer.weight.detach() for layer in layers]
    biases: list[torch.Tensor | None] = [layer.bias for layer in layers]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b.detach() if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(biases, weights, strict=True)])
    weight = torch.cat(weights)
    del weights
    fused: nn.Module
    if all(isinstance(layer, PackedLinear) for layer in layers):  # in the form the layers are in
        fused = PackedLinear(weight, bias, gated=int(layers[0].out_features) if gated else None,
                             panels=layers[0].panel_ops)
    else:
        fused = _PlainLinear(weight, bias)
    start = 0
    for name, layer in zip(names, layers, strict=True):
        width = int(layer.out_features)
        setattr(parent, name, _Part(fused, start, start + width))
        start += width
    return fused


@dataclass(slots=True)
class _Layer:
    index: int
    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    qkv: nn.Module
    o_proj: nn.Module
    gate_up: nn.Module
    down: nn.Module
    scaling: float


class FastDecoder:
    """Callable as ``decoder(input_ids [T], positions [T], meta) -> hidden [T, hidden_size]``."""

    def __init__(self, model: Any, native: NativeOps | None) -> None:
        reason = self.unsupported(model)
        if reason is not None:
            raise ValueError(f"FastDecoder cannot run this model: {reason}")
        decoder = model.get_decoder()
        config = model.config
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.final_norm = decoder.norm.weight
        self.final_eps = float(decoder.norm.variance_epsilon)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        self.native: NativeOps | None = None
        self.use_native(native)
        self.layers = [self._layer(i, layer) for i, layer in enumerate(decoder.layers)]

    def use_native(self, native: NativeOps | None) -> None:
        """Run the fused steps on ``native`` (CPU float32 and bfloat16 models), or on PyTorch's ops (None)."""
        usable = self.final_norm.dtype in (torch.float32, torch.bfloat16) and self.final_norm.device.type == "cpu"
        self.native = native if usable else None

    def modules(self) -> list[nn.Module]:
        """The layers each decoder layer runs (the fused q/k/v and gate/up among them)."""
        return [m for layer in self.layers for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]

    @staticmethod
    def unsupported(model: Any) -> str | None:
        """Why ``model`` cannot take the fast path, or None if it can."""
        config = getattr(model, "config", None)
        if getattr(config, "model_type", None) not in _ARCHITECTURES:
            return f"model_type {getattr(config, 'model_type', None)!r} is not one of {_ARCHITECTURES}"
        if getattr(config, "hidden_act", None) not in ("silu", "swish"):
            return f"activation {getattr(config, 'hidden_act', None)!r} is not SiLU"
        decoder = model.get_decoder()
        for part in ("embed_tokens", "rotary_emb", "norm", "layers"):
            if not hasattr(decoder, part):
                return f"the decoder has no {part}"
        for layer in decoder.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if attn is None or mlp is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
                return "a layer lacks the q/k/v/o projections or the MLP"
            if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
                return "the attention normalises q/k"
            if not isinstance(mlp, FusedGateUpMLP) and not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
                return "the MLP is not a gated gate/up/down MLP"
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                if not hasattr(norm, "variance_epsilon") or getattr(norm, "weight", None) is None:
                    return "a norm is not an RMSNorm with a weight"
        return None

    def _layer(self, index: int, layer: Any) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        gate_up: nn.Module
        if isinstance(mlp, FusedGateUpMLP):
            gate_up, down = mlp.gate_up, mlp.down
        else:
            gate_up, down = _fuse(mlp, ("gate_proj", "up_proj"), gated=True), mlp.down_proj
        return _Layer(
            index=index, input_norm=layer.input_layernorm.weight,
            input_eps=float(layer.input_layernorm.variance_epsilon),
            post_norm=layer.post_attention_layernorm.weight,
            post_eps=float(layer.post_attention_layernorm.variance_epsilon),
            qkv=_fuse(attn, ("q_proj", "k_proj", "v_proj")), o_proj=attn.o_proj,
            gate_up=gate_up, down=down, scaling=float(getattr(attn, "scaling", self.head_dim ** -0.5)))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 keep: tuple[torch.Tensor, AttentionMetadata] | None = None) -> torch.Tensor:
        """``keep`` = (rows, their attention metadata): the last layer computes only those rows
        past writing its K/V — the only rows whose logits are wanted — and the result is theirs,
        in that order. Every other row's output of the last layer feeds nothing."""
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden.unsqueeze(0), positions.unsqueeze(0))
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        total = hidden.shape[0]
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        residual = hidden  # the embedding's own output: the adds below may write into it
        x = self._rms_norm(hidden, None, self.layers[0].input_norm, self.layers[0].input_eps) if self.layers else hidden
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(x)
            q = qkv[:, :q_width].view(total, self.num_heads, self.head_dim)
            k = qkv[:, q_width : q_width + kv_width].view(total, self.num_kv_heads, self.head_dim)
            v = qkv[:, q_width + kv_width :].view(total, self.num_kv_heads, self.head_dim)
            self._rope_write_kv(meta, layer.index, q, k, v, cos, sin)
            if keep is not None and i + 1 == len(self.layers):  # the last layer: only the sampled rows
                rows, rows_meta = keep
                if rows.numel() == 0:  # a chunk that samples nothing: its K/V were all it was for
                    return x.new_empty((0, x.shape[-1]))
                q, residual, total = q.index_select(0, rows), residual.index_select(0, rows), rows.numel()
                attn = attend(rows_meta, layer.index, q, k, v, layer.scaling)
            else:
                attn = attend(meta, layer.index, q, k, v, layer.scaling)
            h = layer.o_proj(attn.view(total, q_width))
            x = self._rms_norm(h, residual, layer.post_norm, layer.post_eps)
            h = layer.down(self._gated_act(layer.gate_up, x))
            if i + 1 < len(self.layers):
                nxt = self.layers[i + 1]
                x = self._rms_norm(h, residual, nxt.input_norm, nxt.input_eps)
            else:
                x = self._rms_norm(h, residual, self.final_norm, self.final_eps)
        return x

    # ---- the fused steps: native ops, or the PyTorch ops transformers' modules run ---------------

    def _rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
        """``residual += x`` (when given), then RMSNorm of the sum (of ``x`` without a residual)."""
        if self.native is not None:
            if residual is None:
                return self.native.rms_norm(x, weight, eps)
            return self.native.add_rms_norm(x, residual, weight, eps)
        if residual is not None:
            residual.add_(x)
            x = residual
        dtype = x.dtype
        y = x.to(torch.float32)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
        return weight * y.to(dtype)

    def _rope_write_kv(self, meta: AttentionMetadata, layer: int, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        if self.native is not None:
            self.native.rope_write_kv(q, k, v, cos, sin, meta.storage.keys(layer), meta.storage.values(layer),
                                      meta.slot_blocks, meta.slot_offsets)
            return
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        q.copy_(q * c + rotate_half(q) * s)
        k.copy_(k * c + rotate_half(k) * s)
        write_kv(meta, layer, k, v)

    def _gated_act(self, gate_up: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up: in the panel kernel's epilogue where the layer has gated panels
        (`PackedLinear.silu_mul`), else the matmul and then the activation."""
        if isinstance(gate_up, PackedLinear):
            fused = gate_up.silu_mul(x)
            if fused is not None:
                return fused
        return self._silu_mul(gate_up(x))

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

