"""Other HF causal-LM families load unchanged and decode exactly like `model.generate`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams

SHAPE = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             initializer_range=0.15)


def _save(config, folder: Path, tiny_model_dir: Path) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_model_dir / name).exists():
            shutil.copy(tiny_model_dir / name, folder / name)
    return folder


@pytest.mark.parametrize("family", ["qwen2", "mistral", "mistral-window"])
def test_family_greedy_matches_generate(family, tiny_model_dir, tmp_path):
    if family == "qwen2":
        config = Qwen2Config(**SHAPE)  # q/k/v projections carry biases
    elif family == "mistral":
        config = MistralConfig(**SHAPE, sliding_window=None)
    else:
        config = MistralConfig(**SHAPE, sliding_window=64)
    folder = _save(config, tmp_path / family, tiny_model_dir)
    engine = EngineCore(EngineConfig(model=str(folder), block_size=4, num_blocks=256))
    if family == "mistral-window":
        # Without a sliding-window kernel the engine caps the context at the window instead of
        # silently attending past it.
        assert engine.max_model_len == 64
    reference = AutoModelForCausalLM.from_pretrained(folder)
    prompts = [[(7 * i + 3 * j) % 1000 + 5 for j in range(10 + 5 * i)] for i in range(4)]
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(f"r{i}", ids, SamplingParams(max_tokens=8, temperature=0,
                                                                        ignore_eos=True)))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for out in engine.step():
            got[out.request_id].append(out.token_id)
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            expected = reference.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8,
                                          do_sample=False)[0, len(ids):].tolist()
        assert got[f"r{i}"] == expected, f"{family} prompt {i}"
