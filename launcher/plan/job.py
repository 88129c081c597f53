"""Planning a job: the hardware detected, the model's shape derived once, the plan made, and the
config resolved (every `auto` made concrete) for the ranks to run. What `oomless plan`, `train`
and `submit` share; the planner itself is `launcher/plan/planner.py`.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from launcher.estimate.activations import with_activations
from launcher.estimate.shape import ModelShape, model_shape
from launcher.plan.calibration import figures_for
from launcher.plan.hardware import Hardware, detect_hardware
from launcher.plan.headroom import plan_headroom
from launcher.plan.planner import NoFitError, Plan, apply_plan, make_plan
from launcher.plan.preference import with_reference
from launcher.plan.unestimated import planning_keys_forced, unestimated_plan, unestimated_warning
from trainer.core.config import ConfigError, JobConfig
from trainer.core.config.checks import check_debug_ranks

log = logging.getLogger(__name__)


def resolve_plan(
    cfg: JobConfig, exclude: list[str] | None = None, memory_scale: float = 1.0
) -> tuple[JobConfig, dict[str, Any]]:
    """The resolved config (every `auto` made concrete) and the plan JSON for plan.json."""
    resolved, plan, hw = plan_job(cfg, exclude, memory_scale)
    return resolved, {
        **plan.to_json(hw, plan_headroom(cfg), command=[]),
        "memory_scale": memory_scale,
    }


def _check_hang_timeout(cfg: JobConfig, plan: Plan) -> None:
    """A fixed run.hang_timeout_s shorter than the predicted step would call every step a hang."""
    timeout, step_s = cfg.run.hang_timeout_s, plan.step_time_s
    if isinstance(timeout, int) and step_s and timeout < step_s:
        raise ConfigError(
            "run.hang_timeout_s",
            f"{timeout} s is shorter than a step ({step_s:.0f} s predicted on "
            f"{plan.strategy}): every step would be called a hang",
            f"use at least {2 * step_s:.0f}, or auto (10 x the slowest step measured)",
        )


def next_rung(
    cfg: JobConfig, exclude: list[str], memory_scale: float, ceiling_bytes: float
) -> tuple[JobConfig, list[str]]:
    """Where to climb after an out-of-memory: the plan without the `exclude`d rungs, and never a
    rung whose estimated device peak (unscaled) is above `ceiling_bytes`, the failed rung's own;
    such a rung joins the excluded ones. (resolved config, rungs excluded); NoFitError when no
    rung is left."""
    exclude = list(exclude)
    while True:
        resolved, plan_json = resolve_plan(cfg, exclude=exclude, memory_scale=memory_scale)
        peak = plan_json["estimate"]["device"]["peak_tensor_bytes"] / memory_scale
        if not ceiling_bytes or not peak or peak <= ceiling_bytes:
            return resolved, exclude
        log.info(
            "escalation: not %s, whose estimated peak (%.2f GiB) is above the failed rung's "
            "(%.2f GiB)", resolved.strategy, peak / 2**30, ceiling_bytes / 2**30,
        )  # fmt: skip
        exclude.append(resolved.strategy)


def plan_job(
    cfg: JobConfig, exclude: list[str] | None = None, memory_scale: float = 1.0
) -> tuple[JobConfig, Plan, Hardware]:
    """(resolved config, Plan, Hardware) for this job on the detected hardware."""
    hw = detect_hardware(cfg.hardware)
    check_device_features(cfg, hw)
    check_debug_ranks(cfg, hw.world_size)
    try:
        shape = _forced_shape(cfg)
        family = (shape or model_shape(cfg.model)).model_type
        hw = replace(hw, calibration=figures_for(hw, family))
        plan = make_plan(cfg, hw, shape, exclude=exclude or (), memory_scale=memory_scale)
    except (NoFitError, ConfigError):
        raise
    except Exception as err:  # the model's shape or activations cannot be worked out
        plan = _without_estimate(cfg, hw, err)
    plan = with_reference(cfg, plan)
    _check_hang_timeout(cfg, plan)
    return apply_plan(cfg, plan, hw), plan, hw


# what each attention implementation needs of the device the job runs on
_ATTENTION_NEEDS = {
    "flash_attention_2": "a CUDA GPU (and the flash-attn package on it)",
    "flex_attention": "a CUDA GPU for its backward (torch has no flex_attention backward on CPU)",
}


def check_device_features(cfg: JobConfig, hw: Hardware) -> None:
    """ConfigError (exit 2, before anything is written or launched) when the job asks the
    device for what it cannot do. What only the machine that runs it can tell (an installed
    kernel) is `train`'s check there (trainer/core/config/checks.py `check_run_time_extras`)."""
    attention = cfg.model.attn_implementation
    if attention in _ATTENTION_NEEDS and hw.device != "cuda":
        raise ConfigError(
            "model.attn_implementation",
            f"{attention} needs {_ATTENTION_NEEDS[attention]}, and this job runs on {hw.device}",
            "use model.attn_implementation=sdpa (or eager), or hardware.device=cuda",
        )


def _forced_shape(cfg: JobConfig) -> ModelShape | None:
    """With every planning key set there is nothing to choose: the model's shape with a bound
    on activations of blocks the analytic model does not know, rather than minutes of tracing
    before the run starts. None otherwise (the planner measures)."""
    if not planning_keys_forced(cfg):
        return None
    return with_activations(model_shape(cfg.model), cfg, measure=False)


def _without_estimate(cfg: JobConfig, hw: Hardware, err: Exception) -> Plan:
    """A model transformers builds but the estimate cannot read: with every planning key
    forced it trains as configured (one warning line), else a one-line config error."""
    why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:200]
    if not planning_keys_forced(cfg):
        raise ConfigError(
            "model",
            f"its memory cannot be estimated ({why})",
            "set strategy, train.micro_batch_size and memory.activation_checkpointing to train "
            "it as configured without an estimate",
        ) from None
    log.warning(unestimated_warning(why))
    return unestimated_plan(cfg, hw, why)
