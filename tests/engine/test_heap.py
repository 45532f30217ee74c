"""keep_heap_memory: after it, a 16 MiB allocation comes from the heap (not a fresh mmap) and
stays mapped when freed; checked in a fresh interpreter through glibc's own counters."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = r"""
import ctypes, sys
from engine.heap import keep_heap_memory

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
kept = sys.argv[1] == "keep"
if kept:
    assert keep_heap_memory()
before = libc.mallinfo2()
p = libc.malloc(16 << 20)
ctypes.memset(p, 1, 16 << 20)
during = libc.mallinfo2()
libc.free(p)
after = libc.mallinfo2()
print(during.hblkhd - before.hblkhd, during.arena - before.arena, after.arena - before.arena)
"""


def measure(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return [int(x) for x in out.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator only")
def test_freed_activations_stay_in_the_heap_instead_of_fresh_mmaps() -> None:
    mapped, heap_growth, heap_kept = measure("keep")
    assert mapped == 0  # not an mmap of its own
    # in the heap, and still there after free; the heap's top may already have held a few pages of
    # it (Ubuntu 24.04's glibc grew the arena by 16 MiB - 28 KiB), hence "15 MiB or more"
    assert heap_growth >= 15 << 20 and heap_kept >= 15 << 20
    mapped, _, heap_kept = measure("default")  # glibc's defaults: its own mmap, gone when freed
    assert mapped >= 16 << 20 and heap_kept < 1 << 20
