"""A model's config.json -> ModelSpec, the architecture every part reads: the provider builds Megatron-Core
models from it, the converters and checkpoints record it, the planner (dapo_mcore.plan, no torch) sizes it.

Supported families: Llama-style decoders (RMSNorm, SwiGLU, RoPE, GQA, tied or untied embeddings), i.e.
model_type llama, qwen2 (QKV bias) and qwen3 (QK norm), and the mixture-of-experts qwen3_moe (Qwen3's
attention; in its sparse layers a softmax top-k router over SwiGLU experts, no shared expert). A field whose
value cannot be honoured is an error naming the field, never a silently different model (REFERENCE.md
section 4, complaint 9).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo_mcore.utils.errors import ConfigError

_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
# Mixture-of-experts families whose layers differ from qwen3_moe's: named so the refusal can say why.
_UNSUPPORTED_MOE = {
    "qwen2_moe": "its shared expert with a sigmoid gate",
    "mixtral": "its sliding-window attention and per-family names",
    "deepseek_v3": "multi-latent attention and grouped routing",
    "glm4_moe": "its shared experts and sigmoid routing with a score bias",
}
# What config.json's "dtype" (transformers 5) or "torch_dtype" (earlier) may name: transformers turns it into
# torch.<name> when it reads the file, and an unknown name ended `check` and `train` in an AttributeError
# traceback ("module 'torch' has no attribute ...") naming neither the file nor the key.
CONFIG_DTYPES = ("bfloat16", "float16", "float32", "float64")


@dataclass(frozen=True)
class ModelSpec:
    """The architecture as read from config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Llama 3 RoPE scaling factor (rope_type "llama3"); None without scaling.
    rope_scaling_factor: float | None
    qkv_bias: bool
    qk_norm: bool
    init_std: float
    # Mixture of experts (0 experts: a dense model). moe_layers[i]: layer i is sparse (the others use the
    # dense ffn_hidden_size MLP); the router picks moe_topk of num_experts per token, its weights a softmax
    # over all experts, renormalised over the picked ones when moe_norm_topk_prob.
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()
    # The model's own load-balancing loss coefficient (config.json router_aux_loss_coef).
    router_aux_loss_coef: float = 0.0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)


def load_hf_config(hf_path: str | Path) -> dict[str, Any]:
    path = Path(hf_path) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in model directory {hf_path}")
    return read_config_json(path)


def read_config_json(path: Path) -> dict[str, Any]:
    """An existing config.json as a dict; unreadable JSON or another top level is a ConfigError naming it."""
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        if value is not None and value not in CONFIG_DTYPES:
            raise ConfigError(
                f"{path}: {key} {json.dumps(value)} is not a dtype a model can be read in "
                f"(allowed: {', '.join(CONFIG_DTYPES)})"
            )
    return config


def read_model_spec(hf: dict[str, Any]) -> ModelSpec:
    """The architecture of a Llama / Qwen2 / Qwen3 config.json; a field it cannot honour is a ConfigError."""
    try:
        return _read_model_spec(hf)
    except KeyError as err:
        raise ConfigError(f"config.json has no {err.args[0]!r}: not a Llama-style decoder config") from None


def _read_model_spec(hf: dict[str, Any]) -> ModelSpec:
    model_type = hf.get("model_type")
    if model_type in _UNSUPPORTED_MOE:
        raise ConfigError(
            f"config.json model_type={model_type!r} is not supported: {_UNSUPPORTED_MOE[model_type]} "
            f"(supported mixture-of-experts family: qwen3_moe)"
        )
    if model_type not in _FAMILIES:
        raise ConfigError(f"config.json model_type={model_type!r} is not supported (supported: {list(_FAMILIES)})")
    _expect(hf, "hidden_act", "silu")
    _expect(hf, "mlp_bias", False)
    if hf.get("use_sliding_window"):
        raise ConfigError("config.json use_sliding_window=true is not supported")
    num_heads = hf["num_attention_heads"]
    attention_bias = bool(hf.get("attention_bias", False))
    if attention_bias and model_type != "qwen2":
        raise ConfigError(f"config.json attention_bias=true is not supported for model_type={model_type}")
    return ModelSpec(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        ffn_hidden_size=hf["intermediate_size"],
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(hf),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_scaling_factor=_rope_scaling_factor(hf),
        qkv_bias=model_type == "qwen2" or attention_bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        init_std=hf.get("initializer_range", 0.02),
        **(_moe_fields(hf) if model_type == "qwen3_moe" else {}),
    )


def _moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's experts and router. Layer i is sparse unless listed in mlp_only_layers, and only every
    decoder_sparse_step-th layer (counting from 1) is (transformers' Qwen3MoeDecoderLayer)."""
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))  # transformers 5 writes the latter
    if not num_experts:
        raise ConfigError("config.json model_type='qwen3_moe' has no num_experts")
    topk = hf["num_experts_per_tok"]
    if not 1 <= topk <= num_experts:
        raise ConfigError(f"config.json num_experts_per_tok={topk} must be between 1 and num_experts={num_experts}")
    step = hf.get("decoder_sparse_step", 1)
    if step < 1:
        raise ConfigError(f"config.json decoder_sparse_step={step} must be >= 1")
    dense_only = set(hf.get("mlp_only_layers") or [])
    layers = hf["num_hidden_layers"]
    if dense_only - set(range(layers)):
        raise ConfigError(
            f"config.json mlp_only_layers={sorted(dense_only)} names layers beyond num_hidden_layers={layers}"
        )
    return {
        "num_experts": num_experts,
        "moe_topk": topk,
        "moe_ffn_hidden_size": hf["moe_intermediate_size"],
        "moe_norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "moe_layers": tuple(i not in dense_only and (i + 1) % step == 0 for i in range(layers)),
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.0)),
    }


# Megatron-Core applies Llama 3 RoPE scaling with a configurable factor and these fixed parameters (the
# values of Llama 3.1, 3.2 and 3.3); a config asking for others cannot be honoured.
_LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope_scaling_factor(hf: dict[str, Any]) -> float | None:
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"  # transformers 5 uses the latter
    params = hf.get(key) or {}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ConfigError(f"config.json {key}.rope_type={rope_type!r} is not supported (supported: default, llama3)")
    for name, value in _LLAMA3_ROPE_FIXED.items():
        if float(params.get(name, value)) != value:
            raise ConfigError(
                f"config.json {key}.{name}={params[name]!r}: Megatron-Core's llama3 RoPE scaling fixes it at {value}"
            )
    return float(params["factor"])


def _rope_theta(hf: dict[str, Any]) -> float:
    if "rope_theta" in hf:
        return float(hf["rope_theta"])
    params = hf.get("rope_parameters") or {}  # transformers 5 moves it here
    return float(params.get("rope_theta", 10000.0))


def _expect(hf: dict[str, Any], key: str, supported: Any) -> None:
    if key in hf and hf[key] != supported:
        raise ConfigError(f"config.json {key}={hf[key]!r} is not supported (expected {supported!r})")
