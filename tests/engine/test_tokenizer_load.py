"""engine.model_source.load_tokenizer: a Llama folder with transformers' generic tokenizer loads
through `TokenizersBackend` directly — the tokenizer `AutoTokenizer` gives, token for token and
template for template — and everything else through `AutoTokenizer`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.model_source import generic_tokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["", "Hello world", "  leading and trailing  ", "ünïcödé ✓ 日本語 🚀", "a\nb\r\n\tc",
         "<|im_start|>user\nhi<|im_end|>", "text with <|endoftext|> inside", "x" * 300]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"},
     {"role": "assistant", "content": "Rayleigh scattering."}, {"role": "user", "content": "<|im_end|> more"}],
]


def _folders(tiny_model_dir: Path) -> list[Path]:
    from engine.default_model import DEFAULT_MODEL_NAME
    from engine.tiny_model import cache_root

    default = cache_root() / "models" / DEFAULT_MODEL_NAME
    # SmolLM2's tokenizer where a run converted it already (its own test converts it once)
    return [tiny_model_dir] + ([default] if (default / "tokenizer.json").is_file() else [])


def test_the_generic_route_gives_what_autotokenizer_gives(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    for folder in _folders(tiny_model_dir):
        assert generic_tokenizer(str(folder))
        got, ref = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))
        assert type(got) is type(ref)
        assert got.get_vocab() == ref.get_vocab() and got.special_tokens_map == ref.special_tokens_map
        assert (got.eos_token_id, got.bos_token_id, got.all_special_ids) == \
            (ref.eos_token_id, ref.bos_token_id, ref.all_special_ids)
        assert got.chat_template == ref.chat_template and got.chat_template
        assert got.clean_up_tokenization_spaces == ref.clean_up_tokenization_spaces
        for special in (True, False):
            assert got(TEXTS, add_special_tokens=special)["input_ids"] == \
                ref(TEXTS, add_special_tokens=special)["input_ids"]
        for ids in got(TEXTS)["input_ids"] + [list(range(0, 400, 3)), [ref.eos_token_id, 5, 6]]:
            for skip in (True, False):
                assert got.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
        for conversation in CONVERSATIONS:
            for prompt in (True, False):
                assert got.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt) == \
                    ref.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)


@pytest.mark.parametrize("change", [
    ("config.json", {"model_type": "qwen2"}),  # AutoTokenizer maps Qwen2's generic declaration to its own class
    ("tokenizer_config.json", {"tokenizer_class": "LlamaTokenizer"}),
    ("tokenizer_config.json", {"auto_map": {"AutoTokenizer": [None, "custom.Tokenizer"]}}),
])
def test_other_folders_go_through_autotokenizer(tmp_path, tiny_model_dir, change) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    name, fields = change
    data = json.loads((folder / name).read_text())
    data.update(fields)
    (folder / name).write_text(json.dumps(data))
    assert not generic_tokenizer(str(folder))
    assert not generic_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")  # a hub id: no local files
    assert generic_tokenizer(str(tiny_model_dir))


def test_loading_the_generic_tokenizer_imports_no_torch(tiny_model_dir) -> None:
    script = ("import sys\nfrom engine.model_source import load_tokenizer\n"
              f"tok = load_tokenizer({str(tiny_model_dir)!r})\n"
              "print(type(tok).__name__, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["TokenizersBackend", "False"]
