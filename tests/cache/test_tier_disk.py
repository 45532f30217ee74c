"""DiskTier: one atomic file per block, an index rebuilt at start, corrupt files and I/O errors
counted and survived."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from cache.tiers import disk as disk_module
from cache.tiers.codec import BlockFormat, encode
from cache.tiers.disk import SUFFIX, DiskTier

FP = bytes(range(32))
FP2 = bytes(range(1, 33))
FMT = BlockFormat(FP, "float32", (2, 4))  # 32-byte payload
REC = FMT.record_size


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def payload(i: int) -> bytes:
    return bytes((i * 13 + j) % 256 for j in range(FMT.payload_size))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def write(tier: DiskTier, i: int) -> bool:
    return run(tier.write(key(i), payload(i)))


def read(tier: DiskTier, i: int) -> bytes | None:
    return run(tier.read(key(i)))


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def make(tmp_path: Path, blocks: int = 8, fmt: BlockFormat = FMT, policy: str = "lru") -> DiskTier:
    return DiskTier(tmp_path, blocks * fmt.record_size, fmt, policy=policy)


def test_capacity_from_bytes(tmp_path: Path) -> None:
    assert DiskTier(tmp_path, 3 * REC + REC - 1, FMT).capacity_blocks == 3
    with pytest.raises(ValueError, match="holds no block"):
        DiskTier(tmp_path, REC - 1, FMT)


def test_write_read_round_trip_and_layout(tmp_path: Path) -> None:
    tier = make(tmp_path)
    assert tier.dir == tmp_path / FP.hex()[:16]
    assert write(tier, 1) and write(tier, 2)
    assert read(tier, 1) == payload(1)
    assert read(tier, 2) == payload(2)
    assert files(tier.dir) == sorted([key(1).hex() + SUFFIX, key(2).hex() + SUFFIX])  # no .tmp left
    assert tier.path_of(key(1)) == tier.dir / f"{key(1).hex()}.kvb"
    assert tier.path_of(key(1)).read_bytes() == encode(FMT, key(1), payload(1))
    assert key(1) in tier and len(tier) == 2 and tier.nbytes == 2 * REC
    s = tier.stats
    assert (s.puts, s.writes, s.bytes_written) == (2, 2, 2 * REC)
    assert (s.hits, s.reads, s.bytes_read, s.misses) == (2, 2, 2 * REC, 0)
    tier.check_invariants()


def test_write_of_a_present_key_is_a_noop(tmp_path: Path) -> None:
    tier = make(tmp_path)
    assert write(tier, 1)
    before = tier.path_of(key(1)).stat().st_mtime_ns
    assert run(tier.write(key(1), payload(9)))
    assert tier.stats.writes == 1
    assert tier.path_of(key(1)).stat().st_mtime_ns == before
    assert read(tier, 1) == payload(1)


def test_memoryview_payload(tmp_path: Path) -> None:
    tier = make(tmp_path)
    assert run(tier.write(key(1), memoryview(bytearray(payload(1)))))
    assert read(tier, 1) == payload(1)


def test_miss(tmp_path: Path) -> None:
    tier = make(tmp_path)
    assert read(tier, 5) is None
    assert tier.stats.misses == 1 and tier.stats.hits == 0


def test_delete(tmp_path: Path) -> None:
    tier = make(tmp_path)
    write(tier, 1)
    assert tier.delete(key(1))
    assert not tier.delete(key(1))
    assert key(1) not in tier and files(tier.dir) == []
    assert read(tier, 1) is None
    tier.check_invariants()


def test_wrong_size_payload_does_not_leak_capacity(tmp_path: Path) -> None:
    tier = make(tmp_path, blocks=2)
    with pytest.raises(ValueError):
        run(tier.write(key(1), b"short"))
    assert files(tier.dir) == []
    assert write(tier, 2) and write(tier, 3)  # both slots are still there: nothing evicted
    assert len(tier) == 2 and tier.stats.evictions == 0
    tier.check_invariants()


# ---- restart --------------------------------------------------------------------------------


def test_blocks_outlive_a_restart(tmp_path: Path) -> None:
    tier = make(tmp_path)
    for i in range(3):
        write(tier, i)
    again = make(tmp_path)
    assert again.rebuilt == 3 and len(again) == 3
    for i in range(3):
        assert key(i) in again
        assert read(again, i) == payload(i)
    again.check_invariants()


def test_restart_orders_eviction_by_mtime_and_trims_to_capacity(tmp_path: Path) -> None:
    tier = make(tmp_path)
    for i in range(5):
        write(tier, i)
    # make block 3 the oldest, then 1, then 4, 0, 2
    for age, i in enumerate([3, 1, 4, 0, 2]):
        os.utime(tier.path_of(key(i)), (1_000_000 + age, 1_000_000 + age))
    small = make(tmp_path, blocks=3)
    assert small.rebuilt == 3
    assert {i for i in range(5) if key(i) in small} == {4, 0, 2}
    assert files(small.dir) == sorted(key(i).hex() + SUFFIX for i in (4, 0, 2))  # trimmed files deleted
    assert small.stats.evictions == 2
    write(small, 7)  # full: the oldest remaining (4) goes first
    assert key(4) not in small and not small.path_of(key(4)).exists()
    small.check_invariants()


def test_leftover_tmp_and_wrong_size_files_removed_at_start(tmp_path: Path) -> None:
    tier = make(tmp_path)
    write(tier, 1)
    d = tier.dir
    (d / f".{key(2).hex()[:16]}.deadbeef.tmp").write_bytes(encode(FMT, key(2), payload(2)))
    (d / (key(3).hex() + SUFFIX)).write_bytes(encode(FMT, key(3), payload(3))[:-1])  # truncated
    (d / (key(4).hex() + SUFFIX)).write_bytes(encode(FMT, key(4), payload(4)) + b"\0")  # padded
    (d / "notes.txt").write_text("left alone")  # not ours: ignored, kept
    (d / ("zz" * 32 + SUFFIX)).write_bytes(b"x" * REC)  # not a hex name: ignored
    again = make(tmp_path)
    assert again.rebuilt == 1
    assert again.stats.corrupt == 2
    assert files(d) == sorted([key(1).hex() + SUFFIX, "notes.txt", "zz" * 32 + SUFFIX])
    assert read(again, 1) == payload(1)
    assert read(again, 3) is None and read(again, 4) is None
    again.check_invariants()


def test_unwritable_root_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError, match="cannot create the disk cache folder"):
        DiskTier(blocker, 8 * REC, FMT)


# ---- capacity -------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_capacity_never_exceeded(tmp_path: Path, policy: str) -> None:
    tier = make(tmp_path, blocks=3, policy=policy)
    for i in range(10):
        assert write(tier, i)
        assert len(tier) <= 3
        assert len(list(tier.dir.glob("*" + SUFFIX))) == len(tier)
        tier.check_invariants()
    assert tier.stats.evictions == 7


def test_oldest_evicted_and_its_file_deleted(tmp_path: Path) -> None:
    tier = make(tmp_path, blocks=3)
    for i in range(3):
        write(tier, i)
    assert read(tier, 0) == payload(0)  # 0 is now the most recent; 1 is the oldest
    write(tier, 3)
    assert key(1) not in tier and not tier.path_of(key(1)).exists()
    write(tier, 4)
    assert key(2) not in tier and not tier.path_of(key(2)).exists()
    assert {i for i in range(5) if key(i) in tier} == {0, 3, 4}
    assert tier.stats.evictions == 2


def test_concurrent_writes_respect_capacity(tmp_path: Path) -> None:
    tier = make(tmp_path, blocks=3)

    async def many() -> list[bool]:
        return await asyncio.gather(*(tier.write(key(i), payload(i)) for i in range(12)))

    results = run(many())
    assert sum(results) <= 3 and len(tier) == sum(results)
    assert tier.stats.dropped == 12 - sum(results)
    assert len(list(tier.dir.iterdir())) == len(tier)  # no temporary file left either
    tier.check_invariants()
    assert write(tier, 20) and len(tier) <= 3  # reservations were all released


# ---- corruption after start -----------------------------------------------------------------


@pytest.mark.parametrize("damage", [
    lambda data: b"\x5a" * len(data),  # garbage of the right size
    lambda data: data[: len(data) // 2],  # truncated
    lambda data: data[:-1] + bytes([data[-1] ^ 1]),  # one payload bit
    lambda data: b"",  # empty
])
def test_file_damaged_after_start(tmp_path: Path, damage: Callable[[bytes], bytes]) -> None:
    tier = make(tmp_path)
    write(tier, 1)
    write(tier, 2)
    path = tier.path_of(key(1))
    path.write_bytes(damage(path.read_bytes()))
    assert read(tier, 1) is None
    assert not path.exists()
    assert key(1) not in tier and len(tier) == 1
    assert tier.stats.corrupt == 1 and tier.stats.misses == 1 and tier.stats.hits == 0
    assert read(tier, 2) == payload(2)  # the neighbour is fine
    tier.check_invariants()
    assert write(tier, 1) and read(tier, 1) == payload(1)  # can be stored again


def test_file_renamed_to_another_hash_is_rejected(tmp_path: Path) -> None:
    tier = make(tmp_path)
    write(tier, 1)
    write(tier, 2)
    shutil.copyfile(tier.path_of(key(1)), tier.path_of(key(2)))  # block 1's record under 2's name
    assert read(tier, 2) is None
    assert tier.stats.corrupt == 1 and not tier.path_of(key(2)).exists()
    assert read(tier, 1) == payload(1)


def test_file_removed_behind_the_tiers_back(tmp_path: Path) -> None:
    tier = make(tmp_path)
    write(tier, 1)
    tier.path_of(key(1)).unlink()
    assert read(tier, 1) is None
    assert key(1) not in tier and tier.stats.misses == 1 and tier.stats.corrupt == 0
    tier.check_invariants()


# ---- other models ---------------------------------------------------------------------------


def test_other_fingerprint_is_not_visible(tmp_path: Path) -> None:
    tier = make(tmp_path)
    write(tier, 1)
    other_fmt = BlockFormat(FP2, FMT.dtype, FMT.shape)
    other = make(tmp_path, fmt=other_fmt)
    assert other.dir != tier.dir and other.dir.parent == tier.dir.parent
    assert other.rebuilt == 0 and key(1) not in other
    assert run(other.read(key(1))) is None
    assert run(other.write(key(1), payload(5)))  # same hash, another model: its own file
    assert run(other.read(key(1))) == payload(5)
    assert read(tier, 1) == payload(1)


def test_foreign_record_in_our_folder_is_rejected(tmp_path: Path) -> None:
    tier = make(tmp_path)
    foreign = encode(BlockFormat(FP2, FMT.dtype, FMT.shape), key(1), payload(1))  # right size
    tier.path_of(key(1)).write_bytes(foreign)
    again = make(tmp_path)
    assert key(1) in again  # the size is right, so it is indexed ...
    assert read(again, 1) is None  # ... but never served
    assert again.stats.corrupt == 1 and not again.path_of(key(1)).exists()


# ---- I/O errors -----------------------------------------------------------------------------


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR


def failing_open(exc: OSError) -> Any:
    """``os.open`` that raises ``exc`` for a file opened to write (the tier's writes) and opens
    files to read as usual."""
    real_open = os.open

    def fake(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & _WRITE_FLAGS:
            raise exc
        return real_open(path, flags, *args, **kwargs)

    return fake


def half_writev(fd: int, bufs: Any) -> int:
    """``os.writev`` on a full disk: half of the first buffer lands, then ENOSPC."""
    first = memoryview(bufs[0])
    os.write(fd, first[: len(first) // 2])
    raise OSError(errno.ENOSPC, "No space left on device")


@contextmanager
def read_only(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make ``folder`` unwritable: chmod where that works, a patched ``os.open`` as root."""
    os.chmod(folder, 0o555)
    try:
        probe = folder / ".probe"
        try:
            probe.write_bytes(b"")
        except PermissionError:
            yield  # chmod is honoured
            return
        probe.unlink()  # running as root: chmod does not stop writes; simulate EROFS
        os.chmod(folder, 0o755)
        with monkeypatch.context() as m:
            m.setattr(disk_module.os, "open", failing_open(OSError(errno.EROFS, "Read-only file system")))
            yield
    finally:
        os.chmod(folder, 0o755)


def test_read_only_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make(tmp_path)
    write(tier, 1)
    with read_only(tier.dir, monkeypatch):
        assert not write(tier, 2)
        assert not write(tier, 3)
        assert tier.stats.errors == 2
        assert key(2) not in tier and len(tier) == 1
        assert files(tier.dir) == [key(1).hex() + SUFFIX]  # nothing left behind
        assert read(tier, 1) == payload(1)  # reads still work
    assert tier._reserved == 0
    assert write(tier, 2) and read(tier, 2) == payload(2)  # fault cleared: writes succeed
    assert tier.stats.errors == 2
    tier.check_invariants()


def test_disk_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make(tmp_path)
    with monkeypatch.context() as m:
        m.setattr(disk_module.os, "writev", half_writev)
        assert not write(tier, 1)
        assert not write(tier, 2)
    assert tier.stats.errors == 2 and tier.stats.writes == 0
    assert files(tier.dir) == []  # the partial temporary files were removed
    assert len(tier) == 0 and tier._reserved == 0
    assert write(tier, 1) and read(tier, 1) == payload(1)
    tier.check_invariants()


def test_fsync_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make(tmp_path)

    def bad_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as m:
        m.setattr(disk_module.os, "fsync", bad_fsync)
        assert not write(tier, 1)
    assert tier.stats.errors == 1 and files(tier.dir) == [] and len(tier) == 0
    assert write(tier, 1)


def test_read_error_is_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make(tmp_path)
    write(tier, 1)
    def failing_readv(fd: int, bufs: object) -> int:
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as m:
        m.setattr(disk_module.os, "readv", failing_readv)
        assert read(tier, 1) is None
    assert tier.stats.errors == 1 and tier.stats.corrupt == 0
    assert key(1) in tier and read(tier, 1) == payload(1)  # a transient error keeps the block


def test_errors_logged_once_per_kind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     caplog: pytest.LogCaptureFixture) -> None:
    tier = make(tmp_path)
    with monkeypatch.context() as m:
        m.setattr(disk_module.os, "open", failing_open(OSError(errno.ENOSPC, "No space left")))
        with caplog.at_level("ERROR", logger=disk_module.__name__):
            for i in range(5):
                assert not write(tier, i)
    assert tier.stats.errors == 5
    assert len([r for r in caplog.records if r.name == disk_module.__name__]) == 1


def test_read_many_into_given_buffers(tmp_path: Path) -> None:
    """A batch read puts each payload straight into its destination buffer; a damaged, padded or
    missing file gives None (and is counted) whatever the others do."""
    tier = make(tmp_path)
    for i in range(5):
        assert write(tier, i)
    padded = tier.path_of(key(1))
    padded.write_bytes(padded.read_bytes() + b"\0")
    tier.path_of(key(2)).write_bytes(tier.path_of(key(2)).read_bytes()[:-1])
    dests = [memoryview(bytearray(FMT.payload_size)) for _ in range(5)]
    keys = [key(0), key(1), key(2), key(3), key(9)]
    out = run(tier.read_many(keys, [dests[0], dests[1], dests[2], None, dests[4]]))
    assert out[0] is not None and bytes(out[0]) == payload(0) and bytes(dests[0]) == payload(0)
    assert out[0].obj is dests[0].obj  # a view of the destination, not a copy
    assert out[1] is None and out[2] is None and out[4] is None
    assert out[3] is not None and bytes(out[3]) == payload(3) and not out[3].readonly
    assert tier.stats.corrupt == 2 and tier.stats.hits == 2 and tier.stats.misses == 3
    assert key(1) not in tier and key(2) not in tier and not tier.path_of(key(1)).exists()
    tier.check_invariants()
