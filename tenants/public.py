"""Public prefixes: text every tenant may share the KV of (a common system prompt, a shared
document), declared by the admin in the configuration or at run time.

A prompt's leading tokens that agree with a declared prefix are public: their full blocks hash
in the public namespace (salt `HMAC(server secret, "public")`, see `registry.public_salt`), so 256
tenants with one system prompt prefill it once. The first block past them mixes the tenant's
own root back in, so nothing after the public part is ever shared (cache.hashing).

Only tokens that agree with a declared prefix count: a prompt that starts like a public prefix
and then differs shares just the agreeing part (that part is public text either way), which also
absorbs a tokenizer merging the prefix's last token with what follows. This package imports
nothing from `app`, `engine` or `cache`; turning text into token ids is the caller's job.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MAX_PREFIXES = 64
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True, slots=True)
class PublicPrefix:
    name: str
    token_ids: tuple[int, ...]


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"public prefix name {name!r} must be 1-64 characters of letters, digits, '_', '.', "
                         "'-', starting with a letter or digit")
    return name


class PublicPrefixes:
    """The declared public prefixes (at most `MAX_PREFIXES`), by name."""

    def __init__(self, prefixes: Iterable[PublicPrefix] = ()) -> None:
        self._by_name: dict[str, PublicPrefix] = {}
        for prefix in prefixes:
            self.add(prefix)

    def add(self, prefix: PublicPrefix) -> None:
        """Declare (or replace) a prefix; ValueError for a bad name, no tokens, or too many."""
        check_name(prefix.name)
        if not prefix.token_ids:
            raise ValueError(f"public prefix {prefix.name!r} has no tokens")
        if prefix.name not in self._by_name and len(self._by_name) >= MAX_PREFIXES:
            raise ValueError(f"at most {MAX_PREFIXES} public prefixes; remove one first")
        self._by_name[prefix.name] = prefix

    def remove(self, name: str) -> bool:
        return self._by_name.pop(name, None) is not None

    def __len__(self) -> int:
        return len(self._by_name)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(sorted(self._by_name.values(), key=lambda p: p.name))

    def match(self, prompt: Sequence[int]) -> int:
        """How many leading tokens of ``prompt`` agree with the best-matching declared prefix."""
        best = 0
        for prefix in self._by_name.values():
            ids = prefix.token_ids
            if not prompt or prompt[0] != ids[0]:
                continue
            best = max(best, _common_prefix(prompt, ids))
        return best


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix, by bisection over C-level slice comparisons."""
    lo, hi = 0, min(len(a), len(b))
    if list(a[:hi]) == list(b[:hi]):
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo], and the answer is at most hi
        mid = (lo + hi + 1) // 2
        if list(a[:mid]) == list(b[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo
