"""Salted chained block hashes: what the root mixes in, how the chain carries it, a frozen format."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.hashing import HASH_SIZE, extend_block_hashes, hash_block_tokens, root_hash

BLOCK = 4
ROOT = root_hash(b"ns", b"model-fp", "salt")


def chain(tokens: list[int], root: bytes = ROOT, block_size: int = BLOCK) -> list[bytes]:
    return extend_block_hashes([], root, tokens, block_size)


def test_golden_digests_pin_the_hash_format() -> None:
    # Hashes name KV that outlives the process (host, disk and remote tiers): a change of
    # format must be deliberate, so these digests fail loudly on an accidental one.
    assert ROOT.hex() == "c11635f4788ccdc69582d26b976c04ab4c0f1a372439e797f4f5877c08b8704e"
    assert hash_block_tokens(ROOT, [1, 2, 3, 4]).hex() == (
        "cdaaac6dcb3d941f8c6e0c2d20e304f7279c97ab514160b8f95179f6c230eca0")
    assert root_hash(b"", b"").hex() == "9966f5d911de91a780b45413c0380f599ed766b25443fa0035d84335a660b41d"


def test_digests_are_hash_size_bytes() -> None:
    assert len(ROOT) == HASH_SIZE == 32
    assert len(hash_block_tokens(ROOT, [7] * BLOCK)) == HASH_SIZE


def test_root_depends_on_namespace_model_and_cache_salt() -> None:
    roots = {
        root_hash(b"ns", b"model-fp", "salt"),
        root_hash(b"ns2", b"model-fp", "salt"),
        root_hash(b"ns", b"model-fp2", "salt"),
        root_hash(b"ns", b"model-fp", "salt2"),
        root_hash(b"ns", b"model-fp", None),
        root_hash(b"ns", b"model-fp", ""),
    }
    assert len(roots) == 6
    assert root_hash(b"ns", b"model-fp", "salt") == ROOT


def test_cache_salt_none_and_empty_string_differ() -> None:
    assert root_hash(b"ns", b"m", None) != root_hash(b"ns", b"m", "")
    assert root_hash(b"ns", b"m") == root_hash(b"ns", b"m", None)


def test_fields_are_length_prefixed_so_boundaries_matter() -> None:
    assert root_hash(b"ab", b"c") != root_hash(b"a", b"bc")
    assert root_hash(b"a", b"", "b") != root_hash(b"a", b"b", None)
    assert hash_block_tokens(ROOT, [1, 2], b"x") != hash_block_tokens(ROOT, [1, 2, 120])


def test_block_hash_depends_on_parent_tokens_order_and_extra() -> None:
    base = hash_block_tokens(ROOT, [1, 2, 3, 4])
    assert hash_block_tokens(ROOT, [1, 2, 3, 4]) == base
    assert hash_block_tokens(root_hash(b"ns", b"model-fp", None), [1, 2, 3, 4]) != base
    assert hash_block_tokens(ROOT, [4, 3, 2, 1]) != base
    assert hash_block_tokens(ROOT, [1, 2, 3, 4], b"lora-1") != base
    assert hash_block_tokens(ROOT, (1, 2, 3, 4)) == base


def test_same_tokens_same_root_give_same_chain() -> None:
    tokens = list(range(12))
    assert chain(tokens) == chain(list(tokens))
    assert len(set(chain(tokens))) == 3


def test_chain_is_hash_block_tokens_folded_over_blocks() -> None:
    tokens = list(range(10, 22))
    h0 = hash_block_tokens(ROOT, tokens[0:4])
    h1 = hash_block_tokens(h0, tokens[4:8])
    h2 = hash_block_tokens(h1, tokens[8:12])
    assert chain(tokens) == [h0, h1, h2]


@pytest.mark.parametrize("changed_block", [0, 1, 2, 3])
def test_change_in_block_i_changes_hashes_from_i_on_only(changed_block: int) -> None:
    tokens = list(range(16))
    edited = list(tokens)
    edited[changed_block * BLOCK + 2] += 100
    before, after = chain(tokens), chain(edited)
    assert after[:changed_block] == before[:changed_block]
    for i in range(changed_block, 4):
        assert after[i] != before[i]


def test_different_root_changes_every_block() -> None:
    tokens = list(range(12))
    other = chain(tokens, root_hash(b"ns", b"model-fp", "other"))
    assert all(a != b for a, b in zip(chain(tokens), other, strict=True))


@pytest.mark.parametrize(("num_tokens", "num_hashes"), [(0, 0), (1, 0), (3, 0), (4, 1), (7, 1), (8, 2), (13, 3)])
def test_only_full_blocks_are_hashed(num_tokens: int, num_hashes: int) -> None:
    assert len(chain(list(range(num_tokens)))) == num_hashes


def test_extend_appends_in_place_and_returns_the_same_list() -> None:
    hashes: list[bytes] = []
    out = extend_block_hashes(hashes, ROOT, list(range(9)), BLOCK)
    assert out is hashes
    assert len(hashes) == 2


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 5), max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=6),
    block_size=st.sampled_from([1, 2, 4, 16]),
)
def test_incremental_extension_equals_one_shot(tokens: list[int], cuts: list[int], block_size: int) -> None:
    hashes: list[bytes] = []
    for cut in sorted(cuts) + [len(tokens)]:
        extend_block_hashes(hashes, ROOT, tokens[: min(cut, len(tokens))], block_size)
    assert hashes == extend_block_hashes([], ROOT, tokens, block_size)


def test_decode_one_token_at_a_time_equals_one_shot() -> None:
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    hashes: list[bytes] = []
    for n in range(1, len(tokens) + 1):
        extend_block_hashes(hashes, ROOT, tokens[:n], BLOCK)
        assert len(hashes) == n // BLOCK
    assert hashes == chain(tokens)


salts = st.tuples(st.binary(max_size=6), st.one_of(st.none(), st.text(max_size=4)))


@settings(max_examples=100, deadline=None)
@given(pairs=st.sets(salts, min_size=2, max_size=12), tokens=st.lists(st.integers(0, 3), min_size=8, max_size=8))
def test_different_salts_never_collide(pairs: set[tuple[bytes, str | None]], tokens: list[int]) -> None:
    roots = [root_hash(ns, b"model-fp", cache_salt) for ns, cache_salt in pairs]
    chains = [chain(tokens, root) for root in roots]
    every_hash = roots + [h for c in chains for h in c]
    assert len(set(every_hash)) == len(every_hash)


PUBLIC = root_hash(b"public-salt", b"model-fp")
TENANT_A, TENANT_B = root_hash(b"salt-a", b"model-fp"), root_hash(b"salt-b", b"model-fp")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=BLOCK, max_size=12 * BLOCK), st.integers(1, 12),
       st.integers(0, 6))
def test_a_public_prefix_is_shared_and_what_follows_it_is_each_tenants_own(
        tokens: list[int], public_blocks: int, split: int) -> None:
    public_blocks = min(public_blocks, len(tokens) // BLOCK)
    a = extend_block_hashes([], PUBLIC, tokens, BLOCK, (public_blocks, TENANT_A))
    b = extend_block_hashes([], PUBLIC, tokens, BLOCK, (public_blocks, TENANT_B))
    assert a[:public_blocks] == b[:public_blocks] == chain(tokens, PUBLIC)[:public_blocks]
    assert not set(a[public_blocks:]) & set(b[public_blocks:])  # never each other's continuation
    assert not set(a) & set(chain(tokens, TENANT_A))  # nor the tenant's private chain of the prompt
    # incremental (a decoding sequence) equals all at once
    cut = min(len(tokens), split * BLOCK)
    step = extend_block_hashes([], PUBLIC, tokens[:cut], BLOCK, (public_blocks, TENANT_A))
    assert extend_block_hashes(step, PUBLIC, tokens, BLOCK, (public_blocks, TENANT_A)) == a
