"""The shape of a known decoder from its HF config dict by arithmetic: no torch, no transformers.

`oomless plan` on a config it has never seen would otherwise import torch and transformers
(seconds) to count parameters on the meta device. For the block types the memory estimate models
(llama, mistral, qwen2, phi3, gemma) the count is a sum of projection sizes; a key missing from the
dict takes the default of the type's transformers config class (`_DEFAULTS`). The meta path stays
the reference: tests/launcher/test_analytic_shape.py checks both agree on every preset and on
variants (tied embeddings, biases, grouped-query attention, defaults).
"""

from __future__ import annotations

from typing import Any

# Defaults of transformers' config classes for the keys the count reads (None: derived).
_COMMON = {"tie_word_embeddings": False, "num_key_value_heads": None, "head_dim": None}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        **_COMMON,
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
    },
    "mistral": {
        **_COMMON,
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
    },
    "qwen2": {
        **_COMMON,
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
    },
    "phi3": {
        **_COMMON,
        "vocab_size": 32064,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 4096,
    },
    "gemma": {
        **_COMMON,
        "vocab_size": 256000,
        "hidden_size": 3072,
        "intermediate_size": 24576,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 256,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
    },
}
# Which linear layers carry a bias: (q/k/v, o, mlp); a config key name or a fixed answer.
_BIASES: dict[str, tuple[str | bool, str | bool, str | bool]] = {
    "llama": ("attention_bias", "attention_bias", "mlp_bias"),
    "mistral": (False, False, False),
    "qwen2": (True, False, False),
    "phi3": (False, False, False),
    "gemma": ("attention_bias", "attention_bias", False),
}
ANALYTIC_TYPES = tuple(_DEFAULTS)
# Keys that mean the model is not the stock class (remote code, quantised weights): count on meta.
_NOT_STOCK = ("auto_map", "quantization_config")


def counts_analytically(config: dict[str, Any]) -> bool:
    """Whether `analytic_shape_fields` can count this config without building the model."""
    return config.get("model_type") in _DEFAULTS and not any(k in config for k in _NOT_STOCK)


def analytic_shape_fields(config: dict[str, Any]) -> dict[str, Any]:
    """`ModelShape`'s fields for a config `counts_analytically` accepts: parameters of the
    embeddings, each decoder layer (q, k, v, o projections, gated MLP, two norms) and the root."""
    model_type = config["model_type"]
    c = {**_DEFAULTS[model_type], **{k: v for k, v in config.items() if v is not None}}
    hidden, heads, inter = c["hidden_size"], c["num_attention_heads"], c["intermediate_size"]
    kv_heads = c["num_key_value_heads"] or heads
    head_dim = c["head_dim"] or hidden // heads
    qkv_bias, o_bias, mlp_bias = (
        b if isinstance(b, bool) else bool(c.get(b, False)) for b in _BIASES[model_type]
    )
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * (q + 2 * kv) + q * hidden + qkv_bias * (q + 2 * kv) + o_bias * hidden
    mlp = 3 * hidden * inter + mlp_bias * (2 * inter + hidden)
    layer = attention + mlp + 2 * hidden
    tied = bool(c["tie_word_embeddings"])
    root = c["vocab_size"] * hidden * (1 if tied else 2) + hidden
    layers = c["num_hidden_layers"]
    return {
        "model_type": model_type,
        "num_params": layers * layer + root,
        "num_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": c["vocab_size"],
        "tied_embeddings": tied,
        "max_positions": c["max_position_embeddings"] or 0,
        "num_layer_params": layer,
        "num_root_params": root,
    }
