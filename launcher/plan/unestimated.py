"""A plan without a memory estimate: for `oomless train` with every planning key forced.

A model transformers can build is never refused: when its memory cannot be estimated (its shape
cannot be read from its config, say) and the config names the strategy, the micro-batch and the
checkpointing level, nothing is left to plan, so the job runs as configured with one warning.
The in-process out-of-memory back-off and the ladder still guard the run.
"""

from __future__ import annotations

import logging

from launcher.estimate.peak import DEVICE_PARTS, Estimate
from launcher.plan.hardware import Hardware
from launcher.plan.ladder import job_step, per_rank_batch, planned_attention, rung_world
from launcher.plan.planner import Plan
from trainer.core import strategies
from trainer.core.config import ConfigError, JobConfig
from trainer.core.step_spec import Levers, LongContext

log = logging.getLogger(__name__)
PLANNING_KEYS = ("strategy", "train.micro_batch_size", "memory.activation_checkpointing")


def planning_keys_forced(cfg: JobConfig) -> bool:
    """Whether the config fixes everything the planner would choose."""
    return (
        cfg.strategy != "auto"
        and isinstance(cfg.train.micro_batch_size, int)
        and cfg.memory.activation_checkpointing != "auto"
    )


def unestimated_plan(cfg: JobConfig, hw: Hardware, why: str) -> Plan:
    """The plan the forced keys spell out, with an empty estimate and the reason in words."""
    rung = strategies.row(cfg.strategy)
    if rung_world(rung, hw) is None:
        raise ConfigError(
            "strategy", f"{rung.name} cannot run on {hw.world_size} rank(s)", "pick another rung"
        )
    per_rank_batch(cfg, hw, LongContext.of(cfg).sequence_parallel)  # splits evenly
    every = cfg.fsdp.reduce_every_micro_batch is True if rung.engine == "fsdp" else None
    levers = Levers(cfg.memory.chunked_loss is True, cfg.memory.offload_activations is True)
    micro, ac = int(cfg.train.micro_batch_size), cfg.memory.activation_checkpointing
    spec = job_step(cfg, hw, rung, micro, ac, reduce_every_micro=every, levers=levers)
    empty = Estimate(
        strategy=rung.name,
        world_size=hw.world_size,
        micro_batch_size=micro,
        activation_checkpointing=ac,
        device_breakdown=dict.fromkeys(DEVICE_PARTS, 0),
        peak_tensor_bytes=0,
        device_total_bytes=0,
        chunked_loss=levers.chunked_loss,
        offload_activations=levers.offload_activations,
    )
    reason = (
        f"no memory estimate ({why}); running as configured: strategy {rung.name}, "
        f"micro-batch {micro}, activation checkpointing {ac}"
    )
    return Plan.of(spec, hw, empty, 0.0, [reason], reduce_every_micro=every,
                   attention=planned_attention(cfg.model.attn_implementation))  # fmt: skip


def unestimated_warning(why: str) -> str:
    return (
        f"no memory estimate for this model ({why}): training as configured "
        f"({', '.join(PLANNING_KEYS)} are all set); out-of-memory back-off still applies"
    )
