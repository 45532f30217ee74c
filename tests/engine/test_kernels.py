"""The native attention kernels (few-row `paged_attention`, many-row `chunk_attention`): the same
attention as PyTorch's SDPA over gathered blocks, for every span shape the runner gives them, and
a clean fallback where they cannot be built."""

from __future__ import annotations

import logging
import platform
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import rotate_half

from engine import kernels
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kernel_check import paged_attention_reference
from engine.model import load_model
from engine.outputs import GenerateRequest
from engine.packing import PackedLinear
from engine.sampling_params import SamplingParams

ops = kernels.load()
op = ops.paged_attention if ops is not None else None
chunk_op = ops.chunk_attention if ops is not None else None
needs_kernel = pytest.mark.skipif(op is None, reason="the native kernel cannot be built here (no C++ compiler)")

BS = 16


def _pool(kv_heads: int, head_dim: int, num_blocks: int = 64, layers: int = 3, seed: int = 0):
    """A KV pool laid out as KVStorage's ([block, layer, K|V, offset, head, dim]); layer 1's views."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_blocks, layers, 2, BS, kv_heads, head_dim, generator=gen)
    return kv[:, 1, 0], kv[:, 1, 1]


def _run(spans: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, split: int, seed: int,
         chunk: bool = False, num_blocks: int = 64):
    """The kernel's result and SDPA's for `spans` ((rows, context) each); `split` is the few-row
    kernel's key split, or with `chunk` the chunk kernel's row tiles per unit."""
    k_cache, v_cache = _pool(kv_heads, head_dim, num_blocks=num_blocks, seed=seed)
    rng = random.Random(seed)
    width = max(-(-ctx // BS) for _, ctx in spans)
    ids = list(range(k_cache.shape[0]))
    tables = torch.tensor([rng.sample(ids, width) for _ in spans], dtype=torch.long)
    q_start = torch.tensor([0] + [n for n, _ in spans]).cumsum(0)
    ctx_lens = torch.tensor([ctx for _, ctx in spans])
    q = torch.randn(int(q_start[-1]), heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    scale = head_dim ** -0.5
    got = (chunk_op if chunk else op)(q, k_cache, v_cache, tables, q_start, ctx_lens, scale, split)
    return got, paged_attention_reference(q, k_cache, v_cache, tables, q_start, ctx_lens, scale)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 48), (6, 1, 128),
                                                    (8, 2, 64), (4, 2, 64), (3, 3, 64)])
def test_kernel_matches_sdpa_over_gathered_blocks(heads: int, kv_heads: int, head_dim: int) -> None:
    # decodes at every block boundary, a short chunk, one row with a one-token context
    spans = [(1, 1), (1, 15), (1, 16), (1, 17), (5, 40), (8, 300), (1, 600)]
    got, expected = _run(spans, heads, kv_heads, head_dim, split=64, seed=heads)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_kernel
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spans=st.lists(st.integers(1, 8).flatmap(lambda n: st.tuples(st.just(n), st.integers(n, 400))),
                      min_size=1, max_size=6),
       split=st.sampled_from([1, 7, 16, 100, 256, 4096]), seed=st.integers(0, 1000))
def test_kernel_matches_sdpa_for_any_spans_and_split(spans: list[tuple[int, int]], split: int, seed: int) -> None:
    got, expected = _run(spans, 9, 3, 64, split, seed)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 48), (6, 1, 128), (4, 2, 16)])
@pytest.mark.parametrize("row_tiles", [1, 2, 3])
def test_chunk_kernel_matches_sdpa_over_gathered_blocks(heads: int, kv_heads: int, head_dim: int,
                                                       row_tiles: int) -> None:
    # a prefix hit's 64-row chunk over 700 keys, causal prompts (one past a key tile, one of a
    # single key), a chunk whose rows end inside a key tile, 9 rows right after one cached block
    spans = [(64, 700), (300, 300), (1, 1), (100, 130), (9, 25), (65, 65)]
    got, expected = _run(spans, heads, kv_heads, head_dim, split=row_tiles, seed=heads, chunk=True)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_kernel
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spans=st.lists(st.integers(1, 160).flatmap(lambda n: st.tuples(st.just(n), st.integers(n, 600))),
                      min_size=1, max_size=4),
       row_tiles=st.integers(1, 4), seed=st.integers(0, 1000))
def test_chunk_kernel_matches_sdpa_for_any_spans(spans: list[tuple[int, int]], row_tiles: int, seed: int) -> None:
    got, expected = _run(spans, 9, 3, 64, row_tiles, seed, chunk=True)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_chunk_kernel_reads_rows_of_a_wider_tensor() -> None:
    """The runner passes q as a view of the fused q/k/v projection (a row stride past H * D)."""
    k_cache, v_cache = _pool(3, 64)
    qkv = torch.randn(40, 15 * 64)
    q = qkv[:, : 9 * 64].view(40, 9, 64)
    tables, q_start, ctx_lens = torch.tensor([[3, 1, 4, 0]]), torch.tensor([0, 40]), torch.tensor([60])
    expected = paged_attention_reference(q.contiguous(), k_cache, v_cache, tables, q_start, ctx_lens, 0.125)
    torch.testing.assert_close(chunk_op(q, k_cache, v_cache, tables, q_start, ctx_lens, 0.125, 2), expected,
                               rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_row_kernel_reads_rows_of_a_wider_tensor(dtype: torch.dtype) -> None:
    """The runner passes the fast decoder's q as it is: a view of the fused q/k/v projection (a
    row stride past H * D); the result is the contiguous copy's, in q's dtype."""
    k_cache, v_cache = (t.to(dtype) for t in _pool(3, 64))
    qkv = torch.randn(6, 15 * 64).to(dtype)
    q = qkv[:, : 9 * 64].view(6, 9, 64)
    tables = torch.tensor([[3, 1, 4, 0], [5, 9, 2, 6]])
    q_start, ctx_lens = torch.tensor([0, 1, 6]), torch.tensor([60, 37])
    got = op(q, k_cache, v_cache, tables, q_start, ctx_lens, 0.125, 16)
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, op(q.contiguous(), k_cache, v_cache, tables, q_start, ctx_lens, 0.125, 16))
    expected = paged_attention_reference(q.float().contiguous(), k_cache.float(), v_cache.float(), tables, q_start,
                                         ctx_lens, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)
    with pytest.raises(RuntimeError, match="contiguous heads"):
        op(q.transpose(0, 1).contiguous().transpose(0, 1), k_cache, v_cache, tables, q_start, ctx_lens, 0.125, 16)


@needs_kernel
def test_chunk_kernel_rejects_inconsistent_input_with_a_clear_error() -> None:
    k_cache, v_cache = _pool(3, 64)
    q = torch.randn(20, 9, 64)
    tables, q_start = torch.tensor([[0, 1]], dtype=torch.long), torch.tensor([0, 20])
    with pytest.raises(RuntimeError, match="do not fit its table"):
        chunk_op(q, k_cache, v_cache, tables, q_start, torch.tensor([40]), 0.125, 2)
    with pytest.raises(RuntimeError, match="out of range"):
        chunk_op(q, k_cache, v_cache, torch.tensor([[0, 999]]), q_start, torch.tensor([20]), 0.125, 2)
    with pytest.raises(RuntimeError, match="row_tiles must be positive"):
        chunk_op(q, k_cache, v_cache, tables, q_start, torch.tensor([20]), 0.125, 0)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        k12, v12 = _pool(3, 12)
        chunk_op(torch.randn(20, 9, 12), k12, v12, tables, q_start, torch.tensor([20]), 0.125, 2)


@pytest.mark.skipif(kernels._compiler() is None or platform.system() != "Linux",
                    reason="no C++ compiler here: the PyTorch path is what runs")
def test_where_a_compiler_exists_the_kernels_build_and_pass_their_self_check() -> None:
    """Every kernel test here skips when `kernels.load()` gives None; with a compiler at hand that
    must mean a broken build or a kernel computing wrong values (the self-check refused it), and
    this test says so instead of letting the others skip."""
    assert ops is not None, "the native kernels failed to build or failed their self-check: see the log"


@needs_kernel
def test_kernel_rejects_inconsistent_input_with_a_clear_error() -> None:
    k_cache, v_cache = _pool(3, 64)
    q = torch.randn(2, 9, 64)
    tables = torch.tensor([[0, 1]], dtype=torch.long)
    with pytest.raises(RuntimeError, match="do not fit its table"):  # 40 tokens in two blocks
        op(q, k_cache, v_cache, tables, torch.tensor([0, 2]), torch.tensor([40]), 0.125, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        op(q, k_cache, v_cache, torch.tensor([[0, 999]]), torch.tensor([0, 2]), torch.tensor([20]), 0.125, 64)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        op(torch.randn(2, 8, 64), k_cache, v_cache, tables, torch.tensor([0, 2]), torch.tensor([20]), 0.125, 64)


@needs_kernel
def test_engine_outputs_and_logits_are_the_same_with_and_without_the_kernel(tiny_model_dir) -> None:
    """Decodes, a prefix hit with a short suffix (a kernel chunk) and a long prefill, both ways."""
    rng = random.Random(3)
    cores = {}
    outputs = {}
    for native in (True, False):
        core = EngineCore(EngineConfig(model="tiny", num_blocks=128, max_num_batched_tokens=512, device="cpu",
                                       native_kernels=native), loaded=load_model(str(tiny_model_dir), device="cpu"))
        assert (core.runner.paged_kernel is not None) is native
        assert (core.runner.chunk_kernel is not None) is native
        rng = random.Random(3)
        doc = [rng.randrange(3, core.vocab_size) for _ in range(90)]
        prompts = [doc, doc + [5, 6, 7], [rng.randrange(3, core.vocab_size) for _ in range(40)], doc[:33]]
        out: dict[str, list[int]] = {}
        for i, ids in enumerate(prompts):
            core.add_request(GenerateRequest(str(i), list(ids),
                                             SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)))
            while core.has_work():
                for o in core.step():
                    out.setdefault(o.request_id, []).append(o.token_id)
        assert core.counters.cached_prompt_tokens >= 80  # the suffix prompt hit the document's blocks
        cores[native], outputs[native] = core, out
    assert outputs[True] == outputs[False] and len(outputs[True]) == 4

    # the logits themselves, for a step mixing decode rows, a 6-row chunk over a cached context
    # (few-row kernel), a 20-row chunk over a cached context and a cold 30-token prompt (chunk kernel)
    tables = [[0, 1, 2], [3], [4, 5], [6, 7, 8], [9, 10]]
    ids = [[11], [12], [13, 14, 15, 16, 17, 18], list(range(20, 40)), list(range(50, 80))]
    starts = [40, 9, 20, 25, 0]
    core = cores[True]
    rows = list(range(len(ids)))
    a = core.runner.execute(ids, starts, tables, rows)
    core.runner.paged_kernel = core.runner.chunk_kernel = None
    b = core.runner.execute(ids, starts, tables, rows)
    core.runner.paged_kernel, core.runner.chunk_kernel = op, chunk_op
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_transformers_modules_path_gives_the_same_logits_with_the_kernels(tiny_model_dir) -> None:
    """Models off the fast decoder reach the kernels through transformers' attention call, whose
    query is a transposed view: a cold prompt, a 20-row chunk over it and a decode, kernels on and
    off."""
    from cache.kv_storage import KVStorage
    from engine.runner import ModelRunner

    logits = []
    for native in (ops, None):
        loaded = load_model(str(tiny_model_dir), device="cpu")
        storage = KVStorage(16, loaded.num_layers, BS, loaded.num_kv_heads, loaded.head_dim, dtype=loaded.dtype,
                            device=loaded.device)
        runner = ModelRunner(loaded.model, storage, native, fast_decoder=False)
        assert runner.fast is None and (runner.chunk_kernel is not None) is (native is not None)
        first = runner.execute([list(range(3, 33))], [0], [[0, 1]], [0])
        second = runner.execute([list(range(40, 60))], [30], [[0, 1, 2, 3]], [0])
        third = runner.execute([[7]], [50], [[0, 1, 2, 3]], [0])  # a decode: the few-row kernel
        logits.append(torch.cat([first, second, third]))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)

    # a query laid out heads-first ([H, T, D] memory, as a model could hand it over) works too
    meta = runner._prepare([list(range(40, 60))], [30], [[0, 1, 2, 3]])[0]
    runner.chunk_kernel = chunk_op
    meta_kernel = runner._prepare([list(range(40, 60))], [30], [[0, 1, 2, 3]])[0]
    heads_first = torch.randn(loaded.model.config.num_attention_heads, 20, loaded.head_dim).transpose(0, 1)
    k_new = torch.randn(20, loaded.num_kv_heads, loaded.head_dim)
    v_new = torch.randn(20, loaded.num_kv_heads, loaded.head_dim)
    from engine.attention import attend

    torch.testing.assert_close(attend(meta_kernel, 0, heads_first, k_new, v_new, None),
                               attend(meta, 0, heads_first.contiguous(), k_new, v_new, None), rtol=1e-5, atol=1e-5)


def test_without_a_compiler_the_engine_falls_back_and_says_why(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("KVGATE_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")  # a "compiler" that fails
    with caplog.at_level(logging.WARNING, logger="engine.kernels"):
        assert kernels._build_and_load() is None
    assert "could not build or load" in caplog.text and "slower PyTorch path" in caplog.text
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob(".build-*"))  # nothing half-built left


def test_a_build_is_kept_per_cpu_and_source(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("KVGATE_KERNEL_DIR", raising=False)
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path))
    first = kernels.build_dir()
    assert first.parent == tmp_path / "kernels"
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: "fpu sse2")
    assert kernels.build_dir() != first and kernels.build_dir().parent == first.parent


def test_engine_without_native_kernels_uses_the_pytorch_path(tiny_model_dir) -> None:
    core = EngineCore(EngineConfig(model=str(tiny_model_dir), num_blocks=32, native_kernels=False))
    assert core.runner.paged_kernel is None and core.runner.chunk_kernel is None


needs_ops = pytest.mark.skipif(ops is None, reason="the native ops cannot be built here (no C++ compiler)")


@needs_ops
def test_fused_elementwise_ops_match_their_pytorch_formulas() -> None:
    assert ops is not None
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(7, 2 * 40, generator=gen) * 30  # past exp's range on both sides
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-6)

    x, residual, weight = torch.randn(5, 48, generator=gen), torch.randn(5, 48, generator=gen), torch.randn(48)
    total = residual + x

    def rms(t: torch.Tensor) -> torch.Tensor:
        return weight * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6))

    torch.testing.assert_close(ops.add_rms_norm(x, residual, weight, 1e-6), rms(total))
    torch.testing.assert_close(residual, total)  # the residual stream now holds the sum
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), rms(x))


@needs_ops
def test_rope_write_kv_rotates_in_place_and_refuses_slots_outside_the_pool() -> None:
    assert ops is not None
    k_cache, v_cache = _pool(2, 8, num_blocks=4)
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    angles = torch.randn(3, 4)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rotated(t: torch.Tensor) -> torch.Tensor:
        return t * cos[:, None] + rotate_half(t) * sin[:, None]

    expected_q, expected_k = rotated(q), rotated(k)
    blocks, offsets = torch.tensor([2, 2, 0]), torch.tensor([0, 15, 3])
    ops.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, blocks, offsets)
    torch.testing.assert_close(q, expected_q)
    torch.testing.assert_close(k_cache[blocks, offsets], expected_k)
    torch.testing.assert_close(v_cache[blocks, offsets], v)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, torch.tensor([2, 4, 0]), offsets)


def scale_for(in_features: int) -> float:
    """x's scale in a panel test: 1 up to 576 features, beyond that 1 / sqrt(features / 576), so
    the sums stay the size 576 features give (a sum of 4,096 unit products, summed in another
    order than F.linear's, strays further than the float32 tolerances below)."""
    return min(1.0, (576 / in_features) ** 0.5)


@needs_ops
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 14, 15, 17, 64, 100, 301])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (97, 576), (33, 40), (1, 8), (64, 1), (40, 4096)])
def test_panel_linear_matches_f_linear(rows: int, out_features: int, in_features: int) -> None:
    # row counts around the row tiles (6 and 14, one panel or two at once); outputs that fill
    # panels of 16 or 32 columns exactly (an odd count of them: one left alone), by one column
    # more, or a panel's first column only; row ranges split between threads (301 rows); rows of
    # 16 KiB, so that 100 and 301 rows span several L2-sized row blocks (AVX2's one-panel tiles)
    assert ops is not None
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen) * scale_for(in_features)
    weight, bias = torch.randn(out_features, in_features, generator=gen), torch.randn(out_features, generator=gen)
    panels = ops.pack_panels(weight)
    # fp32 sums of in_features products, in another order than F.linear: 1e-5 up to 64 of them
    tol = 1e-5 * max(1.0, (in_features / 64) ** 0.5)
    assert panels.shape[1] == in_features and panels.shape[0] * panels.shape[2] >= out_features
    torch.testing.assert_close(ops.panel_linear(x, panels, bias, out_features), F.linear(x, weight, bias),
                               rtol=tol, atol=tol)
    torch.testing.assert_close(ops.panel_linear(x, panels, None, out_features), F.linear(x, weight), rtol=tol, atol=tol)
    wide = (torch.randn(rows, in_features + 5, generator=gen) * scale_for(in_features))[:, :in_features]  # strided
    torch.testing.assert_close(ops.panel_linear(wide, panels, None, out_features), F.linear(wide, weight),
                               rtol=tol, atol=tol)


@needs_ops
def test_panel_linear_refuses_what_does_not_fit() -> None:
    assert ops is not None
    weight = torch.randn(40, 24)
    panels = ops.pack_panels(weight)
    with pytest.raises(RuntimeError, match="x has 23 features, the panels 24"):
        ops.panel_linear(torch.randn(3, 23), panels, None, 40)
    with pytest.raises(RuntimeError, match="cannot hold 200 outputs"):
        ops.panel_linear(torch.randn(3, 24), panels, None, 200)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32 \\[40\\]"):
        ops.panel_linear(torch.randn(3, 24), panels, torch.randn(39), 40)
    with pytest.raises(RuntimeError, match="must come from this build's pack_panels"):
        ops.panel_linear(torch.randn(3, 24), weight.view(40, 24, 1), None, 40)
    with pytest.raises(RuntimeError, match="2-D float32 CPU weight"):
        ops.pack_panels(weight.double())
    assert ops.panel_linear(torch.randn(0, 24), panels, None, 40).shape == (0, 40)


@needs_ops
@pytest.mark.parametrize("rows", [1, 6, 7, 15, 64, 301])
@pytest.mark.parametrize("intermediate,in_features", [(48, 64), (49, 576), (17, 40), (1, 8), (20, 4096)])
def test_gated_panel_linear_matches_the_matmul_and_silu(rows: int, intermediate: int, in_features: int) -> None:
    # gate|up of 16/32-column panels exactly, one output more, one output; rows around both tiles
    assert ops is not None
    gen = torch.Generator().manual_seed(rows * 1000 + intermediate)
    x = torch.randn(rows, in_features, generator=gen) * scale_for(in_features)
    weight, bias = torch.randn(2 * intermediate, in_features, generator=gen), torch.randn(2 * intermediate, generator=gen)
    panels = ops.pack_panels(weight, True)
    tol = 1e-5 * max(1.0, (in_features / 64) ** 0.5)
    for b in (bias, None):
        full = F.linear(x, weight, b)
        gate, up = full[:, :intermediate], full[:, intermediate:]
        torch.testing.assert_close(ops.gated_panel_linear(x, panels, b, intermediate, False), full, rtol=tol, atol=tol)
        # SiLU(g) * u: the product's error grows with |u|
        torch.testing.assert_close(ops.gated_panel_linear(x, panels, b, intermediate, True), F.silu(gate) * up,
                                   rtol=tol, atol=tol * float(up.abs().max()))
    wide = (torch.randn(rows, in_features + 3, generator=gen) * scale_for(in_features))[:, :in_features]  # strided
    full = F.linear(wide, weight)
    torch.testing.assert_close(ops.gated_panel_linear(wide, panels, None, intermediate, True),
                               F.silu(full[:, :intermediate]) * full[:, intermediate:],
                               rtol=tol, atol=tol * float(full[:, intermediate:].abs().max()))


@needs_ops
def test_gated_panel_linear_refuses_what_does_not_fit() -> None:
    assert ops is not None
    weight = torch.randn(40, 24)
    panels = ops.pack_panels(weight, True)
    with pytest.raises(RuntimeError, match=r"gate and up rows \(41 rows is odd\)"):
        ops.pack_panels(torch.randn(41, 24), True)
    with pytest.raises(RuntimeError, match="cannot hold 40 outputs"):
        ops.gated_panel_linear(torch.randn(3, 24), panels, None, 40, True)  # 20 gate outputs, not 40
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32 \\[40\\]"):
        ops.gated_panel_linear(torch.randn(3, 24), panels, torch.randn(20), 20, True)  # gate and up biases
    with pytest.raises(RuntimeError, match="x has 23 features, the panels 24"):
        ops.gated_panel_linear(torch.randn(3, 23), panels, None, 20, False)
    assert ops.gated_panel_linear(torch.randn(0, 24), panels, None, 20, True).shape == (0, 20)
    assert ops.gated_panel_linear(torch.randn(0, 24), panels, None, 20, False).shape == (0, 40)


@needs_ops
def test_packed_layers_hold_one_form_of_their_weight_and_switch_both_ways() -> None:
    from engine.packing import use_panel_kernel

    assert ops is not None
    weight, bias = torch.randn(48, 32), torch.randn(48)
    layer = PackedLinear(weight, bias)
    assert layer.packed is not None and layer.packed.is_mkldnn and layer.panels is None  # oneDNN's layout only
    calls: list[int] = []

    def counting(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return ops.panel_linear(x, *args)

    assert use_panel_kernel([layer, torch.nn.ReLU(), layer], counting, ops.pack_panels) == 1
    assert layer.panels is not None and layer.packed is None  # the panels replace oneDNN's layout
    assert torch.equal(layer.dense_weight(), weight)
    with torch.inference_mode():
        for rows in (1, 16, 257, 600):  # the panel kernel takes every row count
            x = torch.randn(2, rows, 32)[1]
            torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert calls == [1, 16, 257, 600]
    use_panel_kernel([layer], None)
    assert layer.panel is None and layer.panels is None and layer.packed is not None and layer.packed.is_mkldnn
    assert torch.equal(layer.dense_weight(), weight)  # rebuilt exactly from the panels
    with torch.inference_mode():
        x = torch.randn(5, 32)
        torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert len(calls) == 4
    with pytest.raises(ValueError, match="needs the pack op"):
        use_panel_kernel([layer], ops.panel_linear)


@needs_ops
def test_a_gated_mlp_takes_the_activation_into_the_panel_kernel() -> None:
    from engine.packing import FusedGateUpMLP, use_panel_kernel

    assert ops is not None
    mlp = SimpleNamespace(gate_proj=torch.nn.Linear(32, 40), up_proj=torch.nn.Linear(32, 40),
                          down_proj=torch.nn.Linear(40, 32), act_fn=torch.nn.SiLU())
    fused = FusedGateUpMLP(mlp)
    layer = fused.gate_up
    assert layer.gated == 40 and layer.silu_mul(torch.randn(3, 32)) is None  # no kernel yet
    assert use_panel_kernel([layer, fused.down], ops.panel_linear, ops.pack_panels, ops.gated_panel_linear) == 2
    assert layer.gated_panel is not None and fused.down.gated_panel is None  # only the gated layer pairs
    with torch.inference_mode():
        torch.testing.assert_close(layer.dense_weight(), torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                                   rtol=0, atol=0)  # the paired panels unpack to gate over up
        for rows in (1, 16, 300):
            x = torch.randn(2, rows, 32)[1]
            gate, up = mlp.gate_proj(x), mlp.up_proj(x)
            # the layer's own output stays gate | up
            torch.testing.assert_close(layer(x), torch.cat([gate, up], -1), rtol=1e-5, atol=1e-5)
            act = layer.silu_mul(x)
            assert act is not None
            torch.testing.assert_close(act, F.silu(gate) * up, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(fused(x), mlp.down_proj(F.silu(gate) * up), rtol=1e-5, atol=1e-5)
    use_panel_kernel([layer], None)
    assert layer.gated_panel is None and layer.silu_mul(torch.randn(3, 32)) is None
    with torch.inference_mode():
        x = torch.randn(4, 32)
        torch.testing.assert_close(layer(x), torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1), rtol=1e-5, atol=1e-5)


def _off_by_a_little(name: str, real):
    """`real` with its result (or, for the in-place ops, what it writes) off by 0.01 in one place."""
    def wrong(*args):
        out = real(*args)
        if name == "rope_write_kv":
            args[5][args[7][0], args[8][0], 0, 0] += 0.01  # one key written to the pool
        elif name == "add_rms_norm":
            args[1][0, 0] += 0.01  # the residual it updates in place
        else:
            out[(0,) * out.dim()] += 0.01
        return out
    return wrong


@needs_ops
def test_self_check_accepts_this_build() -> None:
    from engine.kernel_check import first_mismatch

    assert first_mismatch(ops) is None


@needs_ops
@pytest.mark.parametrize("name", ["silu_mul", "rms_norm", "add_rms_norm", "panel_linear", "gated_panel_linear",
                                  "rope_write_kv", "paged_attention", "chunk_attention"])
def test_self_check_names_an_op_that_computes_wrong_values(name: str) -> None:
    import dataclasses

    from engine.kernel_check import first_mismatch

    broken = dataclasses.replace(ops, **{name: _off_by_a_little(name, getattr(ops, name))})
    assert (first_mismatch(broken) or "").startswith(f"{name}: ")


@needs_ops
def test_self_check_names_an_op_that_raises() -> None:
    import dataclasses

    from engine.kernel_check import first_mismatch

    def refuses(*args):  # type: ignore[no-untyped-def]
        raise TypeError("expected a Tensor")

    assert first_mismatch(dataclasses.replace(ops, rms_norm=refuses)) == "rms_norm: expected a Tensor"


@needs_ops
def test_a_build_that_fails_the_self_check_is_not_used(monkeypatch, caplog) -> None:
    from engine import kernel_check

    monkeypatch.setattr(kernel_check, "first_mismatch", lambda ops: "silu_mul: Tensor-likes are not close!")
    with caplog.at_level(logging.WARNING, logger="engine.kernels"):
        assert kernels._build_and_load() is None
    assert "compute wrong results on this machine (silu_mul: Tensor-likes are not close!)" in caplog.text
    assert "PyTorch path" in caplog.text


@needs_kernel
def test_the_last_layer_computes_only_the_sampled_rows(tiny_model_dir) -> None:
    """Trimmed (the last layer past its K/V only for the rows that sample) and untrimmed runs of
    one step give the same logits, and a step that samples nothing still writes every layer's K/V."""
    from cache.kv_storage import KVStorage
    from engine.runner import ModelRunner

    loaded = load_model(str(tiny_model_dir), device="cpu")
    storage = KVStorage(16, loaded.num_layers, BS, loaded.num_kv_heads, loaded.head_dim, dtype=loaded.dtype,
                        device=loaded.device)
    runner = ModelRunner(loaded.model, storage, ops)
    assert runner.fast is not None and runner.trim_last_layer
    runner.execute([list(range(3, 43))], [0], [[0, 1, 2]], [0])  # a cached context for the chunks below
    tables = [[0, 1, 2, 3], [4], [5, 6, 7], [8, 9]]
    ids = [[7], [8], list(range(50, 70)), list(range(80, 110))]
    starts = [40, 5, 0, 0]
    for rows in ([0, 1, 2, 3], [2], [1, 3], [3, 0]):
        trimmed = runner.execute(ids, starts, tables, rows)
        runner.trim_last_layer = False
        full = runner.execute(ids, starts, tables, rows)
        runner.trim_last_layer = True
        assert trimmed.shape == full.shape == (len(rows), loaded.model.config.vocab_size)
        torch.testing.assert_close(trimmed, full, rtol=1e-4, atol=1e-4)
    last = loaded.num_layers - 1
    storage.kv[8:10].zero_()
    assert runner.execute([list(range(80, 110))], [0], [[8, 9]], []).shape == (0, 0)  # a middle chunk
    trimmed_kv = storage.keys(last)[8:10].clone(), storage.values(last)[8:10].clone()
    assert torch.count_nonzero(trimmed_kv[0][1, :14]) > 0  # the last layer's K/V of tokens 16..29
    runner.trim_last_layer = False
    storage.kv[8:10].zero_()
    runner.execute([list(range(80, 110))], [0], [[8, 9]], [])
    torch.testing.assert_close(storage.keys(last)[8:10], trimmed_kv[0], rtol=0, atol=0)
    torch.testing.assert_close(storage.values(last)[8:10], trimmed_kv[1], rtol=0, atol=0)


@needs_kernel
def test_the_calibration_ops_measure_positive_rates_and_refuse_bad_input() -> None:
    assert ops is not None
    assert ops.fma_peak(100_000) > 0.1  # GFLOP/s: any CPU that builds the kernels does far more
    assert ops.read_bandwidth(torch.ones(1 << 20), 2) > 0.01  # GB/s
    assert ops.bf16_dot_peak(10_000) >= 0.0  # 0 where the CPU has no bfloat16 dot product
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.read_bandwidth(torch.ones(1 << 10, dtype=torch.float64), 1)
    with pytest.raises(RuntimeError, match="iters must be positive"):
        ops.fma_peak(0)


def _bf16_inputs(spans: list[tuple[int, int]], seed: int, head_dim: int = 64):
    """A bfloat16 query (9 heads over 3 KV heads of `head_dim`) and pool for `spans` ((rows,
    context) each)."""
    k_cache, v_cache = (t.bfloat16() for t in _pool(3, head_dim, seed=seed))
    rng = random.Random(seed)
    width = max(-(-ctx // BS) for _, ctx in spans)
    tables = torch.tensor([rng.sample(range(k_cache.shape[0]), width) for _ in spans], dtype=torch.long)
    q_start = torch.tensor([0] + [n for n, _ in spans]).cumsum(0)
    ctx_lens = torch.tensor([ctx for _, ctx in spans])
    q = torch.randn(int(q_start[-1]), 9, head_dim, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    return q, k_cache, v_cache, tables, q_start, ctx_lens


@needs_kernel
@given(spans=st.lists(st.tuples(st.integers(1, 8), st.integers(0, 70)), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_kernel_over_a_bfloat16_pool_matches_sdpa_in_float32(spans: list[tuple[int, int]], seed: int) -> None:
    """bfloat16 q and pool: read as float32, summed in float32, the output rounded once."""
    q, k_cache, v_cache, tables, q_start, ctx_lens = _bf16_inputs([(n, n + extra) for n, extra in spans], seed)
    got = op(q, k_cache, v_cache, tables, q_start, ctx_lens, 0.125, 32)
    expected = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, q_start, ctx_lens, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)
    mixed = op(q.float(), k_cache, v_cache, tables, q_start, ctx_lens, 0.125, 32)  # a float32 query, bf16 pool
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, expected, rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("split", [7, 32, 4096])
def test_few_row_kernel_over_a_bfloat16_pool_at_every_head_size(head_dim: int, split: int) -> None:
    """Head size 64 with AVX512-BF16 multiplies on `vdpbf16ps` in place (the weights rounded to
    bfloat16 in pairs of keys, an odd last key paired with a zero weight); other sizes, and CPUs
    without it, widen a copy of each split to float32: the float32 query's sums, rounded once."""
    spans = [(1, 1), (1, 2), (1, 15), (1, 16), (1, 17), (1, 33), (3, 47), (8, 300), (1, 301)]
    q, k_cache, v_cache, tables, q_start, ctx_lens = _bf16_inputs(spans, head_dim, head_dim)
    scale = head_dim ** -0.5
    expected = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, q_start, ctx_lens, scale)
    got = op(q, k_cache, v_cache, tables, q_start, ctx_lens, scale, split)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)
    mixed = op(q.float(), k_cache, v_cache, tables, q_start, ctx_lens, scale, split)
    if head_dim != 64 or ops.bf16_dot_peak(1_000) == 0.0:
        assert torch.equal(got, mixed.bfloat16())


@needs_kernel
@given(spans=st.lists(st.integers(1, 120).flatmap(lambda n: st.tuples(st.just(n), st.integers(n, 300))),
                      min_size=1, max_size=3),
       row_tiles=st.integers(1, 3), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_chunk_kernel_over_a_bfloat16_pool_matches_sdpa_in_float32(spans: list[tuple[int, int]], row_tiles: int,
                                                                   seed: int) -> None:
    """bfloat16 q and pool in the chunk kernel: float32 sums (with AVX512-BF16, `vdpbf16ps` on
    pairs, the weights rounded to bfloat16 as PyTorch's bfloat16 flash attention rounds them;
    else the pool widened to float32), the output rounded once."""
    q, k_cache, v_cache, tables, q_start, ctx_lens = _bf16_inputs(spans, seed)
    expected = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, q_start, ctx_lens, 0.125)
    got = chunk_op(q, k_cache, v_cache, tables, q_start, ctx_lens, 0.125, row_tiles)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)
    # a float32 query over the same pool: the pool widened, every step float32
    mixed = chunk_op(q.float(), k_cache, v_cache, tables, q_start, ctx_lens, 0.125, row_tiles)
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, expected, rtol=1e-4, atol=1e-4)
    if ops.bf16_dot_peak(1_000) == 0.0:  # no dot-product path: the same sums, rounded once
        assert torch.equal(got, mixed.bfloat16())


@needs_kernel
def test_a_bfloat16_engine_runs_its_steps_on_the_attention_kernels(tiny_model_dir) -> None:
    outputs = {}
    for native in (True, False):
        core = EngineCore(EngineConfig(model="tiny", dtype="bfloat16", num_blocks=64, device="cpu",
                                       native_kernels=native),
                          loaded=load_model(str(tiny_model_dir), dtype="bfloat16", device="cpu"))
        assert (core.runner.paged_kernel is not None) is native and (core.runner.chunk_kernel is not None) is native
        layers = [m for m in core.runner.modules() if isinstance(m, PackedLinear)]
        assert layers  # packed on every CPU, with or without a oneDNN bfloat16 layout
        # the linears on the bfloat16 panels wherever the build has them (AVX512-BF16 or AVX2)
        assert all((m.panels is not None) is (native and ops.bf16_panels) for m in layers)
        core.add_request(GenerateRequest("a", list(range(5, 45)), SamplingParams(max_tokens=8, temperature=0,
                                                                                   ignore_eos=True)))
        tokens = []
        while core.has_work():
            tokens += [o.token_id for o in core.step()]
        outputs[native] = tokens
    assert len(outputs[True]) == 8 and outputs[True] == outputs[False]


needs_bf16_panels = pytest.mark.skipif(ops is None or not ops.bf16_panels,
                                       reason="neither AVX512-BF16 nor AVX2 with FMA in this build")


@needs_bf16_panels
@pytest.mark.parametrize("rows", [1, 5, 6, 13, 100])
@pytest.mark.parametrize("out_features,in_features", [(37, 24), (64, 64), (129, 96)])
def test_bfloat16_panel_linear_matches_f_linear(rows: int, out_features: int, in_features: int) -> None:
    """Float32 sums rounded once: what F.linear gives in bfloat16 (here, bit for bit but for the
    order of the sums, so within one bfloat16 step)."""
    assert ops is not None
    gen = torch.Generator().manual_seed(rows * out_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    panels = ops.pack_panels_bf16(weight)
    width = panels.shape[2]  # 32 outputs per panel with AVX512-BF16, 16 with AVX2
    assert width in (16, 32) and panels.shape == (-(-out_features // width), in_features // 2, width, 2)
    got = ops.panel_linear_bf16(x, panels, bias, out_features)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-2, atol=2e-2)
    wide = torch.randn(rows, 2 * in_features, generator=gen).bfloat16()[:, :in_features]  # rows of a wider tensor
    torch.testing.assert_close(ops.panel_linear_bf16(wide, panels, None, out_features), F.linear(wide, weight),
                               rtol=1e-2, atol=2e-2)


@needs_bf16_panels
@pytest.mark.parametrize("rows", [1, 7, 30])
def test_bfloat16_gated_panels_round_as_transformers_modules_do(rows: int) -> None:
    assert ops is not None
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    weight, bias = torch.randn(2 * 40, 64, generator=gen).bfloat16(), torch.randn(2 * 40, generator=gen).bfloat16()
    panels = ops.pack_panels_bf16(weight, True)
    full = F.linear(x, weight, bias)
    torch.testing.assert_close(ops.gated_panel_linear_bf16(x, panels, bias, 40, False), full, rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(ops.gated_panel_linear_bf16(x, panels, bias, 40, True),
                               F.silu(full[:, :40]) * full[:, 40:], rtol=2e-2, atol=5e-2)


@needs_bf16_panels
def test_bfloat16_panels_refuse_what_does_not_fit() -> None:
    assert ops is not None
    with pytest.raises(RuntimeError, match="in_features must be even"):
        ops.pack_panels_bf16(torch.randn(8, 7).bfloat16())
    panels = ops.pack_panels_bf16(torch.randn(40, 16).bfloat16())
    with pytest.raises(RuntimeError, match="x has 18 features"):
        ops.panel_linear_bf16(torch.randn(2, 18).bfloat16(), panels, None, 40)
    with pytest.raises(RuntimeError, match="bfloat16 CPU tensor"):
        ops.panel_linear_bf16(torch.randn(2, 16), panels, None, 40)
    with pytest.raises(RuntimeError, match="cannot hold 100 outputs"):
        ops.panel_linear_bf16(torch.randn(2, 16).bfloat16(), panels, None, 100)
