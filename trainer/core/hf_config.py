"""The model's Hugging Face config as a plain dict, offline and without torch.

Sources: an inline `model.config`, a local directory with `config.json`, or a hub id that names a
preset shipped inside the package in `trainer/core/presets/` (its `index.yaml` maps hub ids to
preset files; read with importlib.resources, so an installed wheel has them too).
The config validator (positions), the launcher (shape, estimate) and the engine all read it here.
"""

from __future__ import annotations

import json
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
