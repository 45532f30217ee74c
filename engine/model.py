"""Load a Hugging Face causal LM for serving and fingerprint it for KV-cache keys.

`load_model` resolves the aliases `tiny`, `small` and `default`, checks the architecture is one
the paged runner supports (Llama, Qwen2, Mistral) and returns a frozen model with its shapes.
`model_fingerprint` is the digest that keeps KV of different models, dtypes or layouts apart.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.model_source import check_local_folder, is_path_like, load_tokenizer, resolve_model_path

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}
_ALIAS_NAMES = {"tiny": "tiny", "small": "small", "default": "SmolLM2-135M-Instruct"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# The config fields that decide a layer's KV beside the weights (whose names, shapes and values
# the fingerprint reads too) and the KV shape, read as attributes: a transformers config and an
# engine.direct_model one give the same values for the same folder.
_ARCHITECTURE_FIELDS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "rms_norm_eps", "vocab_size", "max_position_embeddings",
    "tie_word_embeddings", "sliding_window", "rope_parameters",
)
_EDGE_ELEMENTS = 256


@dataclass(slots=True)
class LoadedModel:
    """A model ready for inference (eval mode, no grad) plus the shapes the KV cache needs.

    ``tokenizer`` is loaded on first use where the loader did not need it (`load_direct`: an
    engine process never uses it, the API process loads its own)."""

    model: Any
    config: Any
    path: str
    name: str
    device: torch.device
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: list[int]
    loaded_tokenizer: Any = None
    direct: bool = False  # loaded by engine.direct_model, not transformers

    @property
    def tokenizer(self) -> Any:
        if self.loaded_tokenizer is None:
            self.loaded_tokenizer = load_tokenizer(self.path)
        return self.loaded_tokenizer

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim): the per-token KV layout."""
        return (self.num_layers, self.num_kv_heads, self.head_dim)


def resolve_device(device: str) -> torch.device:
    """`auto` means CUDA when available, else CPU; anything else is passed to `torch.device`."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    return resolved


def load_model(model: str, dtype: str = "float32", device: str = "auto", direct: bool = False) -> LoadedModel:
    """Load weights and tokenizer from a folder, hub id or alias, checking the architecture first.

    ``direct``: where `engine.direct_model` can load the folder (a Llama-family model in
    safetensors), load it so, without transformers' model classes, for `FastDecoder` to run
    (the tokenizer then on first use); anything else loads with transformers."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    torch_dtype, torch_device = DTYPES[dtype], resolve_device(device)
    path = resolve_model_path(model)
    _check_location(path)
    if direct:
        from engine import direct_model

        reason = direct_model.direct_unsupported(path)
        if reason is None:
            try:
                return _load_direct(model, path, torch_dtype, torch_device)
            except ValueError as exc:  # weights that do not fit the config: transformers says what it makes of them
                reason = str(exc)
        logger.info("loading with transformers: %s", reason)
    return _load_transformers(model, path, torch_dtype, torch_device)


def _load_direct(model: str, path: str, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    from engine import direct_model

    logger.info("loading weights path=%s dtype=%s device=%s (direct)", path, dtype, device)
    direct = direct_model.load_direct(path, dtype, device)
    config = direct.config
    tokenizer = None
    try:
        tokenizer_eos = direct_model.tokenizer_eos_id(path)
    except LookupError:  # the folder's files do not say: ask the tokenizer, as transformers' path does
        tokenizer = load_tokenizer(path)
        tokenizer_eos = tokenizer.eos_token_id
    eos = _eos_token_ids(direct.generation_config.eos_token_id, tokenizer_eos)
    return LoadedModel(
        model=direct, config=config, path=path, name=_served_name(model, path), device=device, dtype=dtype,
        num_layers=int(config.num_hidden_layers), num_kv_heads=int(config.num_key_value_heads),
        head_dim=int(config.head_dim), eos_token_ids=eos, loaded_tokenizer=tokenizer, direct=True)


def _load_transformers(model: str, path: str, torch_dtype: torch.dtype, torch_device: torch.device) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not load model {path!r}: it is not a local folder and the hub lookup "
                         f"failed ({exc}). Pass a local HF folder, a hub id (needs network or the HF "
                         "cache), 'tiny' or 'default'") from exc
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model {path!r} has model_type {config.model_type!r}; KVGate serves only "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)} models (e.g. 'default' or 'tiny')")
    logger.info("loading weights path=%s dtype=%s device=%s", path, torch_dtype, torch_device)
    hf_model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    hf_model.to(torch_device).eval().requires_grad_(False)
    tokenizer = load_tokenizer(path)
    num_heads = config.num_attention_heads
    return LoadedModel(
        model=hf_model, loaded_tokenizer=tokenizer, config=hf_model.config, path=path,
        name=_served_name(model, path), device=torch_device, dtype=torch_dtype,
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        eos_token_ids=_eos_token_ids(getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None),
                                     tokenizer.eos_token_id),
    )


def context_limit(hf_config: Any, max_model_len: int) -> int:
    """The longest context the engine serves: the configured limit, within the model's position
    embeddings and, for sliding-window attention, the window (the paged kernel attends to the
    whole context, so longer would not be what the model was trained on)."""
    limit = min(max_model_len, getattr(hf_config, "max_position_embeddings", 1 << 30))
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True) and window < limit:
        logger.warning("model uses sliding-window attention (%d tokens); the paged kernel attends to the "
                       "whole context, so max_model_len is capped at the window", window)
        limit = int(window)
    return limit


def model_fingerprint(model: Any, dtype: str | torch.dtype, block_size: int,
                      kv_shape: tuple[int, int, int]) -> bytes:
    """32-byte blake2b of the config's architecture fields, a cheap weights identity, dtype, block
    size and KV shape.

    The weights identity hashes each parameter's name, shape, dtype and its first and last 256
    values, so copies of the same weights agree and different initialisations do not. The
    model's path never enters the digest.
    """
    digest = hashlib.blake2b(digest_size=32, person=b"kvgate-model")
    config = {name: _plain(getattr(model.config, name, None)) for name in _ARCHITECTURE_FIELDS}
    _update(digest, b"config", json.dumps(config, sort_keys=True, default=str).encode())
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        flat = param.detach().reshape(-1)
        edges = torch.cat([flat[:_EDGE_ELEMENTS], flat[-_EDGE_ELEMENTS:]]).cpu().contiguous()
        header = f"{name}|{tuple(param.shape)}|{param.dtype}".encode()
        _update(digest, b"param", header, edges.view(torch.uint8).numpy().tobytes())
    dtype_name = str(dtype).removeprefix("torch.")
    layout = f"{dtype_name}|{int(block_size)}|{tuple(int(x) for x in kv_shape)}".encode()
    _update(digest, b"layout", layout)
    return digest.digest()


def _plain(value: Any) -> Any:
    """``value`` with every number a float (a config may spell 10000 or 10000.0) and dicts sorted."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def _update(digest: Any, *parts: bytes) -> None:
    """Feed length-prefixed parts so that no two different inputs share a byte stream."""
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)


def _check_location(path: str) -> None:
    """Reject a missing local folder early, with a message that says what to pass instead.

    Only local checks here: the hub is probed (once, briefly) by `kvgate serve` before the
    engine starts, see `engine.model_source`.
    """
    local = Path(path).expanduser()
    if is_path_like(path) or local.exists() or not _HUB_ID.match(path):
        check_local_folder(path)


def _served_name(model: str, path: str) -> str:
    if model in _ALIAS_NAMES:
        return _ALIAS_NAMES[model]
    local = Path(path).expanduser()
    return local.resolve().name if local.is_dir() else path


def _eos_token_ids(generation: Any, tokenizer: Any) -> list[int]:
    """End-of-sequence ids: the generation config's (an id, a list or None), then the
    tokenizer's (an id or None), deduplicated in order."""
    ids: list[int] = []
    for source in (generation, tokenizer):
        for value in source if isinstance(source, (list, tuple)) else [source]:
            if value is not None and int(value) not in ids:
                ids.append(int(value))
    return ids
