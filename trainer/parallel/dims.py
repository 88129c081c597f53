"""A run's degrees of parallelism, read from its resolved config and checked against its model
before any process group exists (exit 2 in one line, naming the degrees that would run)."""

from __future__ import annotations

from typing import Any

from trainer.core.config import JobConfig
from trainer.core.parallel_dims import ParallelDims, check_tensor_parallel
from trainer.core.tensor_plan import check_tensor_plan
from trainer.parallel.sequence import (
    attention_of,
    check_sequence_parallel,
    concrete_sequence_parallel,
)
from trainer.parallel.tensor import check_installed


def concrete_tensor_parallel(cfg: JobConfig) -> int:
    """`parallel.tensor`; `auto` is 1 until the planner writes its choice into the resolved
    config that every rank reads."""
    tp = cfg.parallel.tensor
    return 1 if tp == "auto" else tp


def run_dims(cfg: JobConfig, world_size: int, hf_config: Any) -> ParallelDims:
    """The run's data x sequence x tensor split of `world_size` ranks, checked for its model."""
    dims = ParallelDims(world_size, concrete_sequence_parallel(cfg), concrete_tensor_parallel(cfg))
    check_tensor_parallel(dims, attention_of(hf_config))
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    plan = tuple(getattr(text, "base_model_tp_plan", None) or {})
    check_tensor_plan(getattr(text, "model_type", ""), dims.tensor, plan)
    check_installed(dims.tensor)
    check_sequence_parallel(dims, hf_config, cfg.data.seq_len)
    return dims
