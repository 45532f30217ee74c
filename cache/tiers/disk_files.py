"""Block files: one `codec` record per file in a disk tier's folder, named after its block hash.

    <folder>/<block hash hex>.kvb             .<hash hex[:16]>.<random>.tmp while being written

A file is written under a temporary name, fsync'ed and renamed over the final one, so a crash
leaves the whole block or nothing. It is read with one scattered ``readv`` and checked before it
is served: a record stored as it is (codec none) straight into its destination, one of another
codec into a scratch buffer first, then decoded into the destination. The folder may be hostile: a file is opened without following links and without
blocking (a named pipe must not hang a reader), and anything but a regular file is corrupt.
These functions run on worker threads and keep no state: the index is `DiskIndex`'s.
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import NamedTuple

import aiofiles.os
import numpy

from cache.tiers.codec import (
    HEADER_SIZE,
    BlockFormat,
    CorruptBlockError,
    decode_payload,
    encode_record,
    parse,
)
from cache.tiers.iov import advance

SUFFIX = ".kvb"
HASH_HEX = 64  # hex digits of a block hash: a block file's name is these and SUFFIX
# Block files are opened so that neither a link nor a named pipe is followed or waited on.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Loaded(NamedTuple):
    """A block read from its file: the decoded payload, and the bytes its record took on disk."""

    payload: memoryview
    stored: int


def block_path(folder: Path, key: bytes) -> Path:
    """Where the block ``key`` lives in ``folder``."""
    return folder / (key.hex() + SUFFIX)


def temp_path(folder: Path, key: bytes) -> Path:
    """A fresh temporary name in ``folder`` to write the block ``key`` under before the rename."""
    return folder / f".{key.hex()[:16]}.{uuid.uuid4().hex[:8]}.tmp"


def scan(folder: Path, record_sizes: Collection[int]) -> tuple[list[tuple[bytes, int]], int]:
    """The blocks whose files are in ``folder`` with their sizes, oldest modification first (the
    eviction order), and how many files were unusable: of no size in ``record_sizes`` (one per
    codec), or no regular file (a link, a pipe, a device). Those and leftover temporary files are deleted; other names are left alone. Entries
    are judged by ``lstat``: a link is judged itself, never its target."""
    entries: list[tuple[float, bytes, int]] = []
    corrupt = 0
    for entry in os.scandir(folder):
        name = entry.name
        if name.endswith(".tmp"):
            unlink(entry.path)
            continue
        if not name.endswith(SUFFIX) or len(name) != HASH_HEX + len(SUFFIX):
            continue
        try:
            key = bytes.fromhex(name[:HASH_HEX])
            info = entry.stat(follow_symlinks=False)
        except (ValueError, OSError):
            continue
        if not stat.S_ISREG(info.st_mode) or info.st_size not in record_sizes:  # never served
            unlink(entry.path)
            corrupt += 1
            continue
        entries.append((info.st_mtime, key, info.st_size))
    entries.sort()
    return [(key, size) for _, key, size in entries], corrupt


def read_files(fmt: BlockFormat, folder: Path, items: Sequence[tuple[bytes, memoryview | None]]
               ) -> list[Loaded | OSError | CorruptBlockError]:
    """Read and check the files of ``items`` (key, destination or None), each with one scattered
    read: header → its own buffer, payload → the destination (or a fresh buffer), one byte more
    → a spare buffer, so a padded file is caught. A file of another size than a block stored as
    it is holds another codec's record: its payload is read into a scratch buffer and decoded
    into the destination. Each result is the block, or why not.

    Links are not followed and nothing is waited on at open (`_OPEN_FLAGS`); anything but a
    regular file — a link, a named pipe, a device — is corrupt, and never read."""
    out: list[Loaded | OSError | CorruptBlockError] = []
    size = fmt.payload_size
    header = memoryview(bytearray(HEADER_SIZE))
    spare = memoryview(bytearray(1))
    scratch: memoryview | None = None  # encoded payloads, decoded at once: one per batch
    for key, dest in items:
        try:
            fd = os.open(block_path(folder, key), _OPEN_FLAGS)
        except OSError as exc:
            out.append(CorruptBlockError("a symbolic link, not a block file") if exc.errno == errno.ELOOP else exc)
            continue
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                out.append(CorruptBlockError(f"not a regular file (mode {stat.filemode(info.st_mode)})"))
                continue
            if info.st_size == HEADER_SIZE + size:  # stored as it is: straight into the destination
                body = dest if dest is not None else numpy.empty(size, dtype=numpy.uint8).data
            else:
                if scratch is None:
                    scratch = numpy.empty(size, dtype=numpy.uint8).data
                body = scratch
            n = read_scattered(fd, [header, body, spare])
        except OSError as exc:
            out.append(exc)
            continue
        finally:
            os.close(fd)
        try:
            if n < HEADER_SIZE:
                raise CorruptBlockError(f"record is {n} bytes, shorter than the {HEADER_SIZE}-byte header")
            codec, encoded = parse(fmt, key, header, body, n - HEADER_SIZE)
            if codec == "none" and body is not scratch:  # read where it belongs: nothing to decode
                out.append(Loaded(encoded, n))
            else:  # (a record stored as it is lands in the scratch only if its file changed meanwhile)
                out.append(Loaded(decode_payload(fmt, codec, encoded, dest), n))
        except CorruptBlockError as exc:
            out.append(exc)
    return out


def read_scattered(fd: int, bufs: list[memoryview]) -> int:
    """Fill ``bufs`` in order from ``fd`` until they are full or the file ends; bytes read."""
    total = 0
    while bufs:
        n = os.readv(fd, bufs)
        if n == 0:
            break
        total += n
        bufs = advance(bufs, n)
    return total


def write_file(tmp: Path, final: Path, header: bytes, payload: bytes | memoryview) -> None:
    """Write a record to ``tmp`` (header, then payload, gathered), fsync it, rename it to ``final``."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        bufs = [memoryview(header), memoryview(payload).cast("B")]
        while bufs:
            bufs = advance(bufs, os.writev(fd, bufs))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)


def write_record(tmp: Path, final: Path, fmt: BlockFormat, key: bytes, payload: bytes | memoryview,
                 codec: str) -> None:
    """Encode a block with ``codec`` and `write_file` its record (encoding on the caller's thread:
    a writer thread, never the step loop or the I/O loop)."""
    header, body = encode_record(fmt, key, payload, codec)
    write_file(tmp, final, header, body)


# `write_file` / `write_record` as one call on a worker thread (the caller's executor, default the loop's)
write_file_async = aiofiles.os.wrap(write_file)
write_record_async = aiofiles.os.wrap(write_record)


def unlink(path: str | Path) -> None:
    """Delete ``path`` if it is there (a file already gone, or one that cannot go, is no error)."""
    try:
        os.unlink(path)
    except OSError:
        pass
