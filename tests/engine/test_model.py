"""Tiny model builder, `load_model` and `model_fingerprint`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config

from engine import tiny_model
from engine.model import load_model, model_fingerprint
from engine.model_source import resolve_model_path

MODEL_FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json",
               "generation_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def seed1_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Seed-1 tiny model, built through the command line entry point."""
    out = tmp_path_factory.mktemp("seed1") / "tiny"
    assert tiny_model.main([str(out), "--seed", "1", "--size", "tiny"]) == 0
    return out


def test_build_is_byte_identical_for_same_seed(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = tiny_model.build_tiny_model(tmp_path / "again", seed=0)
    for name in MODEL_FILES:
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_other_seed_changes_weights_not_tokenizer(tiny_model_dir: Path, seed1_dir: Path) -> None:
    assert (seed1_dir / "model.safetensors").read_bytes() != (tiny_model_dir / "model.safetensors").read_bytes()
    assert (seed1_dir / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()


def test_from_pretrained_round_trip(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = model.config
    assert config.model_type == "llama"
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (64, 2, 128)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.max_position_embeddings == 4096
    assert config.vocab_size == len(tokenizer) == 1024
    assert model.dtype == torch.float32
    text = "Hello there, how are you? 12 héllo 世界 🙂"
    assert tokenizer.decode(tokenizer(text).input_ids) == text


def test_special_tokens_and_generation_config(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert ids == [0, 1, 2]
    assert (tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token) == (
        "<|im_end|>", "<|im_start|>", "<|endoftext|>")
    assert model.generation_config.eos_token_id == [2, 0]
    assert tokenizer("<|im_start|>user").input_ids[0] == 1
    assert tokenizer.decode([1, 2, 0], skip_special_tokens=True) == ""


def test_chat_template_renders_chatml(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": [{"type": "text", "text": "Use "}, {"type": "text", "text": "English."}]},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>developer\nUse English.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=False)
    assert plain == "<|im_start|>system\nBe brief.<|im_end|>\n"


def test_load_model_fields(tiny_loaded, tiny_model_dir: Path) -> None:
    assert tiny_loaded.name == tiny_model_dir.name
    assert tiny_loaded.path == str(tiny_model_dir)
    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert tiny_loaded.device.type == expected_device
    assert tiny_loaded.dtype == torch.float32
    assert (tiny_loaded.num_layers, tiny_loaded.num_kv_heads, tiny_loaded.head_dim) == (2, 2, 16)
    assert tiny_loaded.kv_shape == (2, 2, 16)
    assert tiny_loaded.num_kv_heads < tiny_loaded.config.num_attention_heads
    assert tiny_loaded.eos_token_ids == [2, 0]
    assert not tiny_loaded.model.training
    assert not any(p.requires_grad for p in tiny_loaded.model.parameters())
    assert next(tiny_loaded.model.parameters()).device.type == expected_device


def test_greedy_generate_matches_naive_argmax(tiny_loaded) -> None:
    tokenizer, model = tiny_loaded.tokenizer, tiny_loaded.model
    enc = tokenizer.apply_chat_template([{"role": "user", "content": "What is a cache?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    input_ids = enc["input_ids"].to(tiny_loaded.device)
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=12, min_new_tokens=12)
    ids = input_ids
    with torch.no_grad():
        for _ in range(12):
            logits = model(ids, use_cache=False).logits[0, -1]
            top2 = logits.topk(2).values
            assert top2[0] - top2[1] > 1e-4  # the tiny model's init keeps greedy far from ties
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    assert out.tolist() == ids.tolist()


def test_load_model_bfloat16(tiny_model_dir: Path) -> None:
    loaded = load_model(str(tiny_model_dir), dtype="bfloat16", device="cpu")
    assert loaded.dtype == torch.bfloat16
    assert next(loaded.model.parameters()).dtype == torch.bfloat16


def test_fingerprint_properties(tiny_loaded, tiny_model_dir: Path, seed1_dir: Path, tmp_path: Path) -> None:
    shape = tiny_loaded.kv_shape
    base = model_fingerprint(tiny_loaded.model, "float32", 16, shape)
    assert isinstance(base, bytes) and len(base) == 32
    copy = shutil.copytree(tiny_model_dir, tmp_path / "elsewhere")
    moved = load_model(str(copy), device="cpu")
    assert model_fingerprint(moved.model, torch.float32, 16, shape) == base  # path-independent
    other = load_model(str(seed1_dir), device="cpu")
    assert model_fingerprint(other.model, "float32", 16, shape) != base
    assert model_fingerprint(tiny_loaded.model, "float32", 32, shape) != base
    assert model_fingerprint(tiny_loaded.model, "bfloat16", 16, shape) != base
    assert model_fingerprint(tiny_loaded.model, "float32", 16, (2, 2, 8)) != base


def test_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found; pass a local HF folder"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model("./relative/missing/model")


def test_folder_without_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no config.json"):
        load_model(str(tmp_path))


def test_unsupported_model_type_is_rejected(tmp_path: Path) -> None:
    GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type 'gpt2'.*llama, mistral, qwen2"):
        load_model(str(tmp_path))


def test_bad_dtype_and_device_are_rejected(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(str(tiny_model_dir), dtype="int8")
    with pytest.raises(ValueError, match="unknown device"):
        load_model(str(tiny_model_dir), device="tpu-ish")


def test_resolve_passes_paths_and_hub_ids_through() -> None:
    assert resolve_model_path("/some/folder") == "/some/folder"
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_tiny_alias_builds_once_into_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path))
    path = Path(resolve_model_path("tiny"))
    assert path == tmp_path / "models" / "tiny-tiny-seed0"
    assert (path / "model.safetensors").is_file()
    assert os.listdir(path.parent) == [path.name]  # no temp folders left behind
    mtime = (path / "config.json").stat().st_mtime_ns
    loaded = load_model("tiny", device="cpu")
    assert loaded.name == "tiny" and loaded.path == str(path)
    assert (path / "config.json").stat().st_mtime_ns == mtime


def test_stale_cache_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path))
    stale = tmp_path / "models" / "tiny-tiny-seed2"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    path = tiny_model.tiny_model_dir(seed=2)
    assert path == stale and (path / tiny_model.MARKER_FILE).is_file()
    assert sorted(os.listdir(path.parent)) == [path.name]


def test_unknown_size_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny model size"):
        tiny_model.build_tiny_model(tmp_path, size="huge")


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        tiny_model.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--seed" in out and "--size" in out and "DIR" in out
