"""A run's degrees of parallelism, read from its resolved config and checked against its model
before any process group exists (exit 2 in one line, naming the degrees that would run)."""

from __future__ import annotations

from typing import Any

from trainer.core.config import JobConfig
from trainer.core.expert_plan import check_expert_plan, num_experts_of
from trainer.core.parallel_dims import ParallelDims, check_expert_parallel, check_tensor_parallel
from trainer.core.tensor_plan import check_tensor_plan
from trainer.parallel import expert, tensor
from trainer.parallel.sequence import (
    attention_of,
    check_sequence_parallel,
    concrete_sequence_parallel,
)


def concrete_tensor_parallel(cfg: JobConfig) -> int:
    """`parallel.tensor`; `auto` is 1 until the planner writes its choice into the resolved
    config that every rank reads."""
    tp = cfg.parallel.tensor
    return 1 if tp == "auto" else tp


def concrete_expert_parallel(cfg: JobConfig) -> int:
    """`parallel.expert`; `auto` is 1 (the planner does not weigh an expert split yet)."""
    ep = cfg.parallel.expert
    return 1 if ep == "auto" else ep


def run_dims(cfg: JobConfig, world_size: int, hf_config: Any) -> ParallelDims:
    """The run's data x sequence x tensor split of `world_size` ranks, and the expert split of
    its token ranks, checked for its model."""
    dims = ParallelDims(
        world_size,
        concrete_sequence_parallel(cfg),
        concrete_tensor_parallel(cfg),
        concrete_expert_parallel(cfg),
    )
    check_tensor_parallel(dims, attention_of(hf_config))
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    model_type = getattr(text, "model_type", "")
    check_tensor_plan(model_type, dims.tensor, _plan(text, "base_model_tp_plan"))
    tensor.check_installed(dims.tensor)
    check_expert_plan(model_type, dims.expert, _plan(text, "base_model_ep_plan"))
    check_expert_parallel(dims, num_experts_of(text.to_dict() if hasattr(text, "to_dict") else {}))
    expert.check_installed(dims.expert)
    check_sequence_parallel(dims, hf_config, cfg.data.seq_len)
    return dims


def _plan(text_config: Any, attribute: str) -> tuple[str, ...]:
    return tuple(getattr(text_config, attribute, None) or {})
