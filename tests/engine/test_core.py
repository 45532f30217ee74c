"""EngineCore end to end on the tiny model: greedy output equals `model.generate`, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.model import LoadedModel, load_model
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams

MAX_NEW = 12


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> LoadedModel:
    """A separately loaded copy: the engine switches its own copy to the paged kernel."""
    return load_model(str(tiny_model_dir))


def make_engine(model_dir: Path, **overrides) -> EngineCore:
    kwargs = dict(model=str(model_dir), block_size=4, num_blocks=256, max_num_batched_tokens=64)
    kwargs.update(overrides)
    return EngineCore(EngineConfig(**kwargs))


def greedy(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run_all(engine: EngineCore, prompts: list[list[int]], params: SamplingParams | None = None,
            salt: bytes = b"") -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(f"r{i}", ids, params or greedy(), namespace_salt=salt))
        outs[f"r{i}"] = []
    steps = 0
    while engine.has_work():
        for out in engine.step():
            outs[out.request_id].append(out.token_id)
        steps += 1
        assert steps < 10_000, "engine made no progress"
    engine.manager.check_invariants()
    assert engine.manager.num_blocks_in_use == 0
    return outs


_HF_CACHE: dict[tuple, list[int]] = {}


def hf_greedy(ref: LoadedModel, ids: list[int], n: int = MAX_NEW) -> list[int]:
    """`model.generate(do_sample=False)` continuation (memoised: several tests share prompts)."""
    key = (tuple(ids), n)
    if key not in _HF_CACHE:
        with torch.no_grad():
            out = ref.model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        _HF_CACHE[key] = out[0, len(ids):].tolist()
    return _HF_CACHE[key]


def varied_prompts(tok) -> list[list[int]]:
    system = "You are a careful assistant. Answer briefly and cite the rules you follow. " * 2
    texts = [system + f"Question {i}: what is {i} plus {i * 3}?" for i in range(6)]
    texts += ["short", "a", "The quick brown fox jumps over the lazy dog " * 4]
    texts += [texts[2], texts[7]]  # exact repeats
    texts += [texts[8] + " and then it ran far away into the forest", texts[0] + " Also explain why."]
    texts += ["Numbers: " + " ".join(str(k) for k in range(40)), "héllo wörld 你好", "x y z " * 9]
    assert len(texts) == 16
    return [tok(t).input_ids for t in texts]


@pytest.mark.parametrize("caching", [True, False])
def test_greedy_matches_generate_batched(tiny_model_dir, reference, caching):
    engine = make_engine(tiny_model_dir, enable_prefix_caching=caching)
    prompts = varied_prompts(reference.tokenizer)
    outs = run_all(engine, prompts)
    for i, ids in enumerate(prompts):
        assert outs[f"r{i}"] == hf_greedy(reference, ids), f"prompt {i} diverged"
    stats = engine.stats()
    if caching:
        assert stats["cached_prompt_tokens"] > 0
        assert stats["computed_tokens"] < stats["prompt_tokens"] + stats["generated_tokens"]
    else:
        assert stats["cached_prompt_tokens"] == 0


def test_greedy_matches_generate_under_preemption(tiny_model_dir, reference):
    # 32 blocks of 4 tokens cannot hold 16 requests at once: the scheduler must preempt.
    engine = make_engine(tiny_model_dir, num_blocks=32, max_num_batched_tokens=32)
    prompts = varied_prompts(reference.tokenizer)
    outs = run_all(engine, prompts)
    assert engine.scheduler.num_preemptions > 0
    for i, ids in enumerate(prompts):
        assert outs[f"r{i}"] == hf_greedy(reference, ids), f"prompt {i} diverged under preemption"


def test_long_shared_prefix_is_reused(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir, block_size=16, num_blocks=400, max_num_batched_tokens=512)
    tok = reference.tokenizer
    doc = tok(" ".join(f"word{i % 97} item{i}" for i in range(700))).input_ids[:1040]
    first = doc + tok(" First question?").input_ids
    second = doc + tok(" A different second question!").input_ids
    run_all(engine, [first], greedy(4))
    before = engine.counters.computed_tokens
    seqs = engine.add_request(GenerateRequest("second", second, greedy(4)))
    outs = []
    while engine.has_work():
        outs += [o for o in engine.step() if o.request_id == "second"]
    cached = seqs[0].num_cached_tokens
    assert cached >= 1024 and cached == (1040 // 16) * 16
    assert outs[0].num_cached_tokens == cached
    assert engine.counters.computed_tokens - before == len(second) - cached + 3
    assert [o.token_id for o in outs] == hf_greedy(reference, second, 4)


def test_salts_isolate_cache(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir)
    ids = reference.tokenizer("a shared prompt with several blocks of text in it").input_ids
    run_all(engine, [ids], salt=b"tenant-a")
    seqs = engine.add_request(GenerateRequest("b", ids, greedy(2), namespace_salt=b"tenant-b"))
    seqs_salted = engine.add_request(GenerateRequest("c", ids, greedy(2), namespace_salt=b"tenant-a",
                                                     cache_salt="other"))
    seqs_same = engine.add_request(GenerateRequest("d", ids, greedy(2), namespace_salt=b"tenant-a"))
    while engine.has_work():
        engine.step()
    assert seqs[0].num_cached_tokens == 0
    assert seqs_salted[0].num_cached_tokens == 0
    assert seqs_same[0].num_cached_tokens > 0


def test_n_siblings_share_prompt_blocks(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir)
    ids = reference.tokenizer("siblings share this prompt, which spans a few blocks").input_ids
    seqs = engine.add_request(GenerateRequest("n", ids, SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=7)))
    engine.step()  # one prefill step schedules all three
    tables = [engine.manager.block_ids(s.seq_id) for s in seqs]
    full = (len(ids) - 1) // 4  # the last token is always computed
    assert tables[0][:full] == tables[1][:full] == tables[2][:full]
    assert seqs[1].num_cached_tokens == seqs[2].num_cached_tokens == full * 4
    while engine.has_work():
        engine.step()
    assert engine.manager.num_blocks_in_use == 0
    outs = [s.output_token_ids for s in seqs]
    assert len({tuple(o) for o in outs}) > 1, "seeded siblings must sample different streams"


def test_seeded_sampling_is_reproducible(tiny_model_dir, reference):
    ids = reference.tokenizer("sample me").input_ids
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    a = run_all(make_engine(tiny_model_dir), [ids], params)["r0"]
    engine = make_engine(tiny_model_dir)
    other = reference.tokenizer("some other request in the same batch").input_ids
    b = run_all(engine, [ids, other], params)["r0"]
    assert a == b


def test_chunked_prefill_respects_budget(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=16)
    ids = reference.tokenizer("a long prompt " * 20).input_ids
    assert len(ids) > 40
    engine.add_request(GenerateRequest("long", ids, greedy(3)))
    outs = []
    while engine.has_work():
        plan_tokens = engine.counters.computed_tokens
        outs += engine.step()
        assert engine.counters.computed_tokens - plan_tokens <= 16
    assert [o.token_id for o in outs] == hf_greedy(reference, ids, 3)


def test_abort_frees_blocks_at_once(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir)
    ids = reference.tokenizer("abort me soon please").input_ids
    engine.add_request(GenerateRequest("x", ids, greedy(50)))
    engine.step()
    engine.step()
    assert engine.manager.num_blocks_in_use > 0
    assert engine.abort_request("x")
    assert engine.manager.num_blocks_in_use == 0
    assert not engine.has_work()
    assert not engine.abort_request("x")
    engine.manager.check_invariants()


def test_stop_token_and_eos(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir)
    ids = reference.tokenizer("stop early").input_ids
    expected = hf_greedy(reference, ids, 5)
    outs = run_all(engine, [ids], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                  stop_token_ids=[expected[2]]))
    assert outs["r0"] == expected[: expected.index(expected[2]) + 1]


@pytest.mark.parametrize(
    "prompt, params, error, param",
    [
        ([], greedy(), InvalidRequestError, "prompt"),
        ([1, 2, 10**9], greedy(), InvalidRequestError, "prompt"),
        ([-1], greedy(), InvalidRequestError, "prompt"),
        ([1] * 5000, greedy(), PromptTooLongError, "prompt"),
        ([1] * 100, greedy(4090), PromptTooLongError, "max_tokens"),
    ],
)
def test_bad_input_is_rejected_before_allocation(tiny_model_dir, prompt, params, error, param):
    engine = make_engine(tiny_model_dir)
    with pytest.raises(error) as info:
        engine.add_request(GenerateRequest("bad", prompt, params))
    assert info.value.param == param
    assert engine.manager.num_blocks_in_use == 0 and not engine.has_work()
    if error is PromptTooLongError:
        assert str(engine.max_model_len) in info.value.message


def test_bad_sampling_values_are_typed_errors():
    for kwargs in ({"max_tokens": 0}, {"max_tokens": -3}, {"temperature": -1}, {"top_p": 0},
                   {"top_k": -5}, {"n": 0}, {"logprobs": 50}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**kwargs)


def test_request_larger_than_pool_is_rejected(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=4)
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        engine.add_request(GenerateRequest("big", [1] * 10, greedy(20)))
