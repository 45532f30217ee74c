"""A numerical self-check of a native kernel build before the engine trusts it.

The kernels are compiled on the serving machine, by whatever compiler and torch it has: a build
we never ran before must not reach a model's logits unchecked. `first_mismatch` runs each op once
on small seeded inputs shaped to reach its vector loops and their tails (head size 64, row counts
that are not multiples of the tiles) and compares with the same arithmetic in PyTorch; a few
milliseconds, once per process. (What first prompted it, logits off on a GCC 13 / torch 2.11
machine, turned out to be a racy test: docs/engine.md.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.direct_model import rotate_half

_RTOL = _ATOL = 1e-4  # what tests/engine/test_fast_decoder.py allows the whole decoder


def first_mismatch(ops: Any) -> str | None:
    """The name of the first op of `ops` (an engine.kernels.NativeOps) whose result differs from
    PyTorch's, with what differed; None when all agree."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    for name, check in (("silu_mul", _silu_mul), ("rms_norm", _rms_norm), ("add_rms_norm", _add_rms_norm),
                        ("panel_linear", _panel_linear), ("gated_panel_linear", _gated_panel_linear),
                        ("panel_linear_bf16", _panel_linear_bf16), ("fused ops bfloat16", _fused_bf16),
                        ("rope_write_kv", _rope_write_kv),
                        ("paged_attention", _paged_attention), ("paged_attention bfloat16", _paged_attention_bf16),
                        ("chunk_attention", _chunk_attention), ("chunk_attention bfloat16", _chunk_attention_bf16)):
        try:
            with torch.inference_mode():
                check(ops, rand)
        except Exception as exc:  # a wrong value, or an op that refuses what PyTorch takes
            return f"{name}: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"
    return None


def _close(got: torch.Tensor, expected: torch.Tensor, rtol: float = _RTOL, atol: float = _ATOL) -> None:
    """assert_close's test (|got - expected| <= atol + rtol * |expected|, same shape and dtype),
    without `torch.testing`, whose first call imports torch.distributed (~1.5 s of a start)."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        raise AssertionError(f"got {got.dtype} {tuple(got.shape)}, expected {expected.dtype} {tuple(expected.shape)}")
    if not torch.allclose(got, expected, rtol=rtol, atol=atol):
        worst = float((got.float() - expected.float()).abs().max())
        raise AssertionError(f"values differ by up to {worst:.3g} (rtol {rtol}, atol {atol})")


def _silu_mul(ops: Any, rand: Any) -> None:
    gate_up = rand(5, 2 * 44) * 4  # 44 = five 8-lane vectors and a scalar tail
    gate, up = gate_up.chunk(2, dim=1)
    _close(ops.silu_mul(gate_up), F.silu(gate) * up)


def _rms_norm(ops: Any, rand: Any) -> None:
    x, weight = rand(5, 72), rand(72)
    _close(ops.rms_norm(x, weight, 1e-5), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight)


def _add_rms_norm(ops: Any, rand: Any) -> None:
    x, residual, weight = rand(5, 72), rand(5, 72), rand(72)
    total = residual + x
    got = ops.add_rms_norm(x, residual, weight, 1e-5)
    _close(residual, total)
    _close(got, total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-5) * weight)


def _panel_linear(ops: Any, rand: Any) -> None:
    # 19 rows: a full row tile and a tail with either vector width; 37 outputs: a partial last panel
    x, weight, bias = rand(19, 24), rand(37, 24), rand(37)
    panels = ops.pack_panels(weight)
    _close(ops.panel_linear(x, panels, bias, 37), F.linear(x, weight, bias))
    _close(ops.panel_linear(x, panels, None, 37), F.linear(x, weight))


def _gated_panel_linear(ops: Any, rand: Any) -> None:
    # gate and up of 21 outputs each: a partial panel with either vector width
    x, weight, bias = rand(19, 24), rand(42, 24), rand(42)
    panels = ops.pack_panels(weight, True)
    full = F.linear(x, weight, bias)
    _close(ops.gated_panel_linear(x, panels, bias, 21, False), full)
    _close(ops.gated_panel_linear(x, panels, bias, 21, True), F.silu(full[:, :21]) * full[:, 21:])


def _panel_linear_bf16(ops: Any, rand: Any) -> None:
    """The bfloat16 panels (where the build has them): float32 sums rounded once, as F.linear in
    bfloat16 rounds; a gated layer's SiLU(gate) * up rounded as transformers' modules round it."""
    if not ops.bf16_panels:
        return
    x, weight, bias = rand(19, 24).bfloat16(), rand(37, 24).bfloat16(), rand(37).bfloat16()
    panels = ops.pack_panels_bf16(weight)
    _close(ops.panel_linear_bf16(x, panels, bias, 37), F.linear(x, weight, bias), rtol=1e-2, atol=1e-2)
    gated = rand(42, 24).bfloat16()
    full = F.linear(x, gated)
    _close(ops.gated_panel_linear_bf16(x, ops.pack_panels_bf16(gated, True), None, 21, True),
           F.silu(full[:, :21]) * full[:, 21:], rtol=2e-2, atol=2e-2)


def _fused_bf16(ops: Any, rand: Any) -> None:
    """The fused steps in bfloat16 against the PyTorch ops on bfloat16 tensors (what
    engine.fast_decoder runs without them): equal but for the order of sums, a bfloat16 step."""
    def close(got: torch.Tensor, expected: torch.Tensor) -> None:
        assert got.dtype == torch.bfloat16, got.dtype
        _close(got, expected, rtol=1.6e-2, atol=1e-2)

    x, residual, weight = rand(5, 72).bfloat16(), rand(5, 72).bfloat16(), rand(72).bfloat16()

    def norm(t: torch.Tensor) -> torch.Tensor:
        f = t.float()
        return weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()

    close(ops.rms_norm(x, weight, 1e-5), norm(x))
    total = residual + x
    close(ops.add_rms_norm(x, residual, weight, 1e-5), norm(total))
    close(residual, total)
    gate_up = (rand(5, 2 * 44) * 4).bfloat16()
    gate, up = gate_up.chunk(2, dim=1)
    close(ops.silu_mul(gate_up), F.silu(gate) * up)
    tokens, heads, kv_heads, dim, block = 5, 4, 2, 64, 4
    q, k, v = rand(tokens, heads, dim).bfloat16(), rand(tokens, kv_heads, dim).bfloat16(), \
        rand(tokens, kv_heads, dim).bfloat16()
    cos, sin = rand(tokens, dim).bfloat16(), rand(tokens, dim).bfloat16()
    k_cache, v_cache = torch.zeros(3, block, kv_heads, dim, dtype=torch.bfloat16), \
        torch.zeros(3, block, kv_heads, dim, dtype=torch.bfloat16)
    blocks, offsets = torch.tensor([2, 0, 0, 1, 2]), torch.tensor([0, 3, 1, 2, 3])
    q_rot, k_rot = _rotate(q, cos, sin), _rotate(k, cos, sin)
    ops.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, blocks, offsets)
    close(q, q_rot)
    close(k_cache[blocks, offsets], k_rot)
    assert torch.equal(v_cache[blocks, offsets], v)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos[:, None] + rotate_half(x) * sin[:, None]  # what engine.fast_decoder's PyTorch path does


def _rope_write_kv(ops: Any, rand: Any) -> None:
    tokens, heads, kv_heads, dim, block = 5, 4, 2, 64, 4
    q, k, v = rand(tokens, heads, dim), rand(tokens, kv_heads, dim), rand(tokens, kv_heads, dim)
    angle = rand(tokens, dim)
    cos, sin = angle.cos(), angle.sin()
    k_cache, v_cache = torch.zeros(3, block, kv_heads, dim), torch.zeros(3, block, kv_heads, dim)
    blocks, offsets = torch.tensor([2, 2, 0, 1, 1]), torch.tensor([0, 3, 1, 2, 0])
    q_expected, k_expected = _rotate(q, cos, sin), _rotate(k, cos, sin)
    ops.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, blocks, offsets)
    _close(q, q_expected)
    _close(k, k_expected)
    _close(k_cache[blocks, offsets], k_expected)
    _close(v_cache[blocks, offsets], v)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                              q_start: torch.Tensor, ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """What `paged_attention` computes (its shapes), by PyTorch: each span's context gathered from
    its blocks, SDPA with a causal mask at the rows' positions."""
    block, kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    outs = []
    for s in range(len(ctx_lens)):
        n, ctx = int(q_start[s + 1] - q_start[s]), int(ctx_lens[s])
        blocks = tables[s][: -(-ctx // block)]
        k = k_cache.index_select(0, blocks).reshape(-1, kv_heads, head_dim)[:ctx].transpose(0, 1)[None]
        v = v_cache.index_select(0, blocks).reshape(-1, kv_heads, head_dim)[:ctx].transpose(0, 1)[None]
        rows = q[int(q_start[s]) : int(q_start[s + 1])].transpose(0, 1)[None]
        positions = torch.arange(ctx - n, ctx)
        mask = (torch.arange(ctx)[None, :] <= positions[:, None])[None, None]
        o = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def _paged_attention(ops: Any, rand: Any) -> None:
    heads, kv_heads, dim, block = 4, 2, 64, 8
    k_cache, v_cache = rand(6, block, kv_heads, dim), rand(6, block, kv_heads, dim)
    tables = torch.tensor([[4, 1, 5], [2, 0, 0]])
    # a 3-row chunk over 21 keys (a 9-key tail of 8-key scores), a decode; two splits of 16 keys
    q_start, ctx_lens = torch.tensor([0, 3, 4]), torch.tensor([21, 9])
    q = rand(4, heads, dim)
    scale = dim ** -0.5
    _close(ops.paged_attention(q, k_cache, v_cache, tables, q_start, ctx_lens, scale, 16),
           paged_attention_reference(q, k_cache, v_cache, tables, q_start, ctx_lens, scale))


def _bf16_attention(op: Any, rand: Any, blocks: int, tables: list[list[int]], q_start: list[int],
                    ctx_lens: list[int], last: int) -> None:
    """``op`` (an attention kernel, its last argument ``last``) on a bfloat16 query over a bfloat16
    pool: within bfloat16 rounding of SDPA in float32 on the same values, and bfloat16 back."""
    heads, kv_heads, dim, block = 6, 2, 64, 8
    k_cache, v_cache = (rand(blocks, block, kv_heads, dim).bfloat16() for _ in range(2))
    table_t, starts, lens = torch.tensor(tables), torch.tensor(q_start), torch.tensor(ctx_lens)
    q = rand(q_start[-1], heads, dim).bfloat16()
    scale = dim ** -0.5
    got = op(q, k_cache, v_cache, table_t, starts, lens, scale, last)
    expected = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), table_t, starts, lens, scale)
    assert got.dtype == torch.bfloat16, got.dtype
    _close(got.float(), expected, rtol=1e-2, atol=1e-2)


def _paged_attention_bf16(ops: Any, rand: Any) -> None:
    """The few-row kernel's spans (below) in bfloat16."""
    _bf16_attention(ops.paged_attention, rand, 6, [[4, 1, 5], [2, 0, 0]], [0, 3, 4], [21, 9], 16)


def _chunk_attention(ops: Any, rand: Any) -> None:
    heads, kv_heads, dim, block = 6, 2, 64, 8
    k_cache, v_cache = rand(12, block, kv_heads, dim), rand(12, block, kv_heads, dim)
    tables = torch.tensor([[4, 1, 5, 9, 2, 11, 3, 0, 7, 10], [6, 8, 0, 0, 0, 0, 0, 0, 0, 0]])
    # 20 rows over 75 keys (60 rows per KV head: a full and a part row tile; a key tile of 64
    # and an 11-key tail), and a causal prompt of 9 rows; units of two row tiles
    q_start, ctx_lens = torch.tensor([0, 20, 29]), torch.tensor([75, 9])
    q = rand(29, heads, dim)
    scale = dim ** -0.5
    _close(ops.chunk_attention(q, k_cache, v_cache, tables, q_start, ctx_lens, scale, 2),
           paged_attention_reference(q, k_cache, v_cache, tables, q_start, ctx_lens, scale))


def _chunk_attention_bf16(ops: Any, rand: Any) -> None:
    """The chunk kernel's spans (above) in bfloat16."""
    _bf16_attention(ops.chunk_attention, rand, 12, [[4, 1, 5, 9, 2, 11, 3, 0, 7, 10], [6, 8] + [0] * 8],
                    [0, 20, 29], [75, 9], 2)
