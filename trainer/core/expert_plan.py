"""Whether transformers declares an expert-parallel plan for an architecture, and how many experts
each MoE layer holds, torch-free: the planner, the config's checks and the engine read the same
answer (the plan itself is applied by trainer/parallel/expert.py)."""

from __future__ import annotations

from typing import Any

from trainer.core.errors import ConfigError
from trainer.core.tensor_plan import plan_of_config

EP_PLAN = "base_model_ep_plan"
# the config keys transformers' MoE architectures name their routed experts by
NUM_EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def num_experts_of(text_config: dict[str, Any]) -> int:
    """Routed experts per MoE layer of a text config (0: a dense model)."""
    value = next((v for k in NUM_EXPERTS_KEYS if (v := text_config.get(k))), 0)
    return value if isinstance(value, int) else 0


def expert_plan(model_type: str) -> tuple[str, ...]:
    """The patterns of the architecture's `base_model_ep_plan` (empty: none)."""
    return plan_of_config(model_type, EP_PLAN)


def expert_param_names(keys: tuple[str, ...]) -> set[str]:
    """The last names of what a plan splits: the experts module and its 3-D parameters
    (`experts`, `gate_up_proj`, `down_proj`, their biases)."""
    return {key.rsplit(".", 1)[-1] for key in keys}


def check_expert_plan(model_type: str, expert: int, keys: tuple[str, ...] | None = None) -> None:
    """ConfigError (exit 2) when `parallel.expert` > 1 on an architecture without a plan (a
    dense model, or an MoE whose experts transformers does not dispatch)."""
    keys = expert_plan(model_type) if keys is None else keys
    if expert > 1 and not keys:
        raise ConfigError(
            "parallel.expert",
            f"{expert} on model_type {model_type}: transformers declares no expert-parallel "
            f"plan for it ({EP_PLAN}; a dense model has no experts to split)",
            "use parallel.expert=1",
        )
