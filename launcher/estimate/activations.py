"""Activations of decoder blocks the analytic model does not know: the shape's activations
attached where the plan needs them, measured once per model (cached), or bounded when its code
cannot be traced.

`launcher/estimate/peak.py` describes llama-style blocks (MODELLED_TYPES) in closed form. Any other
block is measured from the model's own code (`launcher/estimate/traced_activations.py`).
The fit is cached like model shapes (per HF config, sequence length, precision, attention
implementation and transformers version) under `$XDG_CACHE_HOME/oomless/activations`.

A model whose forward fails under fake tensors (custom code, data-dependent shapes) is planned
from a conservative bound: twice the llama-style block of its sizes plus eager attention's
probabilities, said so in the plan's reasons.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from launcher.estimate.analytic_activations import MODELLED_TYPES, Micro, analytic_layer_bytes
from launcher.estimate.compiled_layers import closed_form
from launcher.estimate.compiled_trace import compiled_saving
from launcher.estimate.layer_fits import BOUND_FACTOR, Fit, LayerActivations
from launcher.estimate.measure_cache import cache_file, write_cache
from launcher.estimate.shape import ModelShape, transformers_version
from launcher.estimate.traced_activations import MODES, trace_layer_activations
from trainer.core.config import JobConfig, ModelConfig
from trainer.core.hf_config import hf_config_dict

log = logging.getLogger(__name__)

ACTIVATIONS_CACHE_VERSION = 7  # bump when what is measured or how it is fitted changes


def analytic(model_type: str) -> bool:
    """Whether the closed-form activation model describes this block type."""
    return model_type in MODELLED_TYPES


NOT_MEASURED = (
    "not measured, since strategy, train.micro_batch_size and memory.activation_checkpointing "
    "are all set (nothing to choose)"
)


def with_activations(
    shape: ModelShape, cfg: JobConfig, cache_dir: Path | None = None, measure: bool = True
):
    """`shape` with the activations of its layers attached, where the analytic model does not
    know its block type: measured (cached), or a conservative bound where tracing fails or
    `measure` is False (a forced plan: `oomless train` starts without tracing anything). Under
    `train.compile`, what a compiled layer saves less, measured where no closed form knows it
    (launcher/estimate/compiled_trace.py; not measured: counted as eager layers)."""
    if not analytic(shape.model_type) and shape.activations is None:
        if not measure:
            bound = bound_activations(shape, cfg.data.seq_len, cfg.precision, NOT_MEASURED)
            return replace(shape, activations=bound)
        acts = layer_activations(shape, cfg.model, cfg.data.seq_len, cfg.precision, cache_dir)
        shape = replace(shape, activations=acts)
    bounded = shape.activations is not None and shape.activations.source == "bound"
    if measure and cfg.train.compile and not bounded and not closed_form(shape):
        fits = compiled_saving(cfg.model, cfg.data.seq_len, cfg.precision, cache_dir)
        shape = replace(shape, compiled_saving=fits)
    return shape


def layer_activations(
    shape: ModelShape,
    model_cfg: ModelConfig,
    seq_len: int,
    precision: str,
    cache_dir: Path | None = None,
) -> LayerActivations:
    """The traced fit for this model (from the cache when measured before), or the bound."""
    config_json = json.dumps(
        hf_config_dict(model_cfg.config, model_cfg.name_or_path), sort_keys=True
    )
    path = cache_file(ACTIVATIONS_CACHE_VERSION, transformers_version(), config_json, seq_len,
                      precision, model_cfg.attn_implementation, cache_dir=cache_dir)  # fmt: skip
    try:
        return LayerActivations.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        pass
    log.info(
        "measuring the activations of %s's decoder layers by tracing its steps under fake "
        "tensors (once per config, sequence length and precision; cached in %s)",
        shape.model_type,
        path.parent,
    )
    try:
        acts = trace_layer_activations(
            json.loads(config_json), seq_len, precision, model_cfg.attn_implementation
        )
    except Exception as err:  # the model's own code failed under fake tensors: bound it
        note = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:200]
        log.warning("%s: activations bounded, the trace failed (%s)", shape.model_type, note)
        why = f"its forward could not be traced ({note})"
        return bound_activations(shape, seq_len, precision, why)
    write_cache(path, acts.to_json())
    return acts


def bound_activations(shape: ModelShape, seq_len: int, precision: str, note: str):
    """BOUND_FACTOR llama-style blocks of these sizes (masked, k/v repeated) plus eager
    attention's probabilities in fp32 and the compute dtype, per layer."""

    def at(mode: str, b: int, s: int) -> float:
        c = 4 if mode == "fp32" else 2
        m = Micro(b=b, s=s, c=c, r=4 if mode != "lowp" else c, autocast=mode == "autocast",
                   masked=True)  # fmt: skip
        eager = (4 + c) * b * shape.num_heads * s * s
        return BOUND_FACTOR * analytic_layer_bytes(shape, m) + eager

    def shared(mode: str, b: int, s: int) -> float:  # rotary cos and sin of llama's sizes
        return 2 * (4 if mode != "lowp" else 2) * b * s * shape.head_dim

    def final(mode: str, b: int, s: int) -> float:  # an fp32 norm and a 16-bit head input
        c = 4 if mode == "fp32" else 2
        return (4 + 4 + 4 + c) * b * s * shape.hidden_size + c * shape.num_embedding_params

    s = max(2, seq_len - seq_len % 2)

    def fitted(f) -> dict[str, Fit]:
        return {
            mode: Fit.through(f(mode, 1, s // 2), f(mode, 2, s // 2), f(mode, 1, s), s)
            for mode in MODES[precision]
        }

    def backward(mode: str, b: int, s: int) -> float:  # activation grads, eager attention's
        c = 4 if mode == "fp32" else 2
        t, i = b * s, shape.intermediate_size
        return BOUND_FACTOR * (2 * c * t * i + 4 * t * shape.hidden_size) + (
            2 * (4 + c) * b * shape.num_heads * s * s
        )

    def forward(mode: str, b: int, s: int) -> float:  # eager attention's scores and softmax
        return 2 * 4 * b * shape.num_heads * s * s

    return LayerActivations("bound", fitted(at), seq_len, note=note, shared=fitted(shared),
                            final=fitted(final), backward=fitted(backward),
                            forward=fitted(forward))  # fmt: skip
