"""How blocks come up: promotion from the memory tier (a copy, or a row traded on CPU), blocks
recalled from writes still in flight, and `poll`, which moves what a prefetch read (prefetch.py)
into memory and releases the requests waiting for it. All on the step loop."""

from __future__ import annotations

import queue
import time
from collections.abc import Hashable, Iterable

import numpy
import torch

from cache.quota import UNKNOWN
from cache.tiers.prefetch import PrefetchPath


def _copy_into(dst: torch.Tensor, payload: bytes | memoryview) -> None:
    """Copy a block's bytes into ``dst`` (flat uint8, on any device)."""
    view = memoryview(payload).cast("B")
    if not view.readonly:
        dst.copy_(torch.frombuffer(view, dtype=torch.uint8))
    elif dst.device.type == "cpu":  # torch wants a writable buffer; numpy copies from a read-only one
        dst.numpy()[:] = numpy.frombuffer(view, dtype=numpy.uint8)
    else:
        dst.copy_(torch.frombuffer(bytearray(view), dtype=torch.uint8))


class LoadPath(PrefetchPath):
    """The load half of `TierChain`: `PrefetchPath` starts loads, this half finishes them."""

    def load(self, key: bytes, dst: torch.Tensor) -> bool:
        """Copy a host-resident (or just prefetched) block into ``dst``; False if neither has it."""
        staged = self._staged.pop(key, None)
        if staged is not None:
            _copy_into(dst, staged)  # (a Redis reply is writable: no extra copy)
            self.stats.promotions += 1
            return True
        if self.memory is not None and self.memory.load_into(key, dst):
            self.stats.promotions += 1
            return True
        writing = self._writing.get(key)
        if writing is not None:  # its disk write is still in flight: copy from the write's buffer
            _copy_into(dst, writing)
            self.stats.promotions += 1
            self.stats.recalled_blocks += 1
            return True
        return False

    def take(self, key: bytes, row: int) -> int | None:
        """Promote a host block without a copy (a host tier sharing the pool's slab): returns the
        row that holds it, which the pool block uses from now on (its old ``row`` goes to the
        host); None if the host has no such block (then `load` copies a staged one, if any)."""
        host = self.memory
        if host is None or not host.shared or key not in host:
            return None
        held = host.surrender(key, row)
        self.stats.promotions += 1
        return held

    def recall(self, keys: Iterable[bytes], owner: str = UNKNOWN) -> int:
        """Bring the leading ``keys`` whose disk writes are still in flight back into host memory
        (or staging), copied from the write's buffer, so the request that wants them finds them
        there when it is admitted, whenever the write ends. Stops at the first key no tier can
        supply; returns how many blocks came back."""
        recalled = 0
        for key in keys:
            payload = self._writing.get(key)  # (before the disk: the I/O thread indexes, then forgets)
            if payload is None:
                if self.on_lower_tier(key) or key in self._inflight or self._stored(key):
                    continue
                break
            if self.memory is None:
                self._staged[key] = payload
            else:
                for victim, evicted, victim_owner in self.memory.put_bytes(key, payload, owner):
                    self._write(victim, evicted, victim_owner)
            recalled += 1
        self.stats.recalled_blocks += recalled
        return recalled

    def poll(self) -> list[Hashable]:
        """Move finished loads into host memory; return the tokens whose loads are all done."""
        if not self._jobs and self._events.empty():
            return []
        ready: list[Hashable] = []
        now = time.monotonic()
        while True:
            try:
                kind, item, payload = self._events.get_nowait()
            except queue.Empty:
                break
            if kind == "done":
                for key in self._job_keys.pop(item, ()):
                    self._owners.pop(key, None)
                if item in self._jobs:
                    self._jobs.discard(item)
                    ready.append(item)
                    waited = now - self._job_started.pop(item, now)
                    self.stats.prefetch_wait_s += waited
                    payload.issue_to_done_s = waited
                    self.ops["prefetch"].observe(waited, payload.io_s)
                    self.finished_jobs[item] = payload
                    if len(self.finished_jobs) > 4096:  # nobody takes them (a chain used on its own)
                        del self.finished_jobs[next(iter(self.finished_jobs))]
                continue
            key = item
            payload, reserved = payload  # the slot this read went into, if it had one
            self._inflight.discard(key)
            if payload is None:
                if reserved is not None:
                    reserved.host.release(reserved.slot)
                continue
            self.stats.prefetched_blocks += 1
            if reserved is not None:
                host = reserved.host
                for victim, evicted, victim_owner in host.commit(key, reserved.slot, self._owners.get(key, UNKNOWN),
                                                                 payload):
                    if host is self.memory:  # (a host detached meanwhile takes its blocks with it)
                        self._write(victim, evicted, victim_owner)
                if host is self.memory:
                    self._track(key)  # (from the remote tier; one read from disk is skipped later)
            elif self.memory is not None:
                for victim, evicted, victim_owner in self.memory.put_bytes(key, payload, self._owners.get(key, UNKNOWN)):
                    self._write(victim, evicted, victim_owner)
                self._track(key)
            else:
                self._staged[key] = payload
        return ready

    @property
    def loading(self) -> bool:
        return bool(self._jobs)

    def cancel(self, token: Hashable) -> None:
        self._jobs.discard(token)
        self._job_started.pop(token, None)
        self.finished_jobs.pop(token, None)
