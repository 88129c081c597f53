"""Whether transformers declares a tensor-parallel plan for an architecture, torch-free: the
planner, the config's checks and the engine read the same answer (the plan itself is applied by
trainer/parallel/tensor.py)."""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path

from trainer.core.errors import ConfigError

# what a plan must split for a tensor split to pay: attention's projections and the MLP's
_COVERED = (("attn", "attention"), ("mlp", "feed_forward"))


@cache
def plan_of_config(model_type: str, attribute: str = "base_model_tp_plan") -> tuple[str, ...]:
    """The module patterns of the architecture's `base_model_tp_plan` (or another plan its config
    class declares, e.g. `base_model_ep_plan`; empty: none), read from
    transformers' own configuration module as text: importing it would import torch, which
    the planner does without (a cold plan stays under 3 s)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return ()
    module = model_type.replace("-", "_")
    path = Path(spec.submodule_search_locations[0], "models", module, f"configuration_{module}.py")
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return ()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign) and _assigns(node, attribute):
            try:
                return tuple(ast.literal_eval(node.value) or {})
            except ValueError:
                return ()
    return ()


def _assigns(node: ast.Assign | ast.AnnAssign, name: str) -> bool:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return any(isinstance(t, ast.Name) and t.id == name for t in targets)


def has_tensor_plan(model_type: str, keys: tuple[str, ...] | None = None) -> bool:
    """Whether the plan (`keys`; None: the one transformers declares for `model_type`) splits
    attention and the MLP (gpt_oss's splits only its embedding)."""
    keys = plan_of_config(model_type) if keys is None else keys
    return all(any(word in key for key in keys for word in words) for words in _COVERED)


def check_tensor_plan(model_type: str, tensor: int, keys: tuple[str, ...] | None = None) -> None:
    """ConfigError (exit 2) when `parallel.tensor` > 1 on an architecture without a plan."""
    if tensor > 1 and not has_tensor_plan(model_type, keys):
        raise ConfigError(
            "parallel.tensor",
            f"{tensor} on model_type {model_type}: transformers declares no tensor-parallel "
            "plan for its attention and MLP (base_model_tp_plan)",
            "use parallel.tensor=1 (the fsdp rungs shard it)",
        )
