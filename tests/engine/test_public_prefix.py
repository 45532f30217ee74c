"""Public prefixes in the engine: every tenant hits the public prefix's blocks, and no tenant ever
hits another's blocks after it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.core import EngineCore
from engine.errors import InvalidRequestError
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from tests.engine.test_tenant_tiers import make_engine, prompt

BLOCK = 16
PUBLIC = prompt(50, 5 * BLOCK + 7)  # 5 full blocks and a partial one
PUBLIC_SALT = b"the-public-namespace-salt"


def cached(core: EngineCore, rid: str, ids: list[int], salt: bytes, public_len: int,
           cache_salt: str | None = None) -> int:
    core.add_request(GenerateRequest(rid, ids, SamplingParams(max_tokens=1, temperature=0), namespace_salt=salt,
                                     cache_salt=cache_salt, public_prefix_len=public_len, public_salt=PUBLIC_SALT))
    first = -1
    while core.has_work():
        for out in core.step():
            first = out.num_cached_tokens if first < 0 else first
    return first


def test_tenants_share_the_public_prefix_and_nothing_after_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    core = make_engine(tiny_model_dir, tmp_path, "kv")
    try:
        a_prompt = PUBLIC + prompt(51, 100)
        b_prompt = PUBLIC + prompt(52, 100)
        n = len(PUBLIC)
        assert cached(core, "a1", a_prompt, b"salt-a", n) == 0
        assert cached(core, "b1", b_prompt, b"salt-b", n) == 5 * BLOCK  # the public blocks, prefilled once
        assert cached(core, "b2", a_prompt, b"salt-b", n) == 5 * BLOCK  # never A's continuation blocks
        assert cached(core, "a2", a_prompt, b"salt-a", n) == (len(a_prompt) // BLOCK) * BLOCK  # A's own: all
        assert cached(core, "c1", PUBLIC + prompt(53, 40), b"salt-c", n, cache_salt="isolated") == 0
        assert cached(core, "c2", a_prompt, b"salt-c", 0) == 0  # not marked public: the tenant's namespace
        core.manager.check_invariants()
    finally:
        core.close()


@pytest.mark.parametrize("bad", [-1, 10_000, True])
def test_a_public_length_beyond_the_prompt_is_refused(tiny_model_dir: Path, tmp_path: Path, bad) -> None:
    core = make_engine(tiny_model_dir, tmp_path, "kv")
    try:
        with pytest.raises(InvalidRequestError) as info:
            cached(core, "x", PUBLIC, b"s", bad)
        assert info.value.param == "public_prefix_len"
    finally:
        core.close()
