"""The disk tier against a hostile or broken folder: named pipes and links in place of block
files, a stalled disk, a folder that vanishes, and the reader pool that keeps serving."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from cache.tiers.chain import TierChain
from cache.tiers.codec import BlockFormat
from cache.tiers.disk import DiskTier
from cache.tiers.folders import attachable_folder
from cache.tiers.host import HostTier
from cache.tiers.readers import ReaderPool, ReadersStalled

FMT = BlockFormat(bytes(range(32)), "float16", (4, 8))  # 64-byte payloads
NB = FMT.payload_size
WAIT_S = 10.0  # upper bound of every wait; never reached when things work


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def payload(i: int) -> bytes:
    return bytes((i * 29 + j * 3) % 256 for j in range(NB))


def read(tier: DiskTier, i: int) -> memoryview | None:
    """One read, bounded: a read that waits on a pipe fails the test instead of hanging it."""
    async def bounded() -> memoryview | None:
        return await asyncio.wait_for(tier.read(key(i)), WAIT_S)

    return asyncio.run(bounded())


def make(folder: Path, blocks: int = 8, **kwargs: Any) -> DiskTier:
    tier = DiskTier(folder, blocks * FMT.record_size, FMT, **kwargs)
    for i in range(3):
        assert asyncio.run(tier.write(key(i), payload(i)))
    return tier


@pytest.fixture
def pipes() -> Iterator[list[Path]]:
    """Named pipes a test makes; a writer end is opened on each at teardown, so that a reader
    still blocked on one (the bug this guards against) is let go instead of hanging the run."""
    made: list[Path] = []
    yield made
    for path in made:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader (or no pipe any more): nothing to let go
            pass


# ---- what is in the folder ----------------------------------------------------------------------


def test_a_named_pipe_in_place_of_a_block_is_corrupt_not_waited_on(tmp_path: Path, pipes: list[Path]) -> None:
    tier = make(tmp_path)
    path = tier.path_of(key(1))
    path.unlink()
    os.mkfifo(path)
    pipes.append(path)
    assert read(tier, 1) is None
    assert tier.stats.corrupt == 1 and key(1) not in tier
    assert not os.path.lexists(path)  # the pipe is removed
    assert bytes(read(tier, 0) or b"") == payload(0)  # the others still serve
    tier.check_invariants()


def test_a_link_in_place_of_a_block_is_not_followed(tmp_path: Path) -> None:
    tier = make(tmp_path / "kv")
    outside = tmp_path / "outside.kvb"
    shutil.move(tier.path_of(key(1)), outside)  # a valid record: followed, it would be served
    record = outside.read_bytes()
    tier.path_of(key(1)).symlink_to(outside)
    tier.path_of(key(2)).unlink()
    tier.path_of(key(2)).symlink_to("/etc/passwd")
    assert read(tier, 1) is None and read(tier, 2) is None
    assert tier.stats.corrupt == 2 and tier.stats.hits == 0
    assert not os.path.lexists(tier.path_of(key(1))) and not os.path.lexists(tier.path_of(key(2)))
    assert outside.read_bytes() == record  # the target is left alone
    tier.check_invariants()


def test_links_and_pipes_found_at_start_are_removed(tmp_path: Path, pipes: list[Path]) -> None:
    first = make(tmp_path / "kv")
    outside = tmp_path / "outside.kvb"
    shutil.move(first.path_of(key(0)), outside)
    first.path_of(key(0)).symlink_to(outside)  # the right size once followed
    first.path_of(key(1)).unlink()
    os.mkfifo(first.path_of(key(1)))
    pipes.append(first.path_of(key(1)))
    second = DiskTier(tmp_path / "kv", 8 * FMT.record_size, FMT)
    assert second.rebuilt == 1 and key(2) in second
    assert second.stats.corrupt == 2
    assert not os.path.lexists(second.path_of(key(0))) and not os.path.lexists(second.path_of(key(1)))
    assert outside.exists()


# ---- a folder that vanishes ---------------------------------------------------------------------


def test_a_vanished_folder_is_recreated_and_its_blocks_forgotten(tmp_path: Path) -> None:
    tier = make(tmp_path)
    shutil.rmtree(tier.dir)
    assert tier.health() is None
    assert tier.dir.is_dir() and len(tier) == 0 and tier.stats.lost == 3
    assert read(tier, 0) is None
    assert asyncio.run(tier.write(key(5), payload(5)))
    assert bytes(read(tier, 5) or b"") == payload(5)
    tier.check_invariants()


def test_a_write_finding_the_folder_gone_recreates_it(tmp_path: Path) -> None:
    tier = make(tmp_path)
    shutil.rmtree(tier.dir)
    asyncio.run(tier.write(key(5), payload(5)))  # fails (counted), and brings the folder back
    assert tier.dir.is_dir() and tier.stats.lost == 3
    assert asyncio.run(tier.write(key(6), payload(6)))
    assert len(tier) == 1
    tier.check_invariants()


def test_a_folder_that_cannot_be_recreated_is_unhealthy_until_it_can(tmp_path: Path) -> None:
    tier = make(tmp_path)
    shutil.rmtree(tier.dir)
    tier.dir.write_text("not a folder")  # mkdir cannot make it
    problem = tier.health()
    assert problem is not None and "cannot be recreated" in problem and str(tier.dir) in problem
    assert len(tier) == 0
    assert not asyncio.run(tier.write(key(5), payload(5)))
    tier.dir.unlink()
    assert tier.health() is None and tier.dir.is_dir()
    assert asyncio.run(tier.write(key(5), payload(5)))
    tier.check_invariants()


def test_another_folder_in_its_place_is_indexed(tmp_path: Path) -> None:
    tier = make(tmp_path)
    tier.dir.rename(tmp_path / "old")  # (still there: the new folder cannot reuse its inode)
    tier.dir.mkdir()
    shutil.copy(tmp_path / "old" / tier.path_of(key(2)).name, tier.path_of(key(2)))
    assert tier.health() is None
    assert len(tier) == 1 and bytes(read(tier, 2) or b"") == payload(2)
    tier.check_invariants()


# ---- a stalled disk ---------------------------------------------------------------------------


class StalledDisk(DiskTier):
    """A disk whose reads of the keys in ``stall`` hang until ``gate`` opens (a hung device)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stall: set[bytes] = set()
        self.gate = threading.Event()

    def _read_files(self, items: Sequence[tuple[bytes, memoryview | None]]) -> list[Any]:
        if any(k in self.stall for k, _ in items):
            self.gate.wait(WAIT_S * 3)
        return super()._read_files(items)


@pytest.fixture
def stalled(tmp_path: Path) -> Iterator[tuple[TierChain, StalledDisk]]:
    # a deadline a busy machine's healthy reads still meet (0.2 s made the unstalled reads miss it
    # now and then under load); the stalled ones wait for the gate, far past it
    disk = StalledDisk(tmp_path, 16 * FMT.record_size, FMT, load_timeout_s=1.0)
    chain = TierChain([HostTier(8 * NB, NB), disk])
    try:
        assert chain.io is not None
        for i in range(4):
            assert chain.io.submit(disk.write(key(i), payload(i))).result(WAIT_S)
        yield chain, disk
    finally:
        disk.gate.set()
        chain.close()


def wait_for(chain: TierChain, token: str) -> float:
    """Poll until ``token`` is released; the seconds it took."""
    t0 = time.monotonic()
    while token not in chain.poll():
        assert time.monotonic() - t0 < WAIT_S, f"{token} never released"
        time.sleep(0.005)
    return time.monotonic() - t0


def loaded(chain: TierChain, i: int) -> bytes | None:
    dst = torch.zeros(NB, dtype=torch.uint8)
    return dst.numpy().tobytes() if chain.load(key(i), dst) else None


def test_a_stalled_read_releases_the_request_at_the_deadline(stalled: tuple[TierChain, StalledDisk]) -> None:
    chain, disk = stalled
    host = chain.memory
    assert host is not None
    disk.stall = {key(0), key(1)}
    assert chain.prefetch("stuck", [key(0), key(1)])
    assert wait_for(chain, "stuck") < 10 * disk.load_timeout_s  # released: it recomputes
    assert loaded(chain, 0) is None and loaded(chain, 1) is None
    assert disk.stats.timeouts == 2
    # the stuck read may still write into its host slots: they are not handed to anyone else
    assert len(host.reserved_rows()) == 2
    assert chain.snapshot()["chain"]["inflight_reads"] == 2  # and its keys are not asked for again
    assert not chain.prefetch("again", [key(0)])
    # the pool and the read slots keep serving other blocks, once the pool counts the stalled
    # calls as stuck: past load_timeout_s since they were submitted, which can be a little after
    # the request's own deadline (counted from its prefetch, just before)
    wait_until(lambda: disk.readers.stuck >= 1 and disk.readers.stuck == disk.readers.threads)
    assert chain.prefetch("other", [key(2), key(3)])
    assert wait_for(chain, "other") < 10 * disk.load_timeout_s
    assert loaded(chain, 2) == payload(2) and loaded(chain, 3) == payload(3)
    # the stuck read returns: its blocks land as usual, its slots are free again
    disk.gate.set()
    deadline = time.monotonic() + WAIT_S
    while host.reserved_rows() or chain.snapshot()["chain"]["inflight_reads"]:
        assert time.monotonic() < deadline, "the late read never settled"
        chain.poll()
        time.sleep(0.005)
    assert loaded(chain, 0) == payload(0)
    host.check_invariants()
    disk.check_invariants()


def test_a_stall_steers_later_loads_to_recompute_for_a_while(stalled: tuple[TierChain, StalledDisk]) -> None:
    chain, disk = stalled
    fast = disk.rate.predict_s(2 * FMT.record_size, 2)
    disk.stall = {key(0)}
    assert chain.prefetch("stuck", [key(0), key(1)])
    wait_for(chain, "stuck")
    assert disk.rate.samples == 1
    assert disk.rate.predict_s(2 * FMT.record_size, 2) > 10 * fast
    snapshot = chain.snapshot()["disk"]
    assert snapshot["load_samples"] == 1 and snapshot["load_timeout_s"] == disk.load_timeout_s == 1.0


# ---- the reader pool --------------------------------------------------------------------------


def wait_until(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_a_stuck_reader_is_replaced_and_when_all_are_stuck_calls_fail_at_once() -> None:
    pool = ReaderPool(workers=1, max_threads=2, stall_s=0.05)
    gate = threading.Event()
    try:
        first = pool.submit(gate.wait, WAIT_S)
        wait_until(lambda: pool.stuck == 1)
        assert pool.submit(lambda: "served").result(WAIT_S) == "served"  # a second thread took it
        second = pool.submit(gate.wait, WAIT_S)
        wait_until(lambda: pool.stuck == 2)
        with pytest.raises(ReadersStalled, match="all 2 disk reader threads are stuck"):
            pool.submit(lambda: None)
        assert pool.threads == 2  # bounded
        gate.set()
        assert first.result(WAIT_S) and second.result(WAIT_S)
        wait_until(lambda: pool.stuck == 0)
        assert pool.submit(lambda: "again").result(WAIT_S) == "again"
        wait_until(lambda: pool.threads == 1)  # the spare thread ended
    finally:
        gate.set()


def test_a_call_that_queued_behind_a_stalled_one_counts_as_stuck_from_its_submission() -> None:
    """The stall is counted from submission, as the caller's deadline is: a call that waited in
    the queue past ``stall_s`` is stuck as soon as a thread takes it, not ``stall_s`` later."""
    stall_s = 1.0
    pool = ReaderPool(workers=1, max_threads=2, stall_s=stall_s)
    gate, started = threading.Event(), threading.Event()

    def second_call() -> bool:
        started.set()
        return gate.wait(WAIT_S)

    try:
        first = pool.submit(gate.wait, WAIT_S)
        queued = pool.submit(second_call)  # the only serving thread is busy: it waits in the queue
        wait_until(lambda: pool.stuck == 1)  # the first call is past the deadline: a thread may start
        time.sleep(stall_s / 4)  # and the queued one, submitted just after it, surely is too
        spare = pool.submit(lambda: "served")  # starts the second thread, which takes the queued call first
        assert started.wait(WAIT_S)
        t_started = time.monotonic()
        stuck_now = pool.stuck
        if time.monotonic() - t_started < stall_s / 2:  # (a machine that stalled this long proves nothing)
            assert stuck_now == 2  # submitted over a second ago: stuck at once
        with pytest.raises(ReadersStalled):
            pool.submit(lambda: None)
        gate.set()
        assert first.result(WAIT_S) and queued.result(WAIT_S) and spare.result(WAIT_S) == "served"
    finally:
        gate.set()


def test_a_disk_whose_readers_are_all_stuck_is_unhealthy_and_fails_reads_at_once(tmp_path: Path) -> None:
    disk = StalledDisk(tmp_path, 16 * FMT.record_size, FMT, load_timeout_s=0.05, read_threads=1)
    for i in range(8):
        assert asyncio.run(disk.write(key(i), payload(i)))
    disk.stall = {key(i) for i in range(4)}
    try:
        for i in range(disk.readers.max_threads):  # each stuck read makes room for one more thread
            disk.readers.submit(disk._read_files, [(key(i), None)])
            stuck = i + 1
            wait_until(lambda: disk.readers.stuck == stuck)  # noqa: B023 (called before the next turn)
        assert "reader threads are stuck" in (disk.health() or "")
        t0 = time.monotonic()
        assert read(disk, 5) is None
        assert time.monotonic() - t0 < 1.0 and disk.stats.errors == 1
    finally:
        disk.gate.set()
    wait_until(lambda: disk.health() is None)
    assert bytes(read(disk, 5) or b"") == payload(5)


# ---- folders an admin may attach ------------------------------------------------------------------


@pytest.mark.parametrize(("path", "why"), [
    ("relative/kv", "must be absolute"),
    ("~/kv", "must be absolute"),
    ("", "must be absolute"),
    ("/", "root folder"),
    ("/etc", "system folder /etc"),
    ("/etc/kvgate", "system folder /etc"),
    ("/usr/local/kv", "system folder /usr"),
    ("/proc/self", "system folder /proc"),
    ("/tmp/../etc/x", "system folder /etc"),
])
def test_folders_an_admin_may_not_attach(path: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        attachable_folder(path)


def test_attachable_folders_and_the_allowed_root(tmp_path: Path) -> None:
    root = tmp_path / "allowed"
    root.mkdir()
    assert attachable_folder(str(root / "a" / "b"), str(root)) == root / "a" / "b"
    assert attachable_folder(str(root), str(root)) == root
    assert attachable_folder(str(tmp_path / "elsewhere")) == tmp_path / "elsewhere"  # no root: anywhere else
    with pytest.raises(ValueError, match="allowed_root"):
        attachable_folder(str(tmp_path / "elsewhere"), str(root))
    with pytest.raises(ValueError, match="allowed_root"):
        attachable_folder(str(tmp_path / "allowed-not"), str(root))  # a shared prefix is not inside
    (root / "out").symlink_to(tmp_path)  # a link cannot lead out of the root
    with pytest.raises(ValueError, match="allowed_root"):
        attachable_folder(str(root / "out" / "kv"), str(root))
    (tmp_path / "to-etc").symlink_to("/etc")
    with pytest.raises(ValueError, match="system folder /etc"):
        attachable_folder(str(tmp_path / "to-etc" / "kv"))
