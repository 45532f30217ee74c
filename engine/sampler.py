"""Batched token sampling: penalties, temperature, top-k/top-p/min-p, then one draw per row.

Rows that share the work are processed as one tensor; per-row Python is limited to penalties and
to drawing one uniform number from a seeded row's own generator, so a seeded row's tokens do not
depend on which other rows share its batch.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15  # odd, so seed + i * _GOLDEN differs for every choice index i
_MASK64 = 2**64 - 1
_NUCLEUS_CANDIDATES = 1024  # top-p looks for its nucleus among this many tokens before sorting all


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one sequence that samples a token this step."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_ids: tuple[int, ...] = ()  # masked while the choice is shorter than params.min_tokens

    @property
    def must_continue(self) -> bool:
        return len(self.output_token_ids) < self.params.min_tokens and bool(self.stop_ids)


@dataclass(slots=True)
class SamplerOutput:
    """One sampled token per row and, when any row asked for them, per-row logprobs (None otherwise)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None = None


def make_generator(seed: int | None, index: int) -> torch.Generator | None:
    """A CPU generator for choice `index` of a seeded request; None (global RNG) when unseeded."""
    if seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed((seed + index * _GOLDEN) & _MASK64)
    return generator


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Apply repetition (HF semantics, prompt + output ids) then frequency/presence penalties, in place.

    All rows are handled by a few batched ops over flat `row * V + token` keys.
    """
    assert logits.is_contiguous()
    flat, vocab = logits.view(-1), logits.shape[1]
    rep = [(i, ids) for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0
           for ids in (row.prompt_token_ids, row.output_token_ids)]
    if rep:
        # Repeated keys write the same value twice, as in HF's gather/scatter: no need to dedupe.
        keys = _flat_keys(rep, vocab, logits.device)
        penalty = torch.tensor([row.params.repetition_penalty for row in rows], device=logits.device)
        scores, factor = flat[keys], penalty[keys // vocab]
        flat[keys] = torch.where(scores < 0, scores * factor, scores / factor)
    freq = [(i, row.output_token_ids) for i, row in enumerate(rows)
            if (row.params.frequency_penalty or row.params.presence_penalty) and row.output_token_ids]
    if freq:
        keys, counts = _flat_keys(freq, vocab, logits.device).unique(return_counts=True)
        frequency = torch.tensor([row.params.frequency_penalty for row in rows], device=logits.device)
        presence = torch.tensor([row.params.presence_penalty for row in rows], device=logits.device)
        owner = keys // vocab
        flat[keys] -= counts.to(logits.dtype) * frequency[owner] + presence[owner]


def _flat_keys(seqs: list[tuple[int, list[int]]], vocab: int, device: torch.device) -> torch.Tensor:
    """Keys `row * vocab + token` for every token of every (row, tokens); ids >= vocab are dropped like HF."""
    # array('q') -> frombuffer is several times faster than torch.tensor() on a list of Python ints.
    flat = array("q", chain.from_iterable(tokens for _, tokens in seqs))
    if not flat:
        return torch.empty(0, dtype=torch.long, device=device)
    ids = torch.frombuffer(flat, dtype=torch.long).to(device)
    owner = torch.repeat_interleave(torch.tensor([i for i, _ in seqs], device=device),
                                    torch.tensor([len(tokens) for _, tokens in seqs], device=device))
    in_vocab = ids < vocab
    return (owner * vocab + ids)[in_vocab]


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p (HF semantics); `top_k` row = V is a no-op.

    Top-k alone uses a partial `topk`. Top-p first looks for the nucleus among the top
    `_NUCLEUS_CANDIDATES` tokens and fully sorts only the rows whose nucleus is larger.
    """
    if top_p is None:
        assert top_k is not None
        kth = logits.topk(int(top_k.max()), dim=-1).values.gather(1, (top_k - 1).unsqueeze(1))
        return logits.masked_fill_(logits < kth, float("-inf"))
    if logits.shape[1] < 4 * _NUCLEUS_CANDIDATES:
        return _sorted_top_k_top_p(logits, top_k, top_p)
    done = _candidate_top_k_top_p(logits, top_k, top_p)
    if not bool(done.all()):
        rest = (~done).nonzero().squeeze(1)
        logits[rest] = _sorted_top_k_top_p(logits[rest], None if top_k is None else top_k[rest], top_p[rest])
    return logits


def _sorted_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """Both filters over one full ascending sort, exactly as HF's TopK then TopP warpers."""
    values, order = logits.sort(dim=-1)
    if top_k is not None:
        kth = values.gather(1, (values.shape[1] - top_k).unsqueeze(1))
        values.masked_fill_(values < kth, float("-inf"))
    cum = values.softmax(dim=-1).cumsum_(dim=-1)
    remove = cum <= (1.0 - top_p).to(cum.dtype).unsqueeze(1)
    remove[:, -1] = False
    values.masked_fill_(remove, float("-inf"))
    return logits.scatter_(1, order, values)


def _candidate_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """Filter in place the rows whose kept tokens all lie among the top candidates; return those rows' mask.

    A token is dropped when the probability mass ranked above it already reaches top_p, which is
    HF's rule (tail mass including the token <= 1 - top_p) read from the other end.
    """
    values, index = logits.topk(_NUCLEUS_CANDIDATES, dim=-1)
    norm = logits.logsumexp(dim=-1, keepdim=True)
    k_inside = torch.zeros(logits.shape[0], 1, dtype=torch.bool, device=logits.device)
    k_ok = ~k_inside  # top-k between the candidates and V renormalises over tokens we have not ranked
    if top_k is not None:
        k_inside = (top_k <= _NUCLEUS_CANDIDATES).unsqueeze(1)
        k_ok = k_inside | (top_k >= logits.shape[1]).unsqueeze(1)
        kth = values.gather(1, (top_k.clamp(max=_NUCLEUS_CANDIDATES) - 1).unsqueeze(1))
        values.masked_fill_((values < kth) & k_inside, float("-inf"))
        norm = torch.where(k_inside, values.logsumexp(dim=-1, keepdim=True), norm)
    probs = (values - norm).exp_()
    cum = probs.cumsum(dim=-1)
    p = top_p.to(cum.dtype).unsqueeze(1)
    values.masked_fill_(((cum - probs) >= p) & (p < 1.0), float("-inf"))
    done = (((cum[:, -1:] >= p) & (p < 1.0)) | ((p >= 1.0) & k_inside)) & k_ok
    rows = done.squeeze(1).nonzero().squeeze(1)
    filtered = torch.full((rows.numel(), logits.shape[1]), float("-inf"), device=logits.device)
    logits[rows] = filtered.scatter_(1, index[rows], values[rows])
    return done.squeeze(1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below `min_p` times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, float("-inf"))


class Sampler:
    """Picks one token per row from `logits[B, V]` (rows in the same order as `rows`).

    Order: penalties -> temperature -> top-k -> top-p -> min-p -> draw. Greedy rows take the argmax
    of the penalised logits; other rows use inverse-CDF sampling with one uniform per row, drawn
    from the row's generator (or the global RNG when it has none). Logprobs come from the raw logits.
    """

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(rows), "one logits row per sampling row"
        params = [row.params for row in rows]
        masked = [i for i, p in enumerate(params) if p.min_tokens and rows[i].must_continue]
        if not masked and all(p.greedy and p.logprobs is None and not p.has_penalties for p in params):
            # float32 first: the same values and ties, and PyTorch's float32 argmax runs several
            # times faster than its bfloat16 one on CPU
            return SamplerOutput(logits.float().argmax(dim=-1).tolist())
        x = logits.to(torch.float32, copy=True)
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = None
        if lp_rows:
            raw_logprobs = (x if len(lp_rows) == len(rows) else x[lp_rows]).log_softmax(dim=-1)
        vocab = x.shape[-1]
        if masked:  # min_tokens: the stop tokens cannot be drawn yet (one index_put for all rows)
            cells = [(i, t) for i in masked for t in rows[i].stop_ids if t < vocab]
            if cells:
                at = torch.tensor(cells, dtype=torch.long, device=x.device)
                x[at[:, 0], at[:, 1]] = float("-inf")
        if any(p.has_penalties for p in params):
            apply_penalties(x, rows)
        tokens = self._choose(x, params, rows)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = self._logprobs(raw_logprobs, lp_rows, params, tokens, len(rows))
        return SamplerOutput(tokens.tolist(), logprobs)

    def _choose(
        self, x: torch.Tensor, params: list[SamplingParams], rows: Sequence[SamplingRow]
    ) -> torch.Tensor:
        """Token ids [B]: argmax for greedy rows, a filtered random draw for the others."""
        sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not sample_rows:
            return x.argmax(dim=-1)
        generators = [rows[i].generator for i in sample_rows]
        if len(sample_rows) == len(params):
            return self._sample(x, params, generators)
        tokens = x.argmax(dim=-1)
        index = torch.tensor(sample_rows, device=x.device)
        tokens[index] = self._sample(x[index], [params[i] for i in sample_rows], generators)
        return tokens

    def _sample(self, x: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> torch.Tensor:
        """Filter and draw for rows that all sample (temperature > 0); `x` may be changed in place."""
        device, vocab = x.device, x.shape[1]
        if any(p.temperature != 1.0 for p in params):
            x.div_(torch.tensor([p.temperature for p in params], device=device).unsqueeze(1))
        self._filter(x, params, vocab)
        probs = x.softmax(dim=-1)
        cum = probs.cumsum_(dim=-1)
        total = cum[:, -1:]
        u = self._uniforms(generators).to(device).unsqueeze(1)
        # Strictly below the total, so the draw never lands past the last token with mass.
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cum, target, right=True).squeeze(1).clamp_(max=vocab - 1)

    @staticmethod
    def _filter(x: torch.Tensor, params: list[SamplingParams], vocab: int) -> None:
        """Apply top-k/top-p to the rows that use them, then min-p, in place on `x`."""
        kp_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
        if kp_rows:
            kp = [params[i] for i in kp_rows]
            use_k = any(0 < p.top_k < vocab for p in kp)
            use_p = any(p.top_p < 1.0 for p in kp)
            top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in kp],
                                 device=x.device) if use_k else None
            top_p = torch.tensor([p.top_p for p in kp], dtype=torch.float64,
                                 device=x.device) if use_p else None
            _apply_to_rows(x, kp_rows, lambda part: apply_top_k_top_p(part, top_k, top_p))
        mp_rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
        if mp_rows:
            min_p = torch.tensor([params[i].min_p for i in mp_rows], device=x.device)
            _apply_to_rows(x, mp_rows, lambda part: apply_min_p(part, min_p))

    @staticmethod
    def _uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
        """One U[0, 1) per row: seeded rows from their own generator, the rest from the global RNG."""
        unseeded = [j for j, g in enumerate(generators) if g is None]
        u = torch.empty(len(generators))
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded))
        for j, g in enumerate(generators):
            if g is not None:
                u[j] = torch.rand((), generator=g)
        return u

    @staticmethod
    def _logprobs(raw: torch.Tensor, lp_rows: list[int], params: list[SamplingParams],
                  tokens: torch.Tensor, batch: int) -> list[TokenLogprob | None]:
        """Chosen-token logprob and the top-N alternatives (descending) for the rows that asked."""
        chosen_ids = tokens[lp_rows] if len(lp_rows) != batch else tokens
        chosen = raw.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
        chosen_list = chosen_ids.tolist()
        top_n = min(max(params[i].logprobs or 0 for i in lp_rows), raw.shape[1])
        top_vals: list[list[float]] = [[] for _ in lp_rows]
        top_ids: list[list[int]] = [[] for _ in lp_rows]
        if top_n:
            best = raw.topk(top_n, dim=-1)
            top_vals, top_ids = best.values.tolist(), best.indices.tolist()
        result: list[TokenLogprob | None] = [None] * batch
        for j, i in enumerate(lp_rows):
            n = params[i].logprobs or 0
            top = list(zip(top_ids[j][:n], top_vals[j][:n], strict=True))
            result[i] = TokenLogprob(chosen_list[j], chosen[j], top)
        return result


def _apply_to_rows(x: torch.Tensor, row_ids: list[int], fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Run the in-place row filter `fn` on the listed rows of `x` (all rows without copying)."""
    if len(row_ids) == x.shape[0]:
        fn(x)
        return
    index = torch.tensor(row_ids, device=x.device)
    x[index] = fn(x[index])
