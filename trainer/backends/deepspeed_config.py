"""The DeepSpeed config dict, built from our typed config. Pure: no deepspeed import here.

Nothing is left as "auto": batch arithmetic, ZeRO stage, offload targets and bucket sizes are all
written out, and `deepspeed.overrides` from the job is deep-merged last (and logged by the
backend). Precision: DeepSpeed runs on fp32 parameters; bf16 compute comes from DeepSpeed's own
`torch_autocast` section (autocast inside the engine's forward), so master weights, gradients and
optimizer state stay fp32 as docs/interface.md says. `lower_precision_safe_modules` is empty so that
ZeRO also all-gathers parameters and reduces gradients in fp32 (like FSDP's reduce_dtype=fp32).
DeepSpeed's `bf16` section is not used: it keeps bf16 parameters and bf16 gradients.
"""

from __future__ import annotations

import copy
from typing import Any

from trainer.core import strategies
from trainer.core.config import JobConfig
from trainer.core.strategies import DEEPSPEED_BUCKET_ELEMENTS

AUTOCAST_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def build_deepspeed_config(
    cfg: JobConfig, world_size: int, micro_batch_size: int, grad_accum: int
) -> dict[str, Any]:
    """The DeepSpeed config for `cfg.strategy` (a zero* rung) at this batch geometry.

    train_batch_size = micro_batch_size x grad_accum x world_size; overrides merged last.
    """
    rung = strategies.row(cfg.strategy)
    stage = rung.zero_stage
    pin = cfg.hardware.device == "cuda"
    zero: dict[str, Any] = {
        "stage": stage,
        "contiguous_gradients": True,
        "overlap_comm": False,
        "reduce_bucket_size": DEEPSPEED_BUCKET_ELEMENTS,
    }
    if stage < 3:
        zero["allgather_bucket_size"] = DEEPSPEED_BUCKET_ELEMENTS
    else:
        zero |= {
            "stage3_prefetch_bucket_size": DEEPSPEED_BUCKET_ELEMENTS,
            "stage3_param_persistence_threshold": 100_000,
            "stage3_max_live_parameters": 1_000_000_000,
            "stage3_max_reuse_distance": 1_000_000_000,
            "stage3_gather_16bit_weights_on_model_save": False,
        }
    for key, place in (("offload_optimizer", rung.optimizer_at), ("offload_param", rung.params_at)):
        if place != "device":
            zero[key] = {"device": place, "pin_memory": pin}
            if place == "nvme":
                zero[key]["nvme_path"] = cfg.deepspeed.nvme_path
    config: dict[str, Any] = {
        "train_batch_size": micro_batch_size * grad_accum * world_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": float(cfg.train.grad_clip),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if cfg.precision in AUTOCAST_DTYPES:
        config["torch_autocast"] = {
            "enabled": True,
            "dtype": AUTOCAST_DTYPES[cfg.precision],
            "lower_precision_safe_modules": [],
        }
    return deep_merge(config, cfg.deepspeed.overrides)


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`overrides` merged into a copy of `base`: nested dicts key by key, anything else replaced."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
