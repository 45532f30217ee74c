"""Authenticated records for the shared store: a seal in front of every value in Redis.

    value  nonce (16) | tag (16) | codec record (header | payload)
    tag    Poly1305(one-time key, header | payload)
    key    BLAKE2b-256(keyed with the store key, nonce | model fingerprint | block hash)

The store key is derived from the server secret (``tenants.registry.store_mac_key``), so every
replica of one deployment shares it and nobody else has it: a record planted by any other
writer, altered in any bit (nonce and tag included), cut short, or copied under another block's
key (or another model's) fails its tag, and the reader drops it as `UnauthenticBlockError`.
Poly1305 is a one-time authenticator — a key must never tag two messages — so each record draws
a fresh random nonce, and its one-time key also binds the name it is stored under. Poly1305, not
HMAC-SHA256: several times faster, so checking a record costs a small part of loading it, where
HMAC would cap the tier's load rate (docs/security.md has the figures).
"""

from __future__ import annotations

import hashlib
import os

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.poly1305 import Poly1305

from cache.tiers.codec import CorruptBlockError

NONCE_SIZE = 16
TAG_SIZE = 16
SEAL_SIZE = NONCE_SIZE + TAG_SIZE  # bytes in front of every record in the shared store
KEY_SIZE = 32
MAC_NAME = "poly1305"


class UnauthenticBlockError(CorruptBlockError):
    """A stored block's seal does not verify under this deployment's key: planted, altered, or
    written with another server secret. It must never reach attention."""


class StoreMac:
    """Seals and checks the records of one model in one shared store under the store key.

    The key is never shown: not in ``repr``, not in any message this class raises."""

    __slots__ = ("_fingerprint", "_key")

    def __init__(self, key: bytes, fingerprint: bytes) -> None:
        if not isinstance(key, bytes) or len(key) != KEY_SIZE:
            raise ValueError(f"the store MAC key (mac_key) must be {KEY_SIZE} bytes: tenants.registry.store_mac_key "
                             f"of the server secret, the same on every replica")
        self._key = key
        self._fingerprint = fingerprint

    def __repr__(self) -> str:
        return f"StoreMac({MAC_NAME})"

    def seal(self, block_hash: bytes, *parts: bytes | memoryview) -> bytes:
        """The seal (nonce and tag) of the record made of ``parts`` stored as ``block_hash``."""
        nonce = os.urandom(NONCE_SIZE)
        mac = self._mac(nonce, block_hash)
        for part in parts:
            mac.update(_octets(part))
        return nonce + mac.finalize()

    def check(self, block_hash: bytes, seal: bytes | memoryview, *parts: bytes | memoryview) -> None:
        """Raise `UnauthenticBlockError` unless ``seal`` is this key's seal of ``parts`` (the
        record, in pieces as received) stored as ``block_hash``; the tag compares in constant time."""
        given = bytes(seal)
        if len(given) != SEAL_SIZE:
            raise UnauthenticBlockError(f"the seal is {len(given)} bytes, not {SEAL_SIZE}")
        mac = self._mac(given[:NONCE_SIZE], block_hash)
        for part in parts:
            mac.update(_octets(part))
        try:
            mac.verify(given[NONCE_SIZE:])
        except InvalidSignature:
            raise UnauthenticBlockError("the record's MAC does not verify: written with another server "
                                        "secret, or altered") from None

    def open(self, block_hash: bytes, value: bytes | memoryview) -> memoryview:
        """The record inside a whole stored ``value`` (a view, no copy), once its seal verifies."""
        view = memoryview(value).cast("B")
        if view.nbytes < SEAL_SIZE:
            raise UnauthenticBlockError(f"record is {view.nbytes} bytes, too short to carry a {SEAL_SIZE}-byte seal")
        self.check(block_hash, view[:SEAL_SIZE], view[SEAL_SIZE:])
        return view[SEAL_SIZE:]

    def _mac(self, nonce: bytes, block_hash: bytes) -> Poly1305:
        one_time = hashlib.blake2b(nonce + self._fingerprint + block_hash, digest_size=KEY_SIZE, key=self._key)
        return Poly1305(one_time.digest())


def _octets(part: bytes | memoryview) -> bytes | memoryview:
    """``part`` as Poly1305 takes it: bytes, or a flat view of unsigned bytes (a slot's view may
    be typed or shaped; Poly1305 refuses those)."""
    return part if isinstance(part, bytes) else memoryview(part).cast("B")
