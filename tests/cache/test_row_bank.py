"""RowBank: rows of the device pool's tensor lent to host tiers that share it. Whatever the order
of attaches and detaches (with reads still filling some rows), every row has exactly one owner:
the bank's spare list, its orphans, or the one attached tier."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from cache.tiers.factory import RowBank
from cache.tiers.host import HostTier

NB = 64
ROWS = 24


@given(st.lists(st.tuples(st.sampled_from(["attach", "detach"]), st.integers(1, ROWS), st.integers(0, 4)),
                max_size=30))
def test_every_row_has_exactly_one_owner(ops: list[tuple[str, int, int]]) -> None:
    slab = torch.zeros((ROWS, NB), dtype=torch.uint8)
    bank = RowBank(slab, list(range(ROWS)))
    tier: HostTier | None = None
    for action, rows, busy in ops:
        if action == "attach" and tier is None:
            taken = bank.take(rows)
            if taken is None:
                assert rows > len(bank.spare)  # refused only when the bank is short, and took nothing
                continue
            tier = HostTier(rows * NB, NB, slab=slab, rows=taken)
            for _ in range(min(busy, rows)):  # reads in flight fill some of its rows
                assert tier.reserve() is not None
        elif action == "detach" and tier is not None:
            bank.give_back(tier.rows() - tier.reserved_rows(), tier.reserved_rows())
            tier = None
        owners = bank.owners() + (sorted(tier.rows()) if tier is not None else [])
        assert sorted(owners) == list(range(ROWS)), "a row has no owner or two"


def test_a_bank_without_a_slab_lends_nothing() -> None:
    assert RowBank(None, [0, 1, 2]).take(1) is None
