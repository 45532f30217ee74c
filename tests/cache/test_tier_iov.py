"""iov.advance: what is left of a buffer list after a vectored call moved n bytes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cache.tiers.iov import advance


@given(st.lists(st.binary(max_size=40), max_size=6), st.data())
def test_advance_leaves_exactly_the_bytes_after_n(chunks: list[bytes], data: st.DataObject) -> None:
    whole = b"".join(chunks)
    n = data.draw(st.integers(0, len(whole)))
    rest = advance([memoryview(c) for c in chunks], n)
    assert b"".join(bytes(v) for v in rest) == whole[n:]
    assert not rest or rest[0].nbytes > 0  # a used-up buffer is never left first


def test_a_partly_used_buffer_is_cut_not_copied() -> None:
    buf = bytearray(b"abcdef")
    rest = advance([memoryview(b"xy"), memoryview(buf)], 4)
    assert bytes(rest[0]) == b"cdef" and rest[0].obj is buf
