"""Buffer lists for vectored I/O (``readv``, ``writev``, ``sendmsg``): a call may move only part
of them, and the next call goes on from where it stopped."""

from __future__ import annotations


def advance(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` without their first ``n`` bytes: buffers used up are dropped, a partly used one
    is cut to what is left of it."""
    i = 0
    while i < len(views) and n >= views[i].nbytes:
        n -= views[i].nbytes
        i += 1
    rest = views[i:]
    if rest and n:
        rest[0] = rest[0][n:]
    return rest
