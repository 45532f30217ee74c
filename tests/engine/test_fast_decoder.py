"""FastDecoder: the same logits as transformers' own decoder modules, with and without the native
ops, for steps that mix decodes, short and long prefill chunks; unsupported models keep HF's path."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from cache.kv_storage import KVStorage
from engine import kernels
from engine.fast_decoder import FastDecoder
from engine.model import load_model
from engine.packing import pack_model
from engine.runner import ModelRunner

NATIVE = kernels.load()


def _runner(tiny_model_dir, dtype: str = "float32", pack: bool = True, native=None, fast: bool = True):
    loaded = load_model(str(tiny_model_dir), dtype=dtype, device="cpu")
    if pack:
        pack_model(loaded.model, loaded.device, loaded.dtype)
    storage = KVStorage(64, loaded.num_layers, 16, loaded.num_kv_heads, loaded.head_dim, dtype=loaded.dtype,
                        device=loaded.device)
    return ModelRunner(loaded.model, storage, native, fast_decoder=fast)


def _steps(vocab: int) -> list[tuple[list[list[int]], list[int], list[list[int]]]]:
    """Two steps over one pool: a long prefill and a short one, then decodes with a 6-row chunk
    over the first prompt's blocks and a 30-row chunk over the second's. No two rows of a step
    write the same slot: which of two different K/V rows a slot keeps would depend on the order
    of the writes (with 16 threads the native write's order differs from PyTorch's index_put_,
    and two of four rows' logits differed, on 2026-12-04)."""
    rng = random.Random(0)
    tok = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    first = ([tok(40), tok(20)], [0, 0], [[0, 1, 2], [3, 4]])
    second = ([[5], [6], tok(6), tok(30)], [40, 20, 48, 21], [[0, 1, 2], [3, 4], [0, 1, 2, 5], [3, 4, 6, 7]])
    return [first, second]


@pytest.mark.parametrize("native", [True, False], ids=["native-ops", "pytorch-ops"])
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "plain-linear"])
def test_fast_decoder_gives_transformers_logits(tiny_model_dir, native: bool, pack: bool) -> None:
    if native and NATIVE is None:
        pytest.skip("the native ops cannot be built here")
    fast = _runner(tiny_model_dir, pack=pack, native=NATIVE if native else None)
    hf = _runner(tiny_model_dir, pack=pack, native=None, fast=False)
    assert fast.fast is not None and (fast.fast.native is not None) is native and hf.fast is None
    for ids, starts, tables in _steps(fast.model.config.vocab_size):
        rows = list(range(len(ids)))
        got = fast.execute(ids, starts, tables, rows)
        expected = hf.execute(ids, starts, tables, rows)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # both wrote the same K/V into their pools
    torch.testing.assert_close(fast.storage.kv[:8], hf.storage.kv[:8], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("native", [True, False], ids=["native-ops", "pytorch-ops"])
def test_fast_decoder_in_bfloat16_matches_transformers(tiny_model_dir, native: bool) -> None:
    ops = NATIVE if native else None
    fast = _runner(tiny_model_dir, dtype="bfloat16", native=ops)
    hf = _runner(tiny_model_dir, dtype="bfloat16", native=ops, fast=False)
    assert fast.fast is not None and fast.fast.native is ops  # the fused steps in bfloat16 too
    # a bfloat16 pool takes both attention kernels
    assert (fast.paged_kernel is not None) is (ops is not None) and (fast.chunk_kernel is not None) is (ops is not None)
    # with the native ops, the fused steps sum in another order, and the fast decoder's last layer
    # attends only for the sampled rows, where transformers' modules attend for all of a 30-row
    # chunk: bfloat16 rounding apart. Without, the same ops: the same bits.
    tol = 0.05 if native else 0.0
    for ids, starts, tables in _steps(fast.model.config.vocab_size):
        rows = list(range(len(ids)))
        torch.testing.assert_close(fast.execute(ids, starts, tables, rows), hf.execute(ids, starts, tables, rows),
                                   rtol=tol, atol=tol)


@pytest.mark.skipif(NATIVE is None, reason="the native kernels cannot be built here")
def test_bfloat16_attention_kernel_gives_the_logits_of_pytorchs_attention(tiny_model_dir) -> None:
    """The few-row kernel over a bfloat16 pool sums in float32 and rounds its output once, as
    PyTorch's CPU attention does: the logits agree to bfloat16's precision."""
    native = _runner(tiny_model_dir, dtype="bfloat16", native=NATIVE)
    plain = _runner(tiny_model_dir, dtype="bfloat16")
    for ids, starts, tables in _steps(native.model.config.vocab_size):
        rows = list(range(len(ids)))
        torch.testing.assert_close(native.execute(ids, starts, tables, rows),
                                   plain.execute(ids, starts, tables, rows), rtol=0.05, atol=0.05)


def test_unsupported_models_say_why_and_keep_transformers_modules(tiny_model_dir) -> None:
    loaded = load_model(str(tiny_model_dir), device="cpu")
    assert FastDecoder.unsupported(loaded.model) is None
    loaded.model.config.hidden_act = "gelu"
    assert "not SiLU" in (FastDecoder.unsupported(loaded.model) or "")
    storage = KVStorage(8, loaded.num_layers, 16, loaded.num_kv_heads, loaded.head_dim)
    assert ModelRunner(loaded.model, storage).fast is None
    with pytest.raises(ValueError, match="not SiLU"):
        FastDecoder(loaded.model, None)
    loaded.model.config.hidden_act = "silu"
    loaded.model.get_decoder().layers[0].self_attn.q_norm = torch.nn.Identity()
    assert "normalises q/k" in (FastDecoder.unsupported(loaded.model) or "")
    assert "not one of" in (FastDecoder.unsupported(SimpleNamespace(config=SimpleNamespace(model_type="gpt2"))) or "")


def _weight_bytes(runner: ModelRunner) -> int:
    """Bytes of every distinct tensor the runner's modules hold (parameters and buffers, deduplicated
    by storage; oneDNN's packed tensors, which have none, by their size)."""
    seen: dict[object, int] = {}
    for module in runner.modules():
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if tensor is None:
                continue
            if tensor.is_mkldnn:
                seen[id(tensor)] = tensor.numel() * tensor.element_size()
            else:
                storage = tensor.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("native", [True, False], ids=["native-ops", "pytorch-ops"])
@pytest.mark.parametrize("fast", [True, False], ids=["fast-decoder", "transformers-modules"])
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "plain-linear"])
def test_every_weight_is_held_once(tiny_model_dir, native: bool, fast: bool, pack: bool) -> None:
    """Packed layers keep one form of their weight (oneDNN's layout or the panel kernel's panels),
    and the fused q/k/v and gate/up layers replace the projections fused into them."""
    if native and NATIVE is None:
        pytest.skip("the native ops cannot be built here")
    params = sum(p.numel() * p.element_size() for p in load_model(str(tiny_model_dir), device="cpu").model.parameters())
    runner = _runner(tiny_model_dir, pack=pack, native=NATIVE if native else None, fast=fast)
    assert _weight_bytes(runner) <= 1.1 * params
    if NATIVE is not None:  # the kernels switched in and out at run time: still one copy each way
        runner.use_native(None if native else NATIVE)
        assert _weight_bytes(runner) <= 1.1 * params
        runner.use_native(NATIVE if native else None)
        assert _weight_bytes(runner) <= 1.1 * params
    ids, starts, tables = _steps(runner.model.config.vocab_size)[0]
    reference = _runner(tiny_model_dir, pack=False, native=None, fast=False)
    torch.testing.assert_close(runner.execute(ids, starts, tables, [0, 1]), reference.execute(ids, starts, tables, [0, 1]),
                               rtol=1e-4, atol=1e-4)
