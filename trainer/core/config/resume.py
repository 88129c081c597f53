"""What a resume may change. The keys marked LEARNED in the schema decide what is learned: a
checkpoint refuses to resume when one of them differs (the message names each key and its two
values), and so does a change of the training data's content (the tokenised data's fingerprint,
trainer/data/). Every other key may change and the change is logged: train.steps (extending a
finished run; the schedule is then computed over the new total), strategy, world size,
micro-batch, checkpointing, data.cache_dir, data.on_bad_row (a skipped row changes the data's
fingerprint), model.attn_implementation, model.tokenizer's path (its tokens are in the
fingerprint), eval and logging settings, run bookkeeping; and between values of a learned key
that learn the same thing (`SAME_MATH`: adamw_8bit and paged_adamw_8bit).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel

from trainer.core.config.schema import LEARNED, JobConfig


def learned_keys(section: type[BaseModel] = JobConfig, prefix: str = "") -> tuple[str, ...]:
    """The dotted keys marked LEARNED, in the schema's order (a marked section counts whole)."""
    keys: list[str] = []
    for name, field in section.model_fields.items():
        if LEARNED in field.metadata:
            keys.append(prefix + name)
        elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            keys += learned_keys(field.annotation, f"{prefix}{name}.")
    return tuple(keys)


MATH_KEYS = learned_keys()
_ABSENT = object()
# values of a math key that learn the same thing and read the same checkpoint: a resume may
# change one for the other (logged with the other changes). paged_adamw_8bit is adamw_8bit with
# its states paged to the host by CUDA (docs/finetune.md).
SAME_MATH = {"train.optimizer": {"paged_adamw_8bit": "adamw_8bit"}}


def _math_value(key: str, value: Any) -> Any:
    same = SAME_MATH.get(key, {})
    return same.get(value, value) if isinstance(value, str) else value


def _get_dotted(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _ABSENT
        tree = tree[part]
    return tree


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict) or prefix in MATH_KEYS:
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def resume_differences(saved: dict[str, Any], cfg: JobConfig) -> tuple[list[str], list[str]]:
    """(math keys that differ, other keys that differ) between a checkpoint's saved config tree
    and `cfg`, each as 'key: old -> new'. Keys the saved tree lacks (an older version) are
    skipped."""
    new = json.loads(json.dumps(cfg.to_dict()))

    def show(key: str, old: Any, value: Any) -> str:
        return f"{key}: {json.dumps(old, default=str)} -> {json.dumps(value, default=str)}"

    math, same_math = [], []
    for key in MATH_KEYS:
        old, value = _get_dotted(saved, key), _get_dotted(new, key)
        if old is _ABSENT or old == value:
            continue
        differs = _math_value(key, old) != _math_value(key, value)
        (math if differs else same_math).append(show(key, old, value))
    old_leaves, new_leaves = _leaves(saved), _leaves(new)
    other = same_math + [
        show(key, old_leaves[key], value)
        for key, value in new_leaves.items()
        if key not in MATH_KEYS
        and key != "run.resume"
        and key in old_leaves
        and old_leaves[key] != value
    ]
    return math, other


def semantic_hash(cfg: JobConfig) -> str:
    """Hash of what determines the learned result (MATH_KEYS; not where bytes live)."""
    d = cfg.to_dict()
    picked = {key: _math_value(key, _get_dotted(d, key)) for key in MATH_KEYS}
    blob = json.dumps(picked, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
