"""`split_by_tier`: a request's cached prompt tokens, by the tier that served each part."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.tiering import split_by_tier


def test_a_prefix_splits_in_prefix_order() -> None:
    # 10 blocks cached: 4 on the device, then 6 brought up: 1 from host, 3 read from disk, 2 from Redis
    split = split_by_tier(160, 16, 6, [("disk", 3), ("remote", 2)], "host")
    assert split == {"device": 64, "host": 16, "disk": 48, "remote": 32}


def test_blocks_read_past_the_prefix_come_off_the_deepest_tier() -> None:
    # the prefetch read 5 blocks, but only 3 of those were part of the prefix that was reused
    assert split_by_tier(64, 16, 3, [("disk", 2), ("remote", 3)], "host") == {"device": 16, "remote": 48}
    assert split_by_tier(64, 16, 4, [("disk", 2), ("remote", 1)], "host") == \
        {"host": 16, "disk": 32, "remote": 16}


def test_a_capped_prefix_ends_in_its_deepest_tier() -> None:
    # a whole prompt of 40 tokens cached keeps its last token to compute: 39 served, 3 blocks touched
    assert split_by_tier(39, 16, 1, [("disk", 1)], "host") == {"device": 32, "disk": 7}


def test_nothing_cached_is_an_empty_split() -> None:
    assert split_by_tier(0, 16, 4, [("disk", 4)], "host") == {}


@given(cached=st.integers(0, 4096), lower=st.integers(0, 300),
       fetched=st.lists(st.tuples(st.sampled_from(["disk", "disk2", "remote"]), st.integers(0, 100)), max_size=3),
       memory=st.sampled_from(["host", None]))
def test_the_split_adds_up_to_the_cached_tokens(cached: int, lower: int, fetched: list[tuple[str, int]],
                                               memory: str | None) -> None:
    split = split_by_tier(cached, 16, lower, fetched, memory)
    assert sum(split.values()) == cached
    assert all(tokens > 0 for tokens in split.values())
    blocks = -(-cached // 16)
    assert split.get("device", 0) >= (blocks - min(lower, blocks)) * 16 - (blocks * 16 - cached)
