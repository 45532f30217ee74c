"""Request bodies → prompt token ids, with the cost bounded before any work is done.

Tokenizing and rendering chat templates cost time proportional to the text, so three bounds are
checked first, from sizes alone:

* fan-out: prompts in a list × `n` may not exceed `server.max_fanout` (nor what the engine can
  ever hold: `max_num_seqs + max_queue` sequences);
* characters: a text longer than `max_model_len × longest token` cannot fit the context whatever
  it tokenizes to (every token covers at most that many characters), so it is refused untouched;
* messages: at most `MAX_MESSAGES` chat messages (checked by the request model, before parsing
  each message).

What is left runs in a small worker pool (`PromptPool`), never on the event loop: a burst of long
prompts queues there while `/health` and the streams keep answering.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from app.protocol import ChatMessage
from engine.errors import InvalidRequestError, PromptTooLongError

CHAT_ROLES = ("system", "user", "assistant", "developer")
_T = TypeVar("_T")


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` can stand for (added tokens included).

    Byte-level BPE vocabularies spell each byte as one character and SentencePiece spells a
    space as one, so a vocabulary entry is never shorter than the text it covers.
    """
    return max((len(piece) for piece in tokenizer.get_vocab()), default=1)


class PromptPool:
    """The bounded worker pool that tokenizes and renders chat templates off the event loop."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or min(4, os.cpu_count() or 1)
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="kvgate-tokenize")
        self._builder: PromptBuilder | None = None

    async def run(self, fn: Callable[[], _T]) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def builder(self, tokenizer: Any, max_model_len: int) -> PromptBuilder:
        """The prompt builder of the serving engine's tokenizer (rebuilt after an engine restart)."""
        cached = self._builder
        if cached is None or cached.tokenizer is not tokenizer or cached.max_model_len != max_model_len:
            cached = PromptBuilder(tokenizer, max_model_len, max_model_len * longest_token_chars(tokenizer), self)
            self._builder = cached
        return cached

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def builder_of(state: Any, engine: Any) -> PromptBuilder:
    """The serving engine's prompt builder, on the app's tokenizer pool (created on first use)."""
    pool = getattr(state, "prompt_pool", None)
    if pool is None:
        pool = state.prompt_pool = PromptPool()
    return pool.builder(engine.tokenizer, engine.max_model_len)


def check_fanout(num_prompts: int, n: int, max_fanout: int, capacity: int) -> None:
    """Refuse a request that would start more engine sequences than allowed (400, not 429)."""
    size = num_prompts * n
    limit = min(max_fanout, capacity)
    if size > limit:
        why = ("server.max_fanout" if max_fanout <= capacity
               else "the engine's max_num_seqs + server.max_queue")
        raise InvalidRequestError(
            f"This request would start {size} sequences ({num_prompts} prompt(s) × n={n}); at most "
            f"{limit} are allowed per request ({why}). Send fewer prompts per request or a smaller n.",
            param="n" if num_prompts == 1 else "prompt", code="too_many_sequences")


def check_chars(length: int, max_chars: int, max_model_len: int, param: str) -> None:
    if length > max_chars:
        raise PromptTooLongError(
            f"This model's maximum context length is {max_model_len} tokens, and no text of more than "
            f"{max_chars} characters fits in it; the {param} has {length}. Please shorten it.", param=param)


def _non_empty(ids: list[int], param: str) -> list[int]:
    if not ids:
        raise InvalidRequestError("The prompt must not be empty.", param=param)
    return ids


class PromptBuilder:
    """Turns one engine's prompts into token ids; every tokenizer call runs in `pool`."""

    def __init__(self, tokenizer: Any, max_model_len: int, max_chars: int, pool: PromptPool) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_chars = max_chars
        self.pool = pool

    async def completion(self, prompt: Any) -> list[list[int]]:
        """String, list of strings, token ids or list of token-id lists → one id list per prompt."""
        if isinstance(prompt, str):
            prompt = [prompt]
            params = ["prompt"]
        elif not prompt:
            raise InvalidRequestError("The prompt must not be empty.", param="prompt")
        elif isinstance(prompt[0], int):
            return [self._ids(prompt, "prompt")]
        else:
            params = [f"prompt[{i}]" for i in range(len(prompt))]
        if not isinstance(prompt[0], str):
            return [self._ids(p, param) for p, param in zip(prompt, params, strict=True)]
        for text, param in zip(prompt, params, strict=True):
            check_chars(len(text), self.max_chars, self.max_model_len, param)
            if not text:
                raise InvalidRequestError("The prompt must not be empty.", param=param)
        texts = list(prompt)
        encoded = await self.pool.run(lambda: self.tokenizer(texts)["input_ids"])
        return [_non_empty(list(ids), param) for ids, param in zip(encoded, params, strict=True)]

    def _ids(self, ids: list[int], param: str) -> list[int]:
        # token ids are bounded by the context before the engine looks at each one
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, the "
                f"{param} has {len(ids)} tokens. Please reduce the prompt.", param=param)
        return _non_empty(list(ids), param)

    async def chat(self, messages: list[ChatMessage]) -> list[int]:
        """Messages → the chat template's text (with the assistant turn opened) → token ids."""
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise InvalidRequestError("This model has no chat template; use /v1/completions.",
                                      param="messages")
        has_developer = "developer" in str(template)
        conversation = []
        chars = 0
        for i, message in enumerate(messages):
            if message.role not in CHAT_ROLES:
                raise InvalidRequestError(
                    f"Unsupported role {message.role!r}; use one of {', '.join(CHAT_ROLES)}.",
                    param=f"messages[{i}].role")
            role = "system" if message.role == "developer" and not has_developer else message.role
            text = _message_text(message, i)
            chars += len(text)
            conversation.append({"role": role, "content": text})
        check_chars(chars, self.max_chars, self.max_model_len, "messages")

        def render() -> list[int]:
            try:
                text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                          add_generation_prompt=True)
            except Exception as exc:  # jinja2 TemplateError, ValueError: the messages do not fit
                raise InvalidRequestError(f"The messages do not fit the model's chat template: {exc}",
                                          param="messages") from exc
            check_chars(len(text), self.max_chars, self.max_model_len, "messages")
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

        return _non_empty(await self.pool.run(render), "messages")


def _message_text(message: ChatMessage, i: int) -> str:
    content = message.content
    if content is None:
        if message.role != "assistant":
            raise InvalidRequestError("Message content must not be null.", param=f"messages[{i}].content")
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise InvalidRequestError(f"Content part type {part.type!r} is not supported; only 'text' is.",
                                      param=f"messages[{i}].content[{j}].type")
        if part.text is None:
            raise InvalidRequestError("A text content part needs 'text'.",
                                      param=f"messages[{i}].content[{j}].text")
        texts.append(part.text)
    return "\n".join(texts)
