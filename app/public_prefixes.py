"""Public prefixes as the serving tokenizer sees them: `[[public_prefixes]]` and the admin API.

The configuration and `POST /admin/public-prefixes` declare a prefix as text, as a chat system
message, or as token ids; the token ids are what prompts are matched against (tenants.public),
so text is tokenized with the engine's tokenizer exactly as a prompt would be: a completion's
text with the tokenizer's special tokens, a system message through the chat template without
the assistant turn. Declarations wait until the engine (and its tokenizer) is loaded, then are
tokenized once, off the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.prompts import PromptBuilder, check_chars
from engine.errors import InvalidRequestError
from tenants.public import PublicPrefix, PublicPrefixes


@dataclass(frozen=True, slots=True)
class PrefixSpec:
    """A declaration before tokenization: exactly one of `text`, `system`, `token_ids`."""

    name: str
    text: str | None = None
    system: str | None = None
    token_ids: tuple[int, ...] | None = None

    def describe(self) -> str:
        return "text" if self.text else "system" if self.system else "token_ids"


class PublicPrefixStore:
    """The declared prefixes, tokenized on first use with the serving engine's tokenizer."""

    def __init__(self, specs: list[PrefixSpec]) -> None:
        self._pending = list(specs)
        self._specs: dict[str, PrefixSpec] = {}
        self.prefixes = PublicPrefixes()

    async def ready(self, builder: PromptBuilder) -> PublicPrefixes:
        """The prefixes as token ids (tokenizing what was declared before the engine loaded)."""
        while self._pending:
            spec = self._pending.pop(0)
            await self.add(spec, builder)
        return self.prefixes

    async def add(self, spec: PrefixSpec, builder: PromptBuilder) -> PublicPrefix:
        """Tokenize and declare (or replace) one prefix; InvalidRequestError if it cannot be used."""
        ids = await _tokenize(spec, builder)
        if len(ids) >= builder.max_model_len:
            raise InvalidRequestError(f"public prefix {spec.name!r} has {len(ids)} tokens, beyond the model's "
                                      f"context of {builder.max_model_len}", param=spec.describe())
        prefix = PublicPrefix(spec.name, tuple(ids))
        try:
            self.prefixes.add(prefix)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="name") from None
        self._specs[spec.name] = spec
        return prefix

    def remove(self, name: str) -> bool:
        self._specs.pop(name, None)
        self._pending = [s for s in self._pending if s.name != name]
        return self.prefixes.remove(name)

    def listing(self, block_size: int) -> list[dict[str, Any]]:
        """What is declared: names, how each was given, tokens and the full blocks they share."""
        out = [{"name": p.name, "source": self._specs[p.name].describe() if p.name in self._specs else "token_ids",
                "tokens": len(p.token_ids), "shared_blocks": len(p.token_ids) // block_size}
               for p in self.prefixes]
        out += [{"name": s.name, "source": s.describe(), "tokens": None, "shared_blocks": None}
                for s in self._pending]
        return out


async def _tokenize(spec: PrefixSpec, builder: PromptBuilder) -> list[int]:
    if spec.token_ids:
        return list(spec.token_ids)
    tokenizer = builder.tokenizer
    if spec.text:
        check_chars(len(spec.text), builder.max_chars, builder.max_model_len, "text")
        return list(await builder.pool.run(lambda: tokenizer([spec.text])["input_ids"][0]))
    assert spec.system is not None
    check_chars(len(spec.system), builder.max_chars, builder.max_model_len, "system")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model has no chat template: declare the prefix as text or token_ids",
                                  param="system")

    def render() -> list[int]:
        text = tokenizer.apply_chat_template([{"role": "system", "content": spec.system}], tokenize=False,
                                             add_generation_prompt=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return await builder.pool.run(render)
