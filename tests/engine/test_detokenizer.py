"""IncrementalDetokenizer: streamed deltas equal a full decode; stop strings cut the text exactly."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import IncrementalDetokenizer

CORPUS = [
    "héllo wörld 你好 🙂", "hello world, hello there", "the quick brown fox jumps over the lazy dog",
    "naïve café déjà vu", "你好世界，你好吗？", "🙂🙃 emoji 🎉 party", "stop STOP end. END of text",
    "Ünïcödé ßtraße ñandú", "numbers 1234 5678 and symbols #$%&",
]


def _byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 5, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _metaspace() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS * 5, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<eos>"], show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


BYTE_LEVEL = _byte_level()
METASPACE = _metaspace()
TOKENIZERS = {"byte_level": BYTE_LEVEL, "metaspace": METASPACE}


def stream(tokenizer, ids: list[int], stop: tuple[str, ...] | list[str] = (),
           chunk: int = 1) -> tuple[list[str], IncrementalDetokenizer]:
    det = IncrementalDetokenizer(tokenizer, [1, 2, 3], list(stop))
    deltas = [det.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    if not det.stopped:
        deltas.append(det.finish())
    return deltas, det


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("text", CORPUS + ["  leading spaces", "tail 🙂", "你", "crab 🦀 and ∑"])
def test_natural_text_streams_exactly_without_replacement_chars(name: str, text: str) -> None:
    tokenizer = TOKENIZERS[name]
    ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    deltas, det = stream(tokenizer, ids)
    assert "".join(deltas) == det.text == expected
    if "\ufffd" not in expected:
        assert all("\ufffd" not in d for d in deltas)


def test_multibyte_character_split_across_tokens_is_held_back() -> None:
    ids = BYTE_LEVEL.encode("🦀")  # not in the corpus: four single-byte tokens
    assert len(ids) > 1 and "\ufffd" in BYTE_LEVEL.decode(ids[:1])
    det = IncrementalDetokenizer(BYTE_LEVEL, [], [])
    assert [det.add([i]) for i in ids] == [""] * (len(ids) - 1) + ["🦀"]


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_ids_stream_to_full_decode(name: str, data: st.DataObject) -> None:
    tokenizer = TOKENIZERS[name]
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=40))
    chunk = data.draw(st.integers(1, 4))
    det = IncrementalDetokenizer(tokenizer, [], [])
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    for i in range(0, len(ids), chunk):
        det.add(ids[i:i + chunk])
        assert expected.startswith(det.text)  # released text is final
    det.finish()
    assert det.text == expected and not det.stopped


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="ab lo你🙂", max_size=30),
    stop=st.lists(st.text(alphabet="ab lo你🙂", min_size=1, max_size=3), max_size=3),
    chunk=st.integers(1, 3),
)
def test_stop_strings_cut_before_the_first_match(text: str, stop: list[str], chunk: int) -> None:
    ids = BYTE_LEVEL.encode(text)
    full = BYTE_LEVEL.decode(ids, skip_special_tokens=True)
    # the stop string that completes first wins (then the earlier start), whatever the chunking
    hits = [(i + len(s), i) for s in stop if (i := full.find(s)) >= 0]
    deltas, det = stream(BYTE_LEVEL, ids, stop, chunk)
    assert "".join(deltas) == det.text == (full[:min(hits)[1]] if hits else full)
    assert det.stopped == bool(hits)
    assert not any(s in det.text for s in stop)


def test_stop_across_token_boundary() -> None:
    ids = BYTE_LEVEL.encode("hello world, bye")
    assert not any("lo wo" in BYTE_LEVEL.decode([i]) for i in ids)
    deltas, det = stream(BYTE_LEVEL, ids, ["lo wo"])
    assert det.stopped and det.text == "hel" and "".join(deltas) == "hel"


def test_stop_at_start_releases_nothing() -> None:
    det = IncrementalDetokenizer(BYTE_LEVEL, [], ["hel"])
    out = [det.add([i]) for i in BYTE_LEVEL.encode("hello")]
    assert det.stopped and "".join(out) == "" and det.text == ""
    assert det.add(BYTE_LEVEL.encode(" more")) == "" and det.finish() == ""


def test_stop_that_completes_first_wins_over_an_earlier_start() -> None:
    for chunk in (1, 2, 3):
        deltas, det = stream(BYTE_LEVEL, BYTE_LEVEL.encode(" aa"), ["a", " aa"], chunk)
        assert det.stopped and det.text == " " and "".join(deltas) == " "


def test_earliest_of_two_stop_strings_wins() -> None:
    deltas, det = stream(BYTE_LEVEL, BYTE_LEVEL.encode("a b c d"), ["d", "b"])
    assert det.stopped and det.text == "a "


def test_partial_stop_is_held_until_it_cannot_match() -> None:
    det = IncrementalDetokenizer(BYTE_LEVEL, [], ["abc"])
    assert det.add(BYTE_LEVEL.encode("xa")) == "x"
    assert det.add(BYTE_LEVEL.encode("b")) == ""
    assert det.add(BYTE_LEVEL.encode("x")) == "abx"
    assert det.add(BYTE_LEVEL.encode("ab")) == ""
    assert det.finish() == "ab" and det.text == "xabxab" and not det.stopped


def test_no_match_finish_releases_everything() -> None:
    text = "hello world zz"
    deltas, det = stream(BYTE_LEVEL, BYTE_LEVEL.encode(text), ["zzz"])
    assert deltas[-1].endswith("zz") and "".join(deltas) == text and not det.stopped


def test_non_ascii_stop_string() -> None:
    deltas, det = stream(BYTE_LEVEL, BYTE_LEVEL.encode("héllo 你好 🙂 wörld"), ["🙂"])
    assert det.stopped and det.text == "héllo 你好 "


def test_long_output_decodes_small_windows() -> None:
    calls: list[int] = []

    class Counting:
        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            calls.append(len(ids))
            return BYTE_LEVEL.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = BYTE_LEVEL.encode(" ".join(CORPUS) * 20)
    deltas, det = stream(Counting(), ids)
    assert det.text == BYTE_LEVEL.decode(ids) and len(ids) > 1000
    assert max(calls) <= 8 and len(calls) <= 2 * len(ids) + 2
