"""Salted, chained prefix hashes of KV blocks.

Block *i* of a sequence is keyed by ``h_i = H(h_{i-1} || token_ids of block i || extra)`` with
``h_{-1} = H(namespace salt || model fingerprint || cache_salt)``. ``H`` is BLAKE2b-256, so keys
are stable across processes and machines (unlike Python's ``hash()``) and a tenant that does not
know another tenant's salt can never produce one of its keys. Only full blocks get a hash.

A prompt that starts with a *public* prefix (declared by the admin) chains its first ``p`` blocks
from the public namespace's root instead, so every tenant computes the same keys for them; block
``p`` then mixes the tenant's own root in as ``extra`` (``switch = (p, tenant root)``), so every
block after the public prefix is the tenant's alone again.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b

BlockHash = bytes
"""A 32-byte digest naming one block's KV: the prefix up to and including that block."""

HASH_SIZE = 32
_ROOT_PERSON = b"kvgate-root-v1"
_BLOCK_PERSON = b"kvgate-blk-v1"


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    packed = array("q", token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def _field(data: bytes) -> bytes:
    """Length-prefix a field so that no two different field tuples concatenate alike."""
    return len(data).to_bytes(4, "little") + data


def root_hash(namespace_salt: bytes, model_fingerprint: bytes, cache_salt: str | None = None) -> BlockHash:
    """The parent hash of block 0: mixes the tenant's salt, the model and the request's salt."""
    h = blake2b(digest_size=HASH_SIZE, person=_ROOT_PERSON)
    h.update(_field(namespace_salt))
    h.update(_field(model_fingerprint))
    h.update(_field(b"" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8")))
    return h.digest()


def prompt_roots(namespace_salt: bytes, model_fingerprint: bytes, cache_salt: str | None, public_blocks: int,
                 public_salt: bytes) -> tuple[BlockHash, tuple[int, BlockHash] | None]:
    """A prompt's root hash and public-prefix switch for `extend_block_hashes`: the tenant's root,
    or the public namespace's when the prompt leads with ``public_blocks`` full blocks of a
    declared public prefix (never with a ``cache_salt``: it asked for isolation)."""
    root = root_hash(namespace_salt, model_fingerprint, cache_salt)
    if public_blocks and public_salt and cache_salt is None:
        return root_hash(public_salt, model_fingerprint), (public_blocks, root)
    return root, None


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash one full block given its parent's hash; a pure function of its arguments."""
    h = blake2b(digest_size=HASH_SIZE, person=_BLOCK_PERSON)
    h.update(parent)
    h.update(_field(_pack_tokens(token_ids)))
    h.update(_field(extra))
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash], root: BlockHash, token_ids: Sequence[int], block_size: int,
    switch: tuple[int, BlockHash] | None = None,
) -> list[BlockHash]:
    """Append the hashes of every newly completed full block of ``token_ids`` to ``hashes``.

    ``hashes`` already covers the first ``len(hashes)`` blocks; the call is incremental so a
    decoding sequence pays for each block once. ``switch = (p, tenant_root)`` (p > 0) mixes the
    tenant's root into block ``p``: blocks before it are public (``root`` is the public root).
    """
    num_full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), num_full):
        extra = switch[1] if switch is not None and i == switch[0] else b""
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes
