"""What a `train.compile`d decoder layer saves less than an eager one, measured for blocks
without a closed form (`launcher/estimate/compiled_layers.py` has Llama's).

Per compute mode and at the three points the saved tensors are fitted at (layer_fits.py), one
forward under fake tensors counts what each kind of layer saves eagerly and one with those
layers compiled as the engine compiles them, through inductor's decompositions and min-cut
partitioner (`launcher/estimate/saved_tensors.py`, `compiled=True`); the difference, a layer's
mean over the model's layers, is fitted in micro-batch and sequence. Over two cores, on the copy
of the model the activations' trace cuts (traced_activations.py), cached like those fits. A
block dynamo cannot compile under fake tensors keeps its eager count.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from launcher.estimate.layer_fits import Fit
from launcher.estimate.measure_cache import cache_file, write_cache
from launcher.estimate.saved_tensors import kind_sequence, saved_point, traced_attention
from launcher.estimate.shape import transformers_version
from launcher.estimate.trace_pool import on_two_cores
from launcher.estimate.traced_activations import (
    MODES,
    at_layers,
    copy_layers,
    even_seq_len,
    points,
)
from trainer.core.config import ModelConfig
from trainer.core.hf_config import hf_config_dict

log = logging.getLogger(__name__)

COMPILED_CACHE_VERSION = 2  # bump when what is measured or how it is fitted changes


def compiled_saving(
    model_cfg: ModelConfig, seq_len: int, precision: str, cache_dir: Path | None = None
) -> dict[str, Fit] | None:
    """Per compute mode, what one compiled layer saves less (from the cache when measured
    before); None where the layers cannot be compiled under fake tensors."""
    hf_config = hf_config_dict(model_cfg.config, model_cfg.name_or_path)
    attn = model_cfg.attn_implementation
    versions = (transformers_version(), importlib.metadata.version("torch"))
    config_json = json.dumps(hf_config, sort_keys=True)
    path = cache_file("compiled", COMPILED_CACHE_VERSION, *versions, config_json, seq_len,
                      precision, attn, cache_dir=cache_dir)  # fmt: skip
    try:
        return {mode: Fit(**fit) for mode, fit in json.loads(path.read_text()).items()}
    except (OSError, ValueError, TypeError, KeyError):
        pass
    log.info("measuring what torch.compile's partition saves in %s's decoder layers (cached in %s)",
             hf_config["model_type"], path.parent)  # fmt: skip
    try:
        fits = measure_compiled_saving(hf_config, seq_len, precision, traced_attention(attn))
    except Exception as err:  # dynamo or the model's code failed under fake tensors
        note = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:200]
        log.warning("train.compile: %s's layers counted eager (%s)", hf_config["model_type"], note)
        return None
    write_cache(path, {mode: asdict(fit) for mode, fit in fits.items()})
    return fits


def measure_compiled_saving(
    hf_config: dict[str, Any], seq_len: int, precision: str, attn_implementation: str = "sdpa"
) -> dict[str, Fit]:
    """The fits of the module doc, per mode of `precision`."""
    kinds = kind_sequence(hf_config, attn_implementation)
    layers = copy_layers(hf_config, attn_implementation, kinds)
    config = at_layers(hf_config, layers) if layers is not None else hf_config
    s = even_seq_len(seq_len)
    jobs = [
        (config, mode, precision, attn_implementation, b, seq, compiled)
        for mode in MODES[precision]
        for b, seq in points(s)
        for compiled in (False, True)
    ]
    results = on_two_cores(jobs, _saved, lambda job: 2 if job[-1] else 1)
    per_mode = 2 * len(points(s))  # eager and compiled at each point
    fits = {}
    for k, mode in enumerate(MODES[precision]):
        mine = results[k * per_mode : (k + 1) * per_mode]
        less = [  # a layer's mean over the model's layers, as the saved tensors' fits
            sum(eager[kind] - compiled[kind] for kind in kinds) / len(kinds)
            for eager, compiled in zip(mine[0::2], mine[1::2], strict=True)
        ]
        fits[mode] = Fit.through(*less, s)
    return fits


def _saved(job: tuple) -> dict[tuple, int]:
    """What each kind of layer saves in one forward (`saved_point`'s first part)."""
    return saved_point(*job)[0]
