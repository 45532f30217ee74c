"""Sampler: greedy equals argmax, seeded rows are reproducible in any batch, filters match HF."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.sampler import (
    Sampler,
    SamplingRow,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    make_generator,
)
from engine.sampling_params import SamplingParams

VOCAB = 64


def row(generator: torch.Generator | None = None, prompt: tuple[int, ...] = (), output: tuple[int, ...] = (),
        **kwargs: object) -> SamplingRow:
    return SamplingRow(SamplingParams(**kwargs), generator, list(prompt), list(output))


def logits(batch: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_fast_path_is_argmax_and_keeps_input() -> None:
    x = logits(5)
    before = x.clone()
    out = Sampler()(x, [row(temperature=0) for _ in range(5)])
    assert out.token_ids == x.argmax(dim=-1).tolist() and out.logprobs is None
    assert torch.equal(x, before)
    bf16 = x.to(torch.bfloat16)
    assert Sampler()(bf16, [row(temperature=0)] * 5).token_ids == bf16.float().argmax(dim=-1).tolist()


def test_greedy_first_max_wins_on_ties() -> None:
    x = torch.zeros(2, 8)
    x[:, [3, 5]] = 1.0
    assert Sampler()(x, [row(temperature=0), row(temperature=0, logprobs=1)]).token_ids == [3, 3]


def test_empty_batch() -> None:
    assert Sampler()(torch.empty(0, VOCAB), []).token_ids == []


def test_greedy_in_mixed_batch_is_argmax() -> None:
    x = logits(4, seed=1)
    rows = [row(temperature=0), row(temperature=0.8, seed=1), row(temperature=0, logprobs=2), row()]
    out = Sampler()(x, rows)
    assert out.token_ids[0] == int(x[0].argmax()) and out.token_ids[2] == int(x[2].argmax())


def test_seeded_rows_reproducible_alone_and_in_any_batch() -> None:
    steps = [logits(1, seed=s) for s in range(20)]
    def run(batch_kind: int) -> list[int]:
        gen = make_generator(1234, 0)
        tokens = []
        for step, x in enumerate(steps):
            mine = row(gen, temperature=0.9, top_k=40, top_p=0.95, seed=1234)
            if batch_kind == 0:
                tokens += Sampler()(x, [mine]).token_ids
                continue
            others = [row(temperature=1.3), row(make_generator(step, 0), temperature=0.5, min_p=0.1, seed=step),
                      row(temperature=0, presence_penalty=1.0, output=(1, 2)), row(logprobs=3, top_p=0.5)]
            batch = torch.cat([logits(2, seed=100 + step), x, logits(2, seed=200 + step)])
            rows = others[:2] + [mine] + others[2:]
            tokens.append(Sampler()(batch, rows).token_ids[2])
        return tokens
    alone = run(0)
    assert alone == run(0) == run(1)
    assert len(set(alone)) > 1


def test_make_generator_streams() -> None:
    assert make_generator(None, 0) is None
    draw = lambda g: torch.rand(4, generator=g).tolist()  # noqa: E731
    assert draw(make_generator(7, 0)) == draw(make_generator(7, 0))
    assert draw(make_generator(7, 0)) != draw(make_generator(7, 1))
    assert draw(make_generator(7, 1)) != draw(make_generator(8, 1))
    make_generator(2**64 - 1, 15)
    make_generator(-(2**63), 3)


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    x = logits(6, seed=3)
    argmax = x.argmax(dim=-1).tolist()
    assert Sampler()(x, [row(top_k=1, temperature=1.5) for _ in range(6)]).token_ids == argmax
    assert Sampler()(x, [row(top_p=1e-6, temperature=2.0) for _ in range(6)]).token_ids == argmax
    mixed = [row(top_k=1), row(top_p=1e-6), row(min_p=1.0), row(top_k=1, top_p=1e-6), row(top_k=1), row(top_p=1e-6)]
    assert Sampler()(x, mixed).token_ids == argmax


@pytest.mark.parametrize("top_k, top_p", [(5, None), (None, 0.7), (7, 0.8), (VOCAB, 0.3)])
def test_top_k_top_p_match_hf(top_k: int | None, top_p: float | None) -> None:
    x = logits(3, seed=4)
    expected = x
    if top_k is not None:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p is not None:
        expected = TopPLogitsWarper(top_p)(None, expected)
    k = torch.full((3,), top_k) if top_k is not None else None
    p = torch.full((3,), top_p, dtype=torch.float64) if top_p is not None else None
    assert torch.equal(apply_top_k_top_p(x.clone(), k, p), expected)


def test_per_row_top_k_in_one_batch() -> None:
    x = logits(2, seed=5)
    out = apply_top_k_top_p(x.clone(), torch.tensor([2, VOCAB]), None)
    assert torch.isfinite(out[0]).sum() == 2 and torch.equal(out[1], x[1])


def test_min_p_matches_hf_and_restricts_sampling() -> None:
    x = logits(3, seed=6)
    expected = MinPLogitsWarper(0.2)(None, x)
    assert torch.equal(apply_min_p(x.clone(), torch.full((3,), 0.2)), expected)
    probs = x[0].softmax(-1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    gen = make_generator(0, 0)
    picks = {Sampler()(x[:1], [row(gen, min_p=0.2, seed=0)]).token_ids[0] for _ in range(200)}
    assert picks <= allowed


def test_sampling_never_picks_filtered_tokens() -> None:
    x = logits(1, seed=7).expand(500, VOCAB).contiguous()
    top2 = set(x[0].topk(2).indices.tolist())
    torch.manual_seed(0)
    picks = Sampler()(x, [row(top_k=2, temperature=2.0) for _ in range(500)]).token_ids
    assert set(picks) == top2


def test_penalties_match_hand_computation() -> None:
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    r = row(prompt=(0, 1), output=(3, 3, 4, 0), repetition_penalty=2.0, presence_penalty=0.5,
            frequency_penalty=0.25)
    apply_penalties(x, [r])
    # repetition over {0, 1, 3, 4}: positive / 2, negative * 2; then -(0.25 * count + 0.5) for outputs.
    expected = [2.0 / 2 - 0.75, -1.0 * 2, 0.5, 3.0 / 2 - 1.0, -2.0 * 2 - 0.75, 1.0]
    assert x[0].tolist() == pytest.approx(expected)


def test_penalties_per_row_in_one_batch() -> None:
    x = torch.tensor([[1.0, -1.0, 2.0, 0.5]] * 3)
    rows = [row(prompt=(2,), output=(0, 0), frequency_penalty=1.0),
            row(prompt=(0, 1, 9), output=(), repetition_penalty=0.5),  # id 9 is past the vocab: ignored
            row(output=(3,))]
    apply_penalties(x, rows)
    assert x.tolist() == [[-1.0, -1.0, 2.0, 0.5], [2.0, -0.5, 2.0, 0.5], [1.0, -1.0, 2.0, 0.5]]


def test_repetition_penalty_matches_hf() -> None:
    x = logits(2, seed=8)
    ids = [[1, 5, 5, 9, 63, 0], [2, 3, 4, 30, 31, 32]]
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor(ids), x.clone())
    rows = [row(prompt=tuple(i[:3]), output=tuple(i[3:]), repetition_penalty=1.3) for i in ids]
    got = x.clone()
    apply_penalties(got, rows)
    assert torch.equal(got, expected)


def test_greedy_with_penalty_avoids_repeated_token() -> None:
    x = torch.tensor([[1.0, 0.9, 0.0]])
    assert Sampler()(x, [row(temperature=0, output=(0,), presence_penalty=0.5)]).token_ids == [1]
    assert Sampler()(x, [row(temperature=0, output=(0,), repetition_penalty=1.2)]).token_ids == [1]


def test_logprobs_from_raw_logits() -> None:
    x = logits(3, seed=9)
    rows = [row(logprobs=5, temperature=0, repetition_penalty=1.5, prompt=(0,)), row(), row(logprobs=0, seed=1)]
    rows[2].generator = make_generator(1, 0)
    out = Sampler()(x, rows)
    assert out.logprobs is not None and out.logprobs[1] is None
    raw = x.log_softmax(-1)
    for i in (0, 2):
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(float(raw[i, lp.token_id]))
    top = out.logprobs[0].top
    assert [t for t, _ in top] == raw[0].topk(5).indices.tolist()
    values = [v for _, v in top]
    assert values == sorted(values, reverse=True) and sum(math.exp(v) for v in values) <= 1.0
    assert out.logprobs[2].top == []
    full = Sampler()(x[:1], [row(logprobs=20, temperature=0)]).logprobs[0]
    assert len(full.top) == 20


def test_temperature_sampling_statistics() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    x = probs.log().unsqueeze(0)
    gen = make_generator(42, 0)
    counts = Counter(Sampler()(x, [row(gen, seed=42)]).token_ids[0] for _ in range(2000))
    for token, p in enumerate(probs.tolist()):
        assert abs(counts[token] / 2000 - p) < 0.04, counts
    torch.manual_seed(1)
    batch = x.expand(2000, 4).contiguous()
    cold = Counter(Sampler()(batch, [row(temperature=0.5)] * 2000).token_ids)
    hot = Counter(Sampler()(batch, [row(temperature=2.0)] * 2000).token_ids)
    # T=0.5 squares the probabilities (0.25 / 0.365 = 0.68); T=2 flattens them (0.38).
    assert 0.64 < cold[0] / 2000 < 0.73 and 0.32 < hot[0] / 2000 < 0.42


def test_top_p_candidate_search_matches_hf_per_row() -> None:
    vocab = 8192
    x = torch.randn(6, vocab, generator=torch.Generator().manual_seed(11))
    x[:3] *= 4  # peaked rows: nucleus of ~100 tokens, among the candidates; flat rows need the full sort
    settings = [(None, 0.9), (50, 0.95), (vocab, 0.5), (None, 0.9), (2000, 0.8), (1500, 0.99)]
    top_k = torch.tensor([k or vocab for k, _ in settings])
    top_p = torch.tensor([p for _, p in settings], dtype=torch.float64)
    got = apply_top_k_top_p(x.clone(), top_k, top_p)
    for i, (k, p) in enumerate(settings):
        expected = x[i:i + 1]
        if k is not None:
            expected = TopKLogitsWarper(k)(None, expected)
        expected = TopPLogitsWarper(p)(None, expected)
        assert torch.equal(torch.isfinite(got[i]), torch.isfinite(expected[0])), i
        assert torch.equal(got[i][torch.isfinite(got[i])], x[i][torch.isfinite(got[i])])
