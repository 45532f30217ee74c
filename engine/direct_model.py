"""Load a Llama-family checkpoint (Llama, Mistral, Qwen2) from its safetensors straight into the
modules `FastDecoder` runs, without transformers' modelling code.

Importing transformers' model classes (``modeling_utils`` and what it pulls in) and running
``from_pretrained`` take seconds on a small CPU, most of an engine process's start; the engine
reads nothing of those classes but their weights, shapes, norms and rotary table. `load_direct`
builds a module tree with the same names and shapes (``model.layers.N.self_attn.q_proj`` ...,
``lm_head``), so packing, the fast decoder and the model's fingerprint see what they would see
in a transformers model, and the KV it computes is the same.

`direct_unsupported` says why a folder cannot take this path — a hub id, no safetensors, another
architecture or activation, a rotary scaling other than none or linear, a quantized checkpoint, a
config that leaves a shape to an architecture's defaults — and the caller then loads with
transformers; so it does where `load_direct` finds weights that do not fit (q/k norms, say).
The decoder and its layers have no ``forward``: only `FastDecoder` runs them (the MLP and the
norm have one, which packing's check calls).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

ARCHITECTURES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear")
# Read from config.json as given: an architecture's defaults for these differ between classes.
REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps")
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # older checkpoints saved the rotary table


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dimension: the rotation of Llama's rotary embedding."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DirectConfig:
    """config.json's fields as attributes, with what the engine reads derived as transformers'
    config classes derive it for these architectures (the standardised rotary parameters, the
    sliding window, the defaults of the activation and of tying) and ``head_dim`` where the file
    has none. Unknown attributes raise AttributeError, as a transformers config does."""

    def __init__(self, raw: dict[str, Any]) -> None:
        values = dict(raw)
        values.setdefault("hidden_act", "silu")
        values.setdefault("tie_word_embeddings", False)
        if values.get("head_dim") is None:
            values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
        values["rope_parameters"] = rope_parameters(raw)
        model_type = values.get("model_type")
        if model_type == "mistral":
            values.setdefault("sliding_window", 4096)
        elif model_type == "qwen2":
            values.setdefault("use_sliding_window", False)
            values["sliding_window"] = values.get("sliding_window", 4096) if values["use_sliding_window"] else None
        self._values = values

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)


class GenerationDefaults:
    """The generation_config fields the engine reads: the end-of-sequence ids."""

    def __init__(self, eos_token_id: int | list[int] | None) -> None:
        self.eos_token_id = eos_token_id


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(torch.float32)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * y.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin of positions, as transformers' Llama rotary module computes them (no scaling, or
    linear scaling: positions divided by ``factor``)."""

    def __init__(self, config: DirectConfig) -> None:
        super().__init__()
        params = config.rope_parameters
        dim = int(config.head_dim)
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        if params["rope_type"] == "linear":
            inv_freq = inv_freq / params["factor"]
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = 1.0

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, index: int, q: nn.Linear, k: nn.Linear, v: nn.Linear, o: nn.Linear, head_dim: int) -> None:
        super().__init__()
        self.layer_idx = index
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q, k, v, o
        self.scaling = head_dim ** -0.5


class MLP(nn.Module):
    def __init__(self, gate: nn.Linear, up: nn.Linear, down: nn.Linear) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate, up, down
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, self_attn: Attention, mlp: MLP, input_layernorm: RMSNorm,
                 post_attention_layernorm: RMSNorm) -> None:
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm, self.post_attention_layernorm = input_layernorm, post_attention_layernorm


class Decoder(nn.Module):
    def __init__(self, embed_tokens: nn.Embedding, layers: list[DecoderLayer], norm: RMSNorm,
                 rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rotary_emb = rotary_emb


class DirectCausalLM(nn.Module):
    """The decoder and output head of a Llama-family model, named as transformers names them."""

    def __init__(self, config: DirectConfig, model: Decoder, lm_head: nn.Linear,
                 generation_config: GenerationDefaults) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = lm_head
        self.generation_config = generation_config

    def get_decoder(self) -> Decoder:
        return self.model

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value  # type: ignore[assignment]

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head


def rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """The rotary parameters as transformers standardises them: ``rope_parameters`` as given, or
    built from the older ``rope_theta`` / ``rope_scaling`` fields."""
    given = raw.get("rope_parameters")
    if isinstance(given, dict):
        return dict(given)
    params = dict(raw.get("rope_scaling") or {})
    params["rope_theta"] = raw.get("rope_theta", 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def weight_files(folder: Path) -> list[Path] | None:
    """The safetensors files of a model folder (one, or the shards its index names), or None."""
    if (folder / _SINGLE_FILE).is_file():
        return [folder / _SINGLE_FILE]
    index = folder / _INDEX_FILE
    if not index.is_file():
        return None
    weight_map = json.loads(index.read_text()).get("weight_map", {})
    files = sorted({folder / name for name in weight_map.values()})
    return files if files and all(f.is_file() for f in files) else None


def direct_unsupported(path: str) -> str | None:
    """Why the model at ``path`` cannot be loaded by `load_direct`, or None if it can."""
    folder = Path(path).expanduser()
    config_file = folder / "config.json"
    if not config_file.is_file():
        return "not a local folder with a config.json"
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        return f"config.json cannot be read ({exc})"
    if raw.get("model_type") not in ARCHITECTURES:
        return f"model_type {raw.get('model_type')!r} is not one of {ARCHITECTURES}"
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        return f"activation {raw.get('hidden_act')!r} is not SiLU"
    if raw.get("quantization_config"):
        return "the checkpoint is quantized"
    missing = [key for key in REQUIRED_KEYS if raw.get(key) is None]
    if missing:
        return f"config.json leaves {', '.join(missing)} to the architecture's defaults"
    rope = rope_parameters(raw)
    if rope.get("rope_type") not in ROPE_TYPES or (rope["rope_type"] == "linear" and not rope.get("factor")):
        return f"rotary scaling {rope.get('rope_type')!r} is not one of {ROPE_TYPES}"
    if not isinstance(rope.get("rope_theta"), (int, float)) or not math.isfinite(rope["rope_theta"]):
        return "rope_theta is not a number"
    if weight_files(folder) is None:
        return "no model.safetensors (or index of shards) in the folder"
    return None


def load_direct(path: str, dtype: torch.dtype, device: torch.device) -> DirectCausalLM:
    """The model at ``path`` (which `direct_unsupported` accepts) in ``dtype`` on ``device``,
    frozen. Raises ValueError where the weights do not match the config."""
    from safetensors import safe_open

    folder = Path(path).expanduser()
    config = DirectConfig(json.loads((folder / "config.json").read_text()))
    files = weight_files(folder)
    assert files is not None, "call direct_unsupported first"
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if not name.endswith(_IGNORED_SUFFIXES):
                    tensors[name] = handle.get_tensor(name)
    model = _build(config, tensors, dtype, device, _generation_defaults(folder, config))
    if tensors:
        raise ValueError(f"{path}: weights the model has no place for: {', '.join(sorted(tensors)[:5])}")
    return model


def tokenizer_eos_id(path: str) -> int | None:
    """The id of the tokenizer's eos token (None: it has none), read from the folder's files as
    the tokenizer would name and look it up; LookupError where the files do not say (the
    tokenizer must be loaded to ask)."""
    folder = Path(path).expanduser()
    token = _tokenizer_eos(folder)
    if token is None:
        if (folder / "tokenizer_config.json").is_file():
            return None
        raise LookupError(f"{path} has no tokenizer_config.json")
    token_id = _token_id(folder, token)
    if token_id is None:
        raise LookupError(f"{path}: eos token {token!r} is not in tokenizer.json")
    return token_id


def _generation_defaults(folder: Path, config: DirectConfig) -> GenerationDefaults:
    """generation_config.json's eos ids, or config.json's where the file is absent (as
    transformers derives a generation config from the model config)."""
    file = folder / "generation_config.json"
    if file.is_file():
        return GenerationDefaults(json.loads(file.read_text()).get("eos_token_id"))
    return GenerationDefaults(getattr(config, "eos_token_id", None))


def _tokenizer_eos(folder: Path) -> str | None:
    """The tokenizer's eos token as its files name it (tokenizer_config.json, then
    special_tokens_map.json), or None."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        file = folder / name
        token = json.loads(file.read_text()).get("eos_token") if file.is_file() else None
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            return token
    return None


def _token_id(folder: Path, token: str) -> int | None:
    """The id of ``token`` in the fast tokenizer's file (added tokens, then the vocabulary)."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        return None
    data = json.loads(file.read_text())
    for added in data.get("added_tokens", []):
        if added.get("content") == token:
            return int(added["id"])
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and token in vocab:
        return int(vocab[token])
    return None


def _build(config: DirectConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
           generation: GenerationDefaults) -> DirectCausalLM:
    """The module tree over ``tensors`` (consumed: what is left was not placed)."""
    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"the checkpoint has no {name}")
        tensor = tensors.pop(name)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, the config says {shape}")
        return tensor.to(device=device, dtype=dtype)

    def linear(prefix: str, out_features: int, in_features: int) -> nn.Linear:
        bias = take(f"{prefix}.bias", (out_features,)) if f"{prefix}.bias" in tensors else None
        return _linear(take(f"{prefix}.weight", (out_features, in_features)), bias)

    hidden, inter = int(config.hidden_size), int(config.intermediate_size)
    heads, kv_heads, head_dim = int(config.num_attention_heads), int(config.num_key_value_heads), int(config.head_dim)
    eps = float(config.rms_norm_eps)
    embed = nn.Embedding(int(config.vocab_size), hidden, _weight=take("model.embed_tokens.weight",
                                                                      (int(config.vocab_size), hidden)), _freeze=True)
    layers = []
    for i in range(int(config.num_hidden_layers)):
        p = f"model.layers.{i}"
        attn = Attention(i, linear(f"{p}.self_attn.q_proj", heads * head_dim, hidden),
                         linear(f"{p}.self_attn.k_proj", kv_heads * head_dim, hidden),
                         linear(f"{p}.self_attn.v_proj", kv_heads * head_dim, hidden),
                         linear(f"{p}.self_attn.o_proj", hidden, heads * head_dim), head_dim)
        mlp = MLP(linear(f"{p}.mlp.gate_proj", inter, hidden), linear(f"{p}.mlp.up_proj", inter, hidden),
                  linear(f"{p}.mlp.down_proj", hidden, inter))
        layers.append(DecoderLayer(attn, mlp, RMSNorm(take(f"{p}.input_layernorm.weight", (hidden,)), eps),
                                   RMSNorm(take(f"{p}.post_attention_layernorm.weight", (hidden,)), eps)))
    decoder = Decoder(embed, layers, RMSNorm(take("model.norm.weight", (hidden,)), eps),
                      RotaryEmbedding(config).to(device))
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # a tied head may be saved too; it is the embedding
        head = _linear(embed.weight, None)  # the same parameter, as transformers ties them
    else:
        head = linear("lm_head", int(config.vocab_size), hidden)
    return DirectCausalLM(config, decoder, head, generation).eval().requires_grad_(False)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` over the given tensors, made without initialising weights first (its
    constructor does, and on the meta device that imports torch's compiler, ~1 s)."""
    layer = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(layer)
    layer.out_features, layer.in_features = int(weight.shape[0]), int(weight.shape[1])
    layer.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
    if bias is None:
        layer.register_parameter("bias", None)
    else:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer
