"""The official `openai` client, sync and async, streaming and not, parses every response."""

from __future__ import annotations

import asyncio

import openai
import pytest

LONG_PROMPT = " ".join(f"item {i} is {i * 7 % 13}." for i in range(60))  # several full KV blocks


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture()
def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].object == "model" and models.data[0].owned_by == "kvgate"
    assert client.models.retrieve("tiny").id == "tiny"


def test_completion(client: openai.OpenAI) -> None:
    result = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert result.id.startswith("cmpl-") and result.object == "text_completion"
    assert result.model == "tiny" and result.system_fingerprint.startswith("fp_")
    assert len(result.choices) == 1 and result.choices[0].finish_reason in ("stop", "length")
    assert result.usage.completion_tokens <= 5 and result.usage.prompt_tokens > 0
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    assert result.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_prompt_forms_and_n(client: openai.OpenAI) -> None:
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=2, temperature=0)
    assert ids.usage.prompt_tokens == 4
    many = client.completions.create(model="tiny", prompt=["a b c", "d e f"], n=2, max_tokens=3,
                                     temperature=0.8, seed=1)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert 4 <= many.usage.completion_tokens <= 12
    lists = client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0)
    assert [c.index for c in lists.choices] == [0, 1] and lists.usage.prompt_tokens == 5


def test_completion_logprobs_and_extras(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model="tiny", prompt="hello", max_tokens=3, logprobs=2, stop=["\n\n"], presence_penalty=0.5, seed=1234,
        frequency_penalty=0.5, user="someone", extra_body={"top_k": 5, "min_p": 0.01,
                                                           "repetition_penalty": 1.1, "cache_salt": "s1"})
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs)
    assert all(len(top) >= 2 for top in logprobs.top_logprobs)
    # Per-token strings include special tokens (an EOS ends the choice but is not in the text) and
    # show a character split across byte-level tokens as U+FFFD; otherwise they spell the text.
    joined = "".join(t for t in logprobs.tokens if t not in ("<|im_end|>", "<|endoftext|>", "<|im_start|>"))
    if "\ufffd" not in joined:
        assert joined == result.choices[0].text


def test_chat_completion(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model="tiny", max_completion_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
        messages=[{"role": "developer", "content": "Be brief."},
                  {"role": "system", "content": "You are a test."},
                  {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
                  {"role": "assistant", "content": "Hello."},
                  {"role": "user", "content": "Again?"}])
    assert result.id.startswith("chatcmpl-") and result.object == "chat.completion"
    choice = result.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.content) == result.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)


def test_streaming_sync(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Count"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"
    text_chunks = list(client.completions.create(model="tiny", prompt="abc", max_tokens=4, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert all(c.usage is None for c in text_chunks)
    assert text_chunks[-1].choices[0].finish_reason == "length"


def test_async_client(aclient: openai.AsyncOpenAI) -> None:
    async def main() -> None:
        models = await aclient.models.list()
        assert models.data[0].id == "tiny"
        chat = await aclient.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert chat.choices[0].message.content is not None
        comp = await aclient.completions.create(model="tiny", prompt="hi", max_tokens=3)
        assert comp.choices[0].text is not None
        stream = await aclient.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True)
        pieces = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
        assert len(pieces) <= 4
        stream = await aclient.completions.create(model="tiny", prompt="hi", max_tokens=4, stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        assert chunks[-1].usage.completion_tokens == 4
        await aclient.close()

    asyncio.run(main())


def test_cached_tokens_on_repeated_long_prompt(client: openai.OpenAI) -> None:
    first = client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    second = client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 64
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens >= (first.usage.prompt_tokens // 16 - 1) * 16
    assert second.choices[0].text == first.choices[0].text
    salted = client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=2, temperature=0,
                                       extra_body={"cache_salt": "another-salt"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0  # the salt starts a new hash chain
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=2, stream=True,
        stream_options={"include_usage": True})
    list(stream)
    again = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=2, stream=True,
        stream_options={"include_usage": True}))
    assert again[-1].usage.prompt_tokens_details.cached_tokens > 0
