"""Check that a model can be found before anything slow starts: a folder, a hub id or an alias.

`kvgate serve` calls `check_model_source` before it binds the engine, so a typo in `--model`
answers in a second with one line, instead of a traceback after torch has loaded (a missing
folder) or after the hub client's five retries (~26 s for a hub id with no network). This
module imports neither torch nor transformers, for the same reason.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

ALIASES = ("tiny", "small", "default")
HUB_PROBE_TIMEOUT_S = 5.0
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_WHAT_TO_PASS = "pass a local HF folder (written by save_pretrained), a hub id (org/name), 'tiny' or 'default'"


class ModelSourceError(ValueError):
    """The model cannot be found; the message says what was looked for and what to pass instead."""


class ModelFolderNotFoundError(ModelSourceError, FileNotFoundError):
    """A path-like model names no existing file or folder."""


def is_path_like(model: str) -> bool:
    """A value that names a folder rather than a hub id: starts with / . ~ or has a separator.

    A hub id has at most one `/`, so `org/name` is only a path when that folder exists.
    """
    if model.startswith(("/", ".", "~")):
        return True
    separators = [s for s in (os.sep, os.altsep) if s and s != "/"]
    return any(s in model for s in separators) or model.count("/") > 1


def check_local_folder(path: str) -> Path:
    """The folder `path` if it holds a model (config.json); raise `ModelSourceError` otherwise."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ModelFolderNotFoundError(f"model folder {path} not found; {_WHAT_TO_PASS}")
    if not folder.is_dir():
        raise ModelSourceError(f"model path {path} is a file, not a folder; {_WHAT_TO_PASS}")
    if not (folder / "config.json").is_file():
        raise ModelSourceError(f"model folder {path} has no config.json; {_WHAT_TO_PASS}")
    return folder


def check_model_source(model: str) -> str | None:
    """Raise `ModelSourceError` unless `model` can be loaded; return a note worth logging, if any.

    Aliases pass (they are built or downloaded by KVGate itself). A path-like value, or a name
    that exists as a folder, must be a model folder. Anything else must be a hub id that is in
    the local Hugging Face cache or that the hub answers for within `HUB_PROBE_TIMEOUT_S`, once
    and without retries. With `HF_HUB_OFFLINE=1` only the cache is consulted. When the hub cannot
    be reached but the cache has the model, offline mode is switched on for this process and the
    engine process, so that loading does not wait for the hub's retries either.
    """
    if model in ALIASES:
        return None
    if is_path_like(model) or Path(model).expanduser().exists():
        check_local_folder(model)
        return None
    if not _HUB_ID.match(model):
        raise ModelSourceError(f"model {model!r} is neither an existing folder nor a hub id; {_WHAT_TO_PASS}")
    return _check_hub_id(model)


def _check_hub_id(repo_id: str) -> str | None:
    from huggingface_hub import constants, errors, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache

    cached = isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    if constants.HF_HUB_OFFLINE:
        if cached:
            return None
        raise ModelSourceError(
            f"model {repo_id!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            f"HF_HUB_OFFLINE=1 forbids downloading it; download it once while online "
            f"(`hf download {repo_id}`), or {_WHAT_TO_PASS}")
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json"), timeout=HUB_PROBE_TIMEOUT_S)
    except errors.GatedRepoError:
        if cached:
            return None
        raise ModelSourceError(f"model {repo_id!r} is gated on the Hugging Face hub: accept its terms on "
                               f"huggingface.co and set HF_TOKEN, or {_WHAT_TO_PASS}") from None
    except errors.RepositoryNotFoundError:
        raise ModelSourceError(f"model {repo_id!r} was not found on the Hugging Face hub (a private one needs "
                               f"HF_TOKEN); check the id, or {_WHAT_TO_PASS}") from None
    except errors.EntryNotFoundError:
        raise ModelSourceError(f"hub repository {repo_id!r} has no config.json, so it is not a transformers "
                               f"model; {_WHAT_TO_PASS}") from None
    except Exception as exc:  # no network, DNS failure, timeout, a 5xx from the hub
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        if cached:
            go_offline()
            return (f"the Hugging Face hub is unreachable ({reason}); serving the cached copy of "
                    f"{repo_id!r} in offline mode")
        raise ModelSourceError(
            f"cannot reach {constants.ENDPOINT} to fetch model {repo_id!r} ({reason}) and it is not in the "
            f"local Hugging Face cache; connect to the internet, set HF_ENDPOINT to a mirror, or "
            f"{_WHAT_TO_PASS}") from None
    return None


def resolve_model_path(model: str) -> str:
    """Map the aliases `tiny`, `small` and `default` to local folders; return anything else as is."""
    if model in ("tiny", "small"):
        from engine.tiny_model import tiny_model_dir

        return str(tiny_model_dir(size=model))
    if model == "default":
        from engine.default_model import ensure_default_model

        return str(ensure_default_model())
    return model


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a resolved model folder (what the API process needs to tokenize and
    detokenize), as `AutoTokenizer` loads it. transformers is imported here, on first use.

    A Llama folder whose tokenizer is transformers' generic `TokenizersBackend` (a tokenizer.json,
    what KVGate's own models have) is loaded by that class directly: the class `AutoTokenizer`
    picks for it, without the Auto machinery, which imports torch and transformers' model code
    (~3 s of an API process's start on two cores)."""
    if generic_tokenizer(path):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def generic_tokenizer(path: str) -> bool:
    """Whether ``path`` is a local Llama folder whose tokenizer_config.json names the generic
    `TokenizersBackend` over its tokenizer.json, with no code of its own (auto_map). Other model
    types may map a generic declaration to their own class (Qwen2's does), so only Llama's is taken."""
    folder = Path(path).expanduser()
    try:
        config = json.loads((folder / "config.json").read_text())
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (config.get("model_type") == "llama" and tokenizer_config.get("tokenizer_class") == "TokenizersBackend"
            and "auto_map" not in tokenizer_config and (folder / "tokenizer.json").is_file())


def go_offline() -> None:
    """Make the hub client use only its cache, here and in processes started from now on."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
