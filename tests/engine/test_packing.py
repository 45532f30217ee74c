"""Pre-packed linear layers: the same results as the model's own layers, whichever kernel runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.packing import _MKL_ROWS, PackedLinear, _calibrate, _choose, pack_model, packing_supported

pytestmark = pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.float32),
                                reason="oneDNN weight packing is not available in this torch build")


@pytest.mark.parametrize("rows", [1, 4, 16, 700])
@pytest.mark.parametrize("mkl_rows", [512, None])
def test_packed_linear_matches_f_linear(rows: int, mkl_rows: int | None) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen)
    bias = torch.randn(96, generator=gen)
    layer = PackedLinear(weight, bias)
    layer.mkl_rows = mkl_rows
    x = torch.randn(rows, 64, generator=gen)
    with torch.inference_mode():
        assert torch.allclose(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
        assert layer(x.view(1, rows, 64)).shape == (1, rows, 96)


def test_calibration_chooses_a_kernel_and_pack_model_applies_it() -> None:
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    x = torch.randn(5, 64)
    with torch.inference_mode():
        expected = model(x)
    assert pack_model(model, torch.device("cpu"), torch.float32) == 2
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 2 and len({m.mkl_rows for m in packed}) == 1
    assert packed[0].mkl_rows in (512, None)
    assert _calibrate(packed, repeats=1) in (512, None)
    with torch.inference_mode():
        assert torch.allclose(model(x), expected, rtol=1e-5, atol=1e-5)


def test_mkl_takes_many_rows_only_where_it_was_clearly_faster() -> None:
    assert _choose({"onednn": 1.0, "mkl": 0.88}) == _MKL_ROWS
    assert _choose({"onednn": 1.0, "mkl": 0.96}) is None  # within a noisy start's error: keep oneDNN
    assert _choose({"onednn": 1.0, "mkl": 2.3}) is None  # AMD: MKL without its AVX-512 kernels


def test_calibration_times_each_decoder_shape_once_and_never_the_output_head(tiny_model_dir) -> None:
    from engine.model import load_model
    from engine.packing import _calibration_layers

    model = load_model(str(tiny_model_dir), device="cpu").model  # packing is a CPU feature (CUDA too may be here)
    pack_model(model, torch.device("cpu"), torch.float32)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    head = model.get_output_embeddings()
    assert isinstance(head, PackedLinear)
    chosen = _calibration_layers(model, packed)
    shapes = [(m.out_features, m.in_features) for m in chosen]
    assert head not in chosen and len(shapes) == len(set(shapes))
    assert set(shapes) == {(m.out_features, m.in_features) for m in packed if m is not head}
