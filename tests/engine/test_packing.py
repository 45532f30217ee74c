"""Pre-packed linear layers: the same results as the model's own layers, whichever kernel runs,
each weight held once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cache.kv_storage import KVStorage
from engine import kernels, packing
from engine.packing import PackedLinear, TiedEmbedding, onednn_supported, pack_model, use_panel_kernel

pytestmark = pytest.mark.skipif(not onednn_supported(torch.device("cpu"), torch.float32),
                                reason="oneDNN weight packing is not available in this torch build")
ops = kernels.load()


@pytest.mark.parametrize("rows", [1, 4, 16, 700])
def test_packed_linear_matches_f_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen)
    bias = torch.randn(96, generator=gen)
    layer = PackedLinear(weight, bias)
    x = torch.randn(rows, 64, generator=gen)
    with torch.inference_mode():
        assert torch.allclose(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
        assert layer(x.view(1, rows, 64)).shape == (1, rows, 96)
    assert torch.equal(layer.dense_weight(), weight)  # oneDNN's layout gives the weight back exactly


def test_pack_model_replaces_the_layers_and_keeps_no_plain_weight() -> None:
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    x = torch.randn(5, 64)
    with torch.inference_mode():
        expected = model(x)
    assert pack_model(model, torch.device("cpu"), torch.float32) == 2
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 2 and not list(model.parameters())
    assert all(m.packed is not None and m.packed.is_mkldnn and m.panels is None for m in packed)
    with torch.inference_mode():
        assert torch.allclose(model(x), expected, rtol=1e-5, atol=1e-5)


class _Tied(nn.Module):
    """A language model's ends whose output head shares the input embedding's table."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 24)
        self.head = nn.Linear(24, 100, bias=False)
        self.head.weight = self.embed.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def set_input_embeddings(self, module: nn.Module) -> None:
        self.embed = module

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


@pytest.mark.skipif(ops is None, reason="the native ops cannot be built here (no C++ compiler)")
def test_a_tied_table_is_held_once_while_the_head_holds_panels() -> None:
    assert ops is not None
    model = _Tied()
    table = model.embed.weight.detach().clone()
    ids = torch.tensor([[0, 31, 32, 99], [5, 64, 63, 1]])
    with torch.inference_mode():
        expected = model(ids)
    pack_model(model, torch.device("cpu"), torch.float32)
    embed = model.get_input_embeddings()
    assert isinstance(embed, TiedEmbedding) and embed.head is model.head and embed.weight is not None
    use_panel_kernel(list(model.modules()), ops.panel_linear, ops.pack_panels)
    assert embed.weight is None and model.head.panels is not None  # the table lives in the head's panels
    with torch.inference_mode():
        assert torch.equal(embed(ids), table[ids])  # rows read from the panels: exact
        torch.testing.assert_close(model(ids), expected, rtol=1e-5, atol=1e-5)
    use_panel_kernel(list(model.modules()), None)
    assert embed.weight is not None and torch.equal(embed.weight, table)  # oneDNN's layout: the table is back
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), expected, rtol=1e-5, atol=1e-5)


BF16_PANELS = ops is not None and ops.bf16_panels
needs_bf16_panels = pytest.mark.skipif(not BF16_PANELS, reason="neither AVX512-BF16 nor AVX2 with FMA in this build")


@needs_bf16_panels
def test_bfloat16_layers_take_the_bfloat16_panels_and_give_their_weight_back() -> None:
    assert ops is not None
    bf16 = (ops.panel_linear_bf16, ops.pack_panels_bf16, ops.gated_panel_linear_bf16)
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(70, 64, generator=gen).bfloat16(), torch.randn(70, generator=gen).bfloat16()
    odd = PackedLinear(torch.randn(8, 63, generator=gen).bfloat16(), None)  # odd in_features: oneDNN keeps it
    layer = PackedLinear(weight, bias)
    gated = PackedLinear(torch.randn(2 * 24, 64, generator=gen).bfloat16(), None, gated=24)
    converted = use_panel_kernel([layer, gated, odd], ops.panel_linear, ops.pack_panels, ops.gated_panel_linear, bf16)
    assert converted == 2 and layer.panels is not None and layer.panels.dim() == 4 and odd.panels is None
    assert torch.equal(layer.dense_weight(), weight)  # the panels give the weight back exactly
    x = torch.randn(5, 64, generator=gen).bfloat16()
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-2, atol=1e-2)
        full = F.linear(x, gated.dense_weight())
        torch.testing.assert_close(gated.silu_mul(x), F.silu(full[:, :24]) * full[:, 24:], rtol=2e-2, atol=2e-2)
    assert use_panel_kernel([layer, gated, odd], None) == 2
    assert layer.panels is None and torch.equal(layer.dense_weight(), weight)  # oneDNN's layout (or plain) again


@needs_bf16_panels
def test_a_bfloat16_tied_table_is_read_from_the_bfloat16_panels() -> None:
    assert ops is not None
    model = _Tied().bfloat16()
    table = model.embed.weight.detach().clone()
    ids = torch.tensor([[0, 31, 32, 99], [5, 64, 63, 1]])
    pack_model(model, torch.device("cpu"), torch.bfloat16)
    embed = model.get_input_embeddings()
    use_panel_kernel(list(model.modules()), ops.panel_linear, ops.pack_panels, ops.gated_panel_linear,
                     (ops.panel_linear_bf16, ops.pack_panels_bf16, ops.gated_panel_linear_bf16))
    assert embed.weight is None and model.head.panels is not None and model.head.panels.dim() == 4
    with torch.inference_mode():
        assert torch.equal(embed(ids), table[ids])


def test_without_a_onednn_layout_a_bfloat16_layer_holds_its_plain_weight(monkeypatch) -> None:
    """Where oneDNN has no bfloat16 layout (AVX2 CPUs) the model is still packed: each layer holds
    its weight as it is and multiplies with F.linear until the panels take it, and gives it back
    the same way."""
    monkeypatch.setattr(packing, "onednn_supported", lambda device, dtype: dtype == torch.float32)
    gen = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 70), nn.ReLU(), nn.Linear(70, 32, bias=False)).bfloat16()
    x = torch.randn(5, 64, generator=gen).bfloat16()
    with torch.inference_mode():
        expected = model(x)
    assert pack_model(model, torch.device("cpu"), torch.bfloat16) == 2
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert all(m.packed is None and m.plain is not None and m.panels is None for m in layers)
    assert not list(model.parameters())  # the plain weights are buffers of the packed layers, held once
    with torch.inference_mode():
        assert torch.equal(model(x), expected)  # F.linear on the same weight
    if not BF16_PANELS:
        return
    assert ops is not None
    bf16 = (ops.panel_linear_bf16, ops.pack_panels_bf16, ops.gated_panel_linear_bf16)
    assert use_panel_kernel(layers, ops.panel_linear, ops.pack_panels, ops.gated_panel_linear, bf16) == 2
    assert all(m.plain is None and m.packed is None and m.panels is not None for m in layers)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), expected, rtol=1e-2, atol=2e-2)
    assert use_panel_kernel(layers, None) == 2
    assert all(m.plain is not None and m.packed is None and m.panels is None for m in layers)
    with torch.inference_mode():
        assert torch.equal(model(x), expected)


@pytest.mark.skipif(ops is None, reason="the native ops cannot be built here (no C++ compiler)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_model_packed_straight_into_panels_skips_onednn_and_equals_the_two_step_packing(
        tiny_model_dir, monkeypatch, dtype: str) -> None:
    """With a build of the kernels at hand, pack_model lays every weight out in the panels at
    once (and the fast decoder's fused q/k/v stays in panels): the same panels as packing for
    oneDNN and repacking, without oneDNN's reorder and back."""
    from engine.model import load_model
    from engine.packing import panel_ops
    from engine.runner import ModelRunner

    assert ops is not None
    panels = panel_ops(ops, getattr(torch, dtype))
    if panels is None:
        pytest.skip("no bfloat16 panels in this build")
    storage = lambda loaded: KVStorage(8, loaded.num_layers, 16, loaded.num_kv_heads, loaded.head_dim,  # noqa: E731
                                       dtype=loaded.dtype)
    two_step = load_model(str(tiny_model_dir), dtype=dtype, device="cpu", direct=True)
    pack_model(two_step.model, two_step.device, two_step.dtype)
    before = ModelRunner(two_step.model, storage(two_step), ops)

    reorders: list[int] = []
    onednn = packing._onednn_layout
    monkeypatch.setattr(packing, "_onednn_layout", lambda w: reorders.append(1) or onednn(w))
    direct = load_model(str(tiny_model_dir), dtype=dtype, device="cpu", direct=True)
    pack_model(direct.model, direct.device, direct.dtype, panels=panels)
    after = ModelRunner(direct.model, storage(direct), ops)
    assert reorders == []
    layers = lambda runner: [m for m in runner.modules() if isinstance(m, PackedLinear)]  # noqa: E731
    assert len(layers(after)) == len(layers(before)) > 0
    for a, b in zip(layers(after), layers(before), strict=True):
        assert a.panels is not None and a.packed is None and a.plain is None and a.panel_ops == panels
        assert torch.equal(a.panels, b.panels) and (a.gated_panel is None) == (b.gated_panel is None)
    assert after.fast is not None and all(layer.qkv.panels is not None for layer in after.fast.layers)
    ids = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
    assert torch.equal(after.execute(ids, [0], [[0, 1]], [0]), before.execute(ids, [0], [[0, 1]], [0]))
