"""Deterministic tiny Llama models for tests and benchmarks, built offline from a fixed seed.

`build_tiny_model` writes a random-init Llama (GQA, RoPE) and a byte-level BPE tokenizer with a
ChatML chat template; the same seed and size give byte-identical files on every machine.
`tiny_model_dir` caches one build per (size, seed) under `$KVGATE_CACHE_DIR/models`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

BUILDER_VERSION = 1
MARKER_FILE = "kvgate-tiny.json"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- elif message['content'] is none -%}{%- set content = '' -%}"
    "{%- else -%}{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True, slots=True)
class TinySpec:
    """Shape of one tiny model size; `initializer_range` is large for `tiny` to avoid argmax ties."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    initializer_range: float
    max_position_embeddings: int = 4096

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


SIZES: dict[str, TinySpec] = {
    "tiny": TinySpec(vocab_size=1024, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=128, initializer_range=0.15),
    "small": TinySpec(vocab_size=4096, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2,
                      intermediate_size=1536, initializer_range=0.02),
}

_PROSE = """\
Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex.
Complex is better than complicated. Flat is better than nested. Sparse is better than dense.
Readability counts. Errors should never pass silently, unless explicitly silenced.
In the face of ambiguity, refuse the temptation to guess. Now is better than never.
A cache keeps recent answers close, so the next question costs less than the first one.
The server reads a request, finds the prompt, splits it into tokens and returns a reply.
You are a helpful assistant. Please answer the question in one short sentence.
What is the capital of France? The capital of France is Paris.
How many days are there in a week? There are seven days in a week.
def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5
{"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "stream": true}
"""

_WORDS = """\
the of and to a in is it you that he was for on are with as I his they be at one have this from
or had by hot word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her long
make thing see him two has look more day could go come did number sound no most people my over
know water than call first who may down side been now find any new work part take get place made
live where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
head stand own page should country found answer school grow study still learn plant cover food
sun four between state keep eye never last let thought city tree cross farm hard start might story
saw far sea draw left late run while press close night real life few north open seem together next
white children begin got walk example ease paper group always music those both mark often letter
until mile river car feet care second book carry took science eat room friend began idea fish
mountain stop once base hear horse cut sure watch color face wood main enough plain girl usual
young ready above ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship area half rock
order fire south problem piece told knew pass since top whole king space heard best hour better
true during hundred five remember step early hold west ground interest reach fast verb sing listen
six table travel less morning ten simple several vowel toward war lay against pattern slow center
love person money serve appear road map rain rule govern pull cold notice voice unit power town
fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest correct
able pound done beauty drive stood contain front teach week final gave green quick develop ocean
warm free minute strong special mind behind clear tail produce fact street inch multiply nothing
course stay wheel full force blue object decide surface deep moon island foot system busy test
record boat common gold possible plane stead dry wonder laugh thousand ago ran check game shape
equate miss brought heat snow tire bring yes distant fill east paint language among model server
token cache block memory request reply prompt assistant user system developer message content
hello thanks please sorry python code function value return import class string number list
"""

_ONSETS = ("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "ch", "cl", "dr", "fl", "gr", "pl", "qu", "sh", "st", "th", "tr", "")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "ou", "oo", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "rt", "x")


def _pick(rng: random.Random, items: tuple[str, ...] | list[str], skew: float = 1.0) -> str:
    """Pick an item using only `rng.random()`, whose sequence Python guarantees across versions."""
    return items[int(len(items) * rng.random() ** skew)]


def _training_corpus() -> Iterator[str]:
    """Yield a fixed English-like corpus (prose, Zipf-ish sentences, pseudo-words, numbers)."""
    rng = random.Random(20240601)
    yield from _PROSE.splitlines()
    words = _WORDS.split()
    pseudo = ["".join(_pick(rng, part) for part in (_ONSETS, _VOWELS, _CODAS, _ONSETS, _VOWELS, _CODAS))
              for _ in range(3000)]
    for i in range(12000):
        pool = pseudo if i % 3 == 0 else words
        n = 4 + int(10 * rng.random())
        sentence = " ".join(_pick(rng, pool, skew=1.6) for _ in range(n))
        mark = _pick(rng, (".", ".", ".", "?", "!", ",", ":"))
        number = f" {int(rng.random() * 10000)}" if rng.random() < 0.2 else ""
        yield sentence[:1].upper() + sentence[1:] + number + mark


def build_tokenizer(vocab_size: int):
    """Train a byte-level BPE on the built-in corpus and wrap it as a `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"BPE training reached {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token="<|endoftext|>", chat_template=CHATML_TEMPLATE,
        model_max_length=4096, clean_up_tokenization_spaces=False,
    )


def build_tiny_model(out_dir: str | Path, seed: int = 0, size: str = "tiny") -> Path:
    """Write a random-init Llama (GQA, RoPE) plus tokenizer to `out_dir`; same seed, same bytes."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if size not in SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; choose one of {sorted(SIZES)}")
    spec = SIZES[size]
    out = Path(out_dir)
    progress(f"building {size} Llama (seed {seed}) in {out}")
    tokenizer = build_tokenizer(spec.vocab_size)
    endoftext, im_start, im_end = (tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS)
    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=im_start, eos_token_id=[im_end, endoftext], pad_token_id=endoftext,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=im_start, eos_token_id=[im_end, endoftext], pad_token_id=endoftext,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    marker = {"builder_version": BUILDER_VERSION, "seed": seed, "size": size}
    (out / MARKER_FILE).write_text(json.dumps(marker, sort_keys=True) + "\n")
    normalize_modes(out)
    params = sum(p.numel() for p in model.parameters())
    progress(f"built {size} model: {params:,} parameters, vocab {spec.vocab_size}")
    return out


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (other threads may be writing)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def normalize_modes(folder: Path) -> None:
    """Give every file in `folder` the mode a plain `open()` would have (0666 minus the umask).

    `save_pretrained` writes the weights through a private temporary file (mode 0600) and the
    tokenizer files with plain `open()`, so without this one file of the model would be
    unreadable to the other users that can read the rest.
    """
    mode = 0o666 & ~current_umask()
    for child in folder.iterdir():
        if child.is_file() and not child.is_symlink():
            os.chmod(child, mode)


def cache_root() -> Path:
    """KVGate's cache folder: `$KVGATE_CACHE_DIR`, else `~/.cache/kvgate`."""
    env = os.environ.get("KVGATE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvgate"


def publish_dir(tmp: Path, final: Path) -> Path:
    """Atomically move a finished `tmp` folder to `final`; if another process won, keep theirs."""
    os.chmod(tmp, 0o755)  # mkdtemp made it private; the cache is meant to be readable
    for child in tmp.iterdir():
        if child.is_file():
            os.chmod(child, 0o644)
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _is_current(folder: Path, seed: int, size: str) -> bool:
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker == {"builder_version": BUILDER_VERSION, "seed": seed, "size": size}


def tiny_model_dir(seed: int = 0, size: str = "tiny") -> Path:
    """Return the cached tiny model folder, building it on first use (never half-written)."""
    models = cache_root() / "models"
    final = models / f"tiny-{size}-seed{seed}"
    if _is_current(final, seed, size):
        return final
    models.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=models))
    try:
        build_tiny_model(tmp, seed=seed, size=size)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists() and not _is_current(final, seed, size):
        stale = Path(tempfile.mkdtemp(prefix=f".old-{final.name}-", dir=models))
        with contextlib.suppress(FileNotFoundError):  # another process may have moved it first
            os.rename(final, stale / "model")
        shutil.rmtree(stale, ignore_errors=True)
    return publish_dir(tmp, final)


def progress(message: str, log: logging.Logger = logger) -> None:
    """Report one step of a long job (building, downloading, converting) as exactly one line.

    Through `log` when logging is set up (`kvgate serve`: the line gets a time and a level like
    every other); else on stderr as `kvgate: ...`, so that `kvgate build-tiny-model` and scripts
    that never configure logging still see it.
    """
    if logging.getLogger().hasHandlers():
        log.info(message)
    else:
        print(f"kvgate: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Command line: `python -m engine.tiny_model DIR [--seed N] [--size tiny|small]`."""
    parser = argparse.ArgumentParser(
        prog="python -m engine.tiny_model",
        description="Build a deterministic random-init Llama model and ChatML tokenizer offline. "
                    "The same seed and size always give byte-identical files.",
    )
    parser.add_argument("out_dir", metavar="DIR", help="folder to write the model into (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="torch seed for the weights (default: 0)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny",
                        help="tiny: hidden 64, 2 layers, vocab 1024 (~1 MB); "
                             "small: hidden 512, 8 layers, vocab 4096 (~110 MB) (default: tiny)")
    args = parser.parse_args(argv)
    path = build_tiny_model(args.out_dir, seed=args.seed, size=args.size)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
