"""The shape of a model from its HF config alone: exact parameter counts, no weights, no GPU.

Sources: an inline `model.config`, a local directory with `config.json`, or a hub id that names a
preset shipped in `trainer/core/presets/` (read offline; its `index.yaml` maps hub ids to
preset files). Parameter counts of the block types the estimate models are arithmetic
(`launcher.estimate.analytic_shape`, no torch: cold start under 3 s); any other type is instantiated
on the meta device, once per config and transformers version, and cached.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from launcher.estimate.analytic_shape import analytic_shape_fields, counts_analytically
from launcher.estimate.layer_fits import Fit, LayerActivations
from trainer.core.config import ModelConfig
from trainer.core.hf_config import PRESETS, hf_config_dict, model_positions, preset_index

log = logging.getLogger(__name__)
SHAPE_CACHE_VERSION = 2  # bump when what a shape holds or how it is counted changes


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    num_params: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    max_positions: int
    num_layer_params: int  # a decoder layer: the layers' parameters over their number
    num_root_params: int  # embeddings, final norm, lm_head (not in any layer)
    # Mixture of experts: experts per MoE layer, how many each token is routed to, and the
    # parameters one token's forward uses (every dense one, top-k of each layer's experts);
    # 0 for dense models
    num_experts: int = 0
    experts_per_token: int = 0
    num_active_params: int = 0
    # measured (or bounded) activations for block types the analytic model does not know;
    # attached by launcher.estimate.activations.with_activations, never cached with the shape
    activations: LayerActivations | None = None
    # under train.compile, what one compiled layer saves less per compute mode, measured for
    # blocks without a closed form (launcher/estimate/compiled_trace.py); attached likewise
    compiled_saving: dict[str, Fit] | None = None
    # the largest decoder layer where layers differ in size (DeepSeek's dense layers below its
    # MoE ones, Llama 4's alternating ones); 0 where every layer has num_layer_params
    largest_layer_params: int = 0
    # one rank's share of a tensor split (launcher/estimate/tensor_split.py): the embedding's and
    # head's weights split over it; the logits (vocab_size) whole
    tensor_parallel: int = 1
    # one rank's share of an expert split (launcher/estimate/expert_split.py): it gathers, and
    # makes gradients for, its own experts / expert_parallel of each MoE layer
    expert_parallel: int = 1

    @property
    def num_embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size // self.tensor_parallel

    @property
    def num_head_params(self) -> int:
        """lm_head's weight (the embedding's when tied)."""
        return self.vocab_size * self.hidden_size // self.tensor_parallel

    @property
    def largest_tensor_params(self) -> int:
        """The largest weight: the embedding or output layer, an MLP or attention matrix."""
        h = self.hidden_size
        return max(
            self.vocab_size * h, self.intermediate_size * h, self.num_heads * self.head_dim * h
        )

    @property
    def top_layer_params(self) -> int:
        """The largest decoder layer: what a sharded rung gathers, and what one layer's
        backward makes gradients for, at the step's peak."""
        return self.largest_layer_params or self.num_layer_params

    @property
    def num_routed_params(self) -> int:
        """Parameters of every routed expert of every layer, from the active count (N - A =
        R (E - k) / E); 0 for a dense model."""
        e, k = self.num_experts, self.experts_per_token
        if not (e and k and self.num_active_params):
            return 0
        return (self.num_params - self.num_active_params) * e // (e - k)

    @property
    def gathered_layer_params(self) -> int:
        """What a sharded rung gathers of its largest layer: all of it, or under an expert split
        its dense part and this rank's share of its experts (the routed parameters taken as
        spread over every layer: where some layers are dense, the share is over-counted)."""
        ep = self.expert_parallel
        if ep == 1:
            return self.top_layer_params
        per_layer = self.num_routed_params // max(1, self.num_layers)
        return self.top_layer_params - per_layer * (ep - 1) // ep

    @property
    def num_compute_params(self) -> int:
        """Parameters one token's forward multiplies by: all of them, except the experts a
        token is not routed to."""
        return self.num_active_params or self.num_params


def model_shape(
    model_cfg: ModelConfig, cache_dir: Path | None = None, shipped: bool = True
) -> ModelShape:
    """The shape of the configured model, from a meta-device instantiation: the seconds of
    importing torch and transformers are paid once per HF config and transformers version, then
    the shape is read from `cache_dir` (default: `$XDG_CACHE_HOME/oomless/shapes`). The presets'
    shapes ship computed (`trainer/core/presets/shapes.json`; a test recomputes them);
    `shipped=False` ignores them."""
    config = hf_config_dict(model_cfg.config, model_cfg.name_or_path)
    shape = _unscaled_shape(config, cache_dir, shipped)
    if model_cfg.rope_scaling is None:
        return shape
    return replace(shape, max_positions=model_positions(config, model_cfg.rope_scaling))


def _unscaled_shape(config: dict[str, Any], cache_dir: Path | None, shipped: bool) -> ModelShape:
    """The shape of the HF config as it is (the cache and the shipped shapes are keyed by it)."""
    config_json = json.dumps(config, sort_keys=True)
    if shipped and (known := _shipped_shapes().get(_config_digest(config_json))) is not None:
        return ModelShape(**known["shape"])
    if counts_analytically(config):  # known blocks: arithmetic, no torch (cold start)
        return ModelShape(**analytic_shape_fields(config))
    key = f"{SHAPE_CACHE_VERSION}\n{transformers_version()}\n{config_json}"
    path = (cache_dir or _default_cache_dir()) / f"{hashlib.sha256(key.encode()).hexdigest()}.json"
    try:
        return ModelShape(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass  # not cached yet, or unreadable: compute it
    shape = shape_of(config_json)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(shape_record(shape)))
        tmp.replace(path)
    except OSError as e:  # a read-only home still plans, only slower next time
        log.debug("shape cache not written: %s", e)
    return shape


def shape_record(shape: ModelShape) -> dict[str, Any]:
    """The shape as cached and shipped: without attached measurements, and the MoE fields and
    the largest layer only where they apply (other shapes read as before they existed)."""
    record = asdict(shape)
    record.pop("activations")
    record.pop("compiled_saving")
    if record["expert_parallel"] == 1:  # a planner's choice, never cached with the shape
        record.pop("expert_parallel")
    for key in ("num_experts", "experts_per_token", "num_active_params", "largest_layer_params"):
        if not record[key]:
            record.pop(key)
    return record


def _config_digest(config_json: str) -> str:
    return hashlib.sha256(f"{SHAPE_CACHE_VERSION}\n{config_json}".encode()).hexdigest()


@lru_cache(maxsize=1)
def _shipped_shapes() -> dict[str, dict[str, Any]]:
    path = PRESETS / "shapes.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def preset_shapes() -> dict[str, dict[str, Any]]:
    """Every preset's shape computed now, keyed as `trainer/core/presets/shapes.json` keys them."""
    shapes = {}
    for file in sorted(set(preset_index().values())):
        config_json = json.dumps(json.loads((PRESETS / file).read_text()), sort_keys=True)
        shapes[_config_digest(config_json)] = {
            "preset": file,
            "shape": shape_record(shape_of(config_json)),
        }
    return shapes


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "oomless" / "shapes"


def transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@lru_cache(maxsize=32)
def shape_of(config_json: str) -> ModelShape:
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    params = json.loads(config_json)
    model_type = params.pop("model_type")
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype"):
        params.pop(key, None)
    config = CONFIG_MAPPING[model_type](**params)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    from trainer.model.build import decoder_layers

    layers = decoder_layers(model)
    num_params = sum(p.numel() for p in model.parameters())
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    in_layers = {id(p): p.numel() for layer in layers for p in layer.parameters()}  # shared once
    num_layer_params = sum(in_layers.values()) // len(layers)
    hidden = config.hidden_size
    heads = config.num_attention_heads
    text = getattr(config, "get_text_config", lambda: config)()
    num_experts, top_k, expert_params = _experts(model, text)
    active = num_params - expert_params + expert_params * top_k // num_experts if top_k else 0
    return ModelShape(
        model_type=model_type,
        num_params=num_params,
        num_layers=len(layers),
        hidden_size=hidden,
        intermediate_size=getattr(text, "intermediate_size", 4 * hidden),
        num_heads=heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or hidden // heads,
        vocab_size=config.vocab_size,
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_positions=getattr(text, "max_position_embeddings", 0) or 0,
        num_layer_params=num_layer_params,
        num_root_params=num_params - len(layers) * num_layer_params,
        num_experts=num_experts if top_k else 0,
        experts_per_token=top_k,
        num_active_params=active,
        largest_layer_params=max(per_layer) if max(per_layer) != num_layer_params else 0,
    )


_NUM_EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k")


def _experts(model: Any, text: Any) -> tuple[int, int, int]:
    """(experts per MoE layer, experts per token, parameters of all routed experts) of an MoE
    model, from its config and its `experts` modules (stacked 3-D weights, or a list of expert
    MLPs); (0, 0, 0) for a dense one. Shared experts run for every token: not counted."""
    num_experts = next((v for k in _NUM_EXPERTS_KEYS if (v := getattr(text, k, None))), 0)
    top_k = next((v for k in _TOP_K_KEYS if (v := getattr(text, k, None))), 0)
    if not (isinstance(num_experts, int) and isinstance(top_k, int) and 0 < top_k < num_experts):
        return 0, 0, 0
    routed = 0
    for name, p in model.named_parameters():
        parts = name.split(".")
        if "experts" not in parts:
            continue
        after = parts[parts.index("experts") + 1 :]
        if (after and after[0].isdigit()) or (p.dim() >= 2 and p.shape[0] == num_experts):
            routed += p.numel()
    return num_experts, top_k, routed


if __name__ == "__main__":  # python -m launcher.estimate.shape: rewrite the presets' shapes.json
    (PRESETS / "shapes.json").write_text(
        json.dumps(preset_shapes(), indent=1, sort_keys=True) + "\n"
    )
