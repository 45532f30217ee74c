"""engine.direct_model: a Llama-family folder loaded without transformers' model classes gives
what transformers' load gives the engine — the same logits and K/V, fingerprint, end-of-sequence
ids and shapes — and anything it cannot load falls back to transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cache.kv_storage import KVStorage
from engine import direct_model, kernels
from engine.direct_model import direct_unsupported
from engine.model import load_model, model_fingerprint
from engine.packing import pack_model
from engine.runner import ModelRunner

pytestmark = pytest.mark.engine

NATIVE = kernels.load()
ROOT = Path(__file__).resolve().parents[2]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _shape(**extra: object) -> dict[str, object]:
    return dict(vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, **extra)


def _variant(name: str) -> tuple[type, dict[str, object]]:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    return {
        "llama-rope-theta": (LlamaConfig, _shape(rope_theta=50000.0)),
        "llama-linear-tied": (LlamaConfig, _shape(rope_scaling={"rope_type": "linear", "factor": 2.0},
                                                  tie_word_embeddings=True, head_dim=32)),
        "mistral-window": (MistralConfig, _shape(sliding_window=128)),
        "qwen2-bias": (Qwen2Config, _shape(use_sliding_window=False, tie_word_embeddings=True)),
    }[name]


def _write_model(folder: Path, tokenizer_from: Path, config_class: type, fields: dict[str, object],
                 seed: int = 0, shard: bool = False) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_class(**fields))
    with torch.no_grad():  # norms away from 1 and biases away from 0, so that both are read
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder, max_shard_size="100KB" if shard else "10GB")
    for name in _TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, folder / name)
    return folder


def _runner(folder: Path, direct: bool, dtype: str = "float32", native: object = None) -> tuple[ModelRunner, object]:
    loaded = load_model(str(folder), dtype=dtype, device="cpu", direct=direct)
    assert loaded.direct is direct
    fingerprint = model_fingerprint(loaded.model, dtype, 16, loaded.kv_shape)
    pack_model(loaded.model, loaded.device, loaded.dtype)
    storage = KVStorage(64, loaded.num_layers, 16, loaded.num_kv_heads, loaded.head_dim, dtype=loaded.dtype,
                        device=loaded.device)
    return ModelRunner(loaded.model, storage, native, fast_decoder=True), (fingerprint, loaded.eos_token_ids,
                                                                          loaded.kv_shape)


def _same_steps(folder: Path, dtype: str = "float32", native: object = None) -> None:
    direct, direct_facts = _runner(folder, True, dtype, native)
    hf, hf_facts = _runner(folder, False, dtype, native)
    assert direct_facts == hf_facts  # fingerprint, eos ids, KV shape
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 1024, (40,), generator=gen).tolist()
    other = torch.randint(3, 1024, (20,), generator=gen).tolist()
    steps = [([prompt, other], [0, 0], [[0, 1, 2], [3, 4]]),
             ([[5], [6], prompt[:6]], [40, 20, 40], [[0, 1, 2], [3, 4], [0, 1, 2, 5]])]
    for ids, starts, tables in steps:
        rows = list(range(len(ids)))
        assert torch.equal(direct.execute(ids, starts, tables, rows), hf.execute(ids, starts, tables, rows))
    assert torch.equal(direct.storage.kv[:8], hf.storage.kv[:8])


@pytest.mark.parametrize("variant", ["llama-rope-theta", "llama-linear-tied", "mistral-window", "qwen2-bias"])
def test_a_direct_load_computes_what_transformers_load_computes(tmp_path, tiny_model_dir, variant) -> None:
    config_class, fields = _variant(variant)
    folder = _write_model(tmp_path / variant, tiny_model_dir, config_class, fields)
    assert direct_unsupported(str(folder)) is None
    _same_steps(folder)
    direct = load_model(str(folder), device="cpu", direct=True)
    hf = load_model(str(folder), device="cpu", direct=False)
    names = lambda m: {n: (tuple(p.shape), p.dtype) for n, p in m.named_parameters()}  # noqa: E731
    assert names(direct.model) == names(hf.model)
    for field in ("sliding_window", "max_position_embeddings", "vocab_size", "tie_word_embeddings"):
        assert getattr(direct.config, field, None) == getattr(hf.config, field, None), field


@pytest.mark.parametrize("native", [True, False], ids=["native-ops", "pytorch-ops"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_tiny_model_direct_and_through_transformers_agree(tiny_model_dir, dtype, native) -> None:
    if native and NATIVE is None:
        pytest.skip("the native ops cannot be built here")
    _same_steps(tiny_model_dir, dtype, NATIVE if native else None)


def test_sharded_weights_load_and_stray_or_missing_ones_fall_back(tmp_path, tiny_model_dir) -> None:
    config_class, fields = _variant("llama-rope-theta")
    sharded = _write_model(tmp_path / "sharded", tiny_model_dir, config_class, fields, shard=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    _same_steps(sharded)

    from safetensors.torch import load_file, save_file

    whole = _write_model(tmp_path / "whole", tiny_model_dir, config_class, fields)
    tensors = load_file(whole / "model.safetensors")
    stray = dict(tensors, **{"model.extra.weight": torch.zeros(3)})
    save_file(stray, whole / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no place for: model.extra.weight"):
        direct_model.load_direct(str(whole), torch.float32, torch.device("cpu"))
    assert not load_model(str(whole), device="cpu", direct=True).direct  # transformers ignores the stray one

    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, whole / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="has no model.layers.1.mlp.up_proj.weight"):
        direct_model.load_direct(str(whole), torch.float32, torch.device("cpu"))
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(5, 64)
    save_file(tensors, whole / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"up_proj.weight has shape \(5, 64\), the config says \(96, 64\)"):
        direct_model.load_direct(str(whole), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("change, reason", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not one of"),
    ({"hidden_act": "gelu"}, "activation 'gelu' is not SiLU"),
    ({"num_key_value_heads": None}, "leaves num_key_value_heads to the architecture's defaults"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rotary scaling 'llama3'"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantized"),
])
def test_folders_it_cannot_load_say_why(tmp_path, tiny_model_dir, change, reason) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    (folder / "config.json").write_text(json.dumps(config))
    assert reason in (direct_unsupported(str(folder)) or "")


def test_a_hub_id_or_a_folder_without_safetensors_is_left_to_transformers(tmp_path, tiny_model_dir) -> None:
    assert "config.json" in (direct_unsupported("HuggingFaceTB/SmolLM2-135M-Instruct") or "")
    folder = tmp_path / "bin"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "model.safetensors").unlink()
    assert "no model.safetensors" in (direct_unsupported(str(folder)) or "")
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 512}
    llama3 = tmp_path / "llama3"
    shutil.copytree(tiny_model_dir, llama3)
    (llama3 / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(llama3), device="cpu", direct=True)
    assert not loaded.direct and loaded.model.config.rope_parameters["rope_type"] == "llama3"


def test_eos_ids_come_from_the_files_as_the_tokenizer_gives_them(tmp_path, tiny_model_dir) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "generation_config.json").unlink()  # then config.json's, as transformers derives it
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = 7
    (folder / "config.json").write_text(json.dumps(config))
    direct, hf = load_model(str(folder), device="cpu", direct=True), load_model(str(folder), device="cpu")
    assert direct.direct and direct.loaded_tokenizer is None  # not loaded for the ids
    assert direct.eos_token_ids == hf.eos_token_ids and direct.eos_token_ids[0] == 7
    assert hf.tokenizer.eos_token_id in direct.eos_token_ids
    assert direct.tokenizer.eos_token_id == hf.tokenizer.eos_token_id  # loaded on first use


def test_a_model_loaded_directly_runs_only_through_the_fast_decoder(tiny_model_dir) -> None:
    loaded = load_model(str(tiny_model_dir), device="cpu", direct=True)
    storage = KVStorage(8, loaded.num_layers, 16, loaded.num_kv_heads, loaded.head_dim)
    with pytest.raises(ValueError, match="runs only through the fast decoder"):
        ModelRunner(loaded.model, storage, None, fast_decoder=False)


def test_an_engine_started_on_the_tiny_model_never_imports_transformers(tiny_model_dir) -> None:
    """What an engine process imports to load and serve a Llama-family folder: no transformers
    (its model classes took seconds of every start)."""
    script = textwrap.dedent(f"""
        import sys
        from engine.config import EngineConfig
        from engine.core import EngineCore
        from engine.outputs import GenerateRequest
        from engine.sampling_params import SamplingParams
        core = EngineCore(EngineConfig(model={str(tiny_model_dir)!r}))
        assert core.loaded.direct
        core.add_request(GenerateRequest("r", [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0)))
        while core.has_work():
            core.step()
        print(sorted(m for m in sys.modules if m.split(".")[0] == "transformers"))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
