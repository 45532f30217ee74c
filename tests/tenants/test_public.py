"""Public prefixes: declaring, matching a prompt's leading tokens, limits and names."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tenants.public import MAX_PREFIXES, PublicPrefix, PublicPrefixes, check_name
from tenants.registry import TenantRegistry, TenantSpec


def naive_common(a: list[int], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=4),
       st.lists(st.integers(0, 3), max_size=60))
def test_match_is_the_longest_agreement_with_any_declared_prefix(prefixes: list[list[int]], prompt: list[int]) -> None:
    store = PublicPrefixes(PublicPrefix(f"p{i}", tuple(ids)) for i, ids in enumerate(prefixes))
    assert store.match(prompt) == max(naive_common(prompt, tuple(ids)) for ids in prefixes)


def test_declare_replace_remove_and_limits() -> None:
    store = PublicPrefixes()
    store.add(PublicPrefix("sys", (1, 2, 3)))
    store.add(PublicPrefix("sys", (1, 2, 3, 4)))  # replaced, not added
    assert len(store) == 1 and store.match([1, 2, 3, 4, 5]) == 4
    assert store.remove("sys") and not store.remove("sys") and store.match([1, 2, 3]) == 0
    with pytest.raises(ValueError, match="no tokens"):
        store.add(PublicPrefix("empty", ()))
    for i in range(MAX_PREFIXES):
        store.add(PublicPrefix(f"p{i}", (i + 1,)))
    with pytest.raises(ValueError, match=f"at most {MAX_PREFIXES}"):
        store.add(PublicPrefix("one-more", (9,)))
    for bad in ("", "-x", "a b", "x" * 65, "../etc"):
        with pytest.raises(ValueError, match="public prefix name"):
            check_name(bad)


def test_the_public_namespace_is_no_tenants_and_no_groups() -> None:
    registry = TenantRegistry.build([TenantSpec("public", ("k1",)), TenantSpec("a", ("k2",), "public")],
                                    b"s" * 32)
    salts = {registry.get("public").salt, registry.get("a").salt, registry.anonymous.salt}
    assert registry.public_salt not in salts and len(registry.public_salt) == 32
