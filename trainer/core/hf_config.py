"""The model's Hugging Face config as a plain dict, offline and without torch.

Sources: an inline `model.config`, a local directory with `config.json`, or a hub id that names a
preset shipped inside the package in `trainer/core/presets/` (its `index.yaml` maps hub ids to
preset files; read with importlib.resources, so an installed wheel has them too).
The config validator (positions), the launcher (shape, estimate) and the engine all read it here.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from trainer.core.errors import ConfigError

PRESETS = resources.files("trainer.core") / "presets"


def hf_config_dict(inline: dict[str, Any] | None, name: str | None) -> dict[str, Any]:
    """The HF config as a dict, without network access: the inline `model.config`, else the one
    `model.name_or_path` names."""
    if inline is not None:
        return dict(inline)
    assert name is not None
    local = Path(name).expanduser()
    if (local / "config.json").is_file():
        return _read_config_json(local / "config.json")
    preset = preset_index().get(name) or preset_index().get(name.lower())
    if preset is not None:
        return json.loads((PRESETS / preset).read_text())
    raise ConfigError(
        "model.name_or_path",
        f"'{name}' is neither a local model dir nor a shipped preset, so its shape is unknown "
        "offline",
        f"give a local dir with config.json, an inline model.config, or one of: "
        f"{', '.join(sorted(preset_index()))}",
    )


def _read_config_json(path: Path) -> dict[str, Any]:
    """A model directory's config.json as a dict; ConfigError naming it when it is not one."""
    try:
        tree = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ConfigError(
            "model.name_or_path",
            f"{path} is not valid JSON ({str(err)[:120]})",
            "point model.name_or_path at a model directory with a valid config.json",
        ) from None
    if not isinstance(tree, dict):
        raise ConfigError(
            "model.name_or_path",
            f"{path} holds a {type(tree).__name__}, not a JSON object",
            "point model.name_or_path at a model directory with a valid config.json",
        )
    return tree


@lru_cache(maxsize=1)
def preset_index() -> dict[str, str]:
    """Hub id -> preset file name in `PRESETS`."""
    index = yaml.safe_load((PRESETS / "index.yaml").read_text())
    return {str(k): str(v) for k, v in index.items()}


# model.rope_scaling: the rotary scalings transformers' config takes for context extension
ROPE_TYPES = ("yarn", "linear", "dynamic", "llama3")
# the most positions a scaling may yield: position ids are int32 in every kernel that takes them
MAX_POSITIONS = 2**31 - 1
# blocks whose positions are learned embeddings or ALiBi biases: no rotary to scale
NOT_ROTARY = ("gpt2", "gpt_bigcode", "opt", "biogpt", "bloom", "mpt", "xglm", "gpt_neo")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The decoder's part of an HF config dict (a multimodal one nests it in `text_config`)."""
    return hf.get("text_config") or hf


def model_positions(hf: dict[str, Any], rope_scaling: dict[str, Any] | None = None) -> int:
    """The positions the model takes: its config's, or what `model.rope_scaling` yields
    (`factor` x `original_max_position_embeddings`); 0 where the config does not say."""
    text = text_config(hf)
    limit = text.get("max_position_embeddings") or text.get("n_positions") or 0
    if rope_scaling is None:
        return int(limit)
    return rope_update(hf, rope_scaling)["positions"]


def rope_update(hf: dict[str, Any], rope_scaling: dict[str, Any]) -> dict[str, Any]:
    """What `model.rope_scaling` makes of the model's config: `rope_parameters` (the model's
    rope_theta kept, the scaling's keys over the model's own), `max_position_embeddings` and
    the `positions` it yields. Dynamic NTK keeps `max_position_embeddings` (transformers reads
    it as the length it scales beyond). ConfigError (one line) where it cannot apply."""
    text = text_config(hf)
    key = "model.rope_scaling"
    if text.get("model_type", hf.get("model_type")) in NOT_ROTARY:
        raise ConfigError(key, f"{hf.get('model_type')} has no rotary positions to scale",
                          "remove model.rope_scaling")  # fmt: skip
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(key, f"rope_type {rope_type!r} is not one of {', '.join(ROPE_TYPES)}",
                          "set e.g. model.rope_scaling={rope_type: yarn, factor: 4.0}")  # fmt: skip
    factor = rope_scaling.get("factor")
    if (
        isinstance(factor, bool)
        or not isinstance(factor, int | float)
        or not math.isfinite(factor)
        or factor < 1
    ):
        raise ConfigError(key, f"factor {factor!r} is not a number >= 1",
                          "set model.rope_scaling.factor, e.g. 4.0")  # fmt: skip
    own = int(text.get("max_position_embeddings") or 0)
    original = rope_scaling.get("original_max_position_embeddings", own)
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        what = f"original_max_position_embeddings {original!r} is not a positive whole number"
        raise ConfigError(key, what, f"set it to the model's positions ({own})")
    if original > MAX_POSITIONS or factor * original > MAX_POSITIONS:
        raise ConfigError(key, f"factor {factor!r} x {original} positions is more than "
                          f"{MAX_POSITIONS} positions",
                          "set a smaller model.rope_scaling.factor")  # fmt: skip
    own_rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = text.get("rope_theta", own_rope.get("rope_theta"))
    params = {k: v for k, v in rope_scaling.items() if k != "type"}
    params = {**({"rope_theta": theta} if theta else {}), **params, "rope_type": rope_type}
    params["original_max_position_embeddings"] = original
    positions = int(factor * original)
    kept = own if rope_type == "dynamic" else positions
    return {"rope_parameters": params, "max_position_embeddings": kept, "positions": positions}
