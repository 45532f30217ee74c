"""TenantQueues: the scheduler's waiting sequences, one FIFO per tenant, served round-robin.

Round-robin by sequence (not by tokens) is the first of the scheduler's fairness rules; see
`engine.scheduler` for why and for the rules built on top of it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from engine.sequence import Sequence


class TenantQueues:
    """The waiting sequences: one FIFO per tenant, the tenants in round-robin order.

    Only tenants with waiting sequences are in the ring. A tenant joins at its end and goes back
    to its end each time one of its sequences is admitted, so turns alternate between tenants.
    Iteration and ``len`` cover every waiting sequence, so it reads like one FIFO deque.
    """

    def __init__(self) -> None:
        self._queues: dict[str, deque[Sequence]] = {}  # insertion order is the ring order
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Sequence]:
        for queue in self._queues.values():
            yield from queue

    def tenants(self) -> list[str]:
        """Tenants with waiting sequences, next turn first."""
        return list(self._queues)

    def count(self, tenant: str) -> int:
        queue = self._queues.get(tenant)
        return len(queue) if queue is not None else 0

    def head(self, tenant: str) -> Sequence:
        return self._queues[tenant][0]

    def append(self, seq: Sequence) -> None:
        self._queues.setdefault(seq.tenant, deque()).append(seq)
        self._len += 1

    def appendleft(self, seq: Sequence) -> None:
        """Put a sequence first in its tenant's queue (a preempted one resumes first)."""
        self._queues.setdefault(seq.tenant, deque()).appendleft(seq)
        self._len += 1

    def remove(self, seq: Sequence) -> None:
        queue = self._queues.get(seq.tenant)
        if queue is None:
            raise ValueError(f"{seq.seq_id} is not waiting")
        queue.remove(seq)
        self._len -= 1
        if not queue:
            del self._queues[seq.tenant]

    def next(self, skip: set[str]) -> Sequence | None:
        """The sequence whose turn it is, passing over the tenants in ``skip``."""
        for tenant, queue in self._queues.items():
            if tenant not in skip:
                return queue[0]
        return None

    def pop_head(self, tenant: str) -> Sequence:
        """Admit a tenant's first sequence; the tenant's next turn comes after everyone else's."""
        queue = self._queues.pop(tenant)
        seq = queue.popleft()
        self._len -= 1
        if queue:
            self._queues[tenant] = queue
        return seq
