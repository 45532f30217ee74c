"""Greedy text over HTTP equals `model.generate(do_sample=False)` for the same prompt."""

from __future__ import annotations

import pytest
import torch

PROMPTS = ["def add(a, b):", "The weather today is", "1, 2, 3, 4,"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def hf(kvgate_env):
    """The tiny model and tokenizer, loaded with plain transformers from the servers' cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model_source import resolve_model_path

    path = resolve_model_path("tiny")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def _generate(hf, prompt_ids: list[int]) -> str:
    model, tokenizer = hf
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(out[0, len(prompt_ids):], skip_special_tokens=True)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_matches_generate(http, hf, prompt: str) -> None:
    _, tokenizer = hf
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                   "max_tokens": MAX_TOKENS, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == _generate(hf, tokenizer(prompt).input_ids)


def test_streamed_chat_matches_generate(http, hf) -> None:
    _, tokenizer = hf
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "2 + 2?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = _generate(hf, tokenizer(text, add_special_tokens=False).input_ids)
    body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    pieces = []
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        import json

        for line in response.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                pieces.append(delta.get("content") or "")
    assert "".join(pieces) == expected


@pytest.mark.server
def test_a_bfloat16_server_matches_generate_in_bfloat16(start_app) -> None:
    """`kvgate serve --dtype bfloat16`: bfloat16 weights and KV pool (on the native kernels where
    they are built); greedy text equals transformers' bfloat16 generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model_source import resolve_model_path

    server = start_app("--model", "tiny", "--dtype", "bfloat16")
    path = resolve_model_path("tiny")
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval(), AutoTokenizer.from_pretrained(path)
    import httpx

    for prompt in PROMPTS:
        response = httpx.post(server.url + "/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == _generate(hf16, hf16[1](prompt).input_ids), prompt
