"""What DPO's reference log-probs depend on, so that a cached or resumed reference is never one
of another model (docs/preference.md, "The reference").

- `base_identity`: the model training starts from, by content: the resolved HF config (the
  model's config.json or inline config, `model.rope_scaling` applied) and the SHA-256 of every
  file of its directory that changes its numbers (trainer/core/file_hashes.py: every byte,
  hashed once per file version and cached by oomless, never beside the weights). A checkpoint
  keeps it (`reference` in trainer_state.json); a resume whose base differs is refused.
- `reference_cache_key`: the base identity, and everything else the reference pass reads: the
  tokenised data (training and held-out: the tokenizer's tokens), the pairs' windows (seq_len,
  the held-out split), precision, attention implementation, the torch and transformers
  versions.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import transformers

from trainer.core.config import ConfigError, JobConfig, ModelConfig
from trainer.core.file_hashes import model_file_digests, model_root
from trainer.core.hf_config import hf_config_dict, rope_update, text_config

# config.json entries that say where a file came from, not what the model computes
_PROVENANCE = ("_name_or_path", "transformers_version", "_commit_hash")


def resolved_model_config(model_cfg: ModelConfig) -> dict[str, Any]:
    """The HF config dict the model is built from: config.json (or the inline config) with
    `model.rope_scaling` applied, as trainer/model/build.py applies it."""
    hf = hf_config_dict(model_cfg.config, model_cfg.name_or_path)
    hf = {k: v for k, v in hf.items() if k not in _PROVENANCE}
    if model_cfg.rope_scaling is not None:
        update = rope_update(hf, model_cfg.rope_scaling)
        text = dict(text_config(hf))
        text["rope_parameters"] = update["rope_parameters"]
        text["max_position_embeddings"] = update["max_position_embeddings"]
        hf = {**hf, "text_config": text} if "text_config" in hf else text
    return hf


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def base_identity(model_cfg: ModelConfig) -> dict[str, Any]:
    """{"config": digest of the resolved config, "files": {name: sha256} or None}: None for a
    Hub model not in the local cache (nothing to hash); {} for an inline config (seeded init:
    `train.seed` is checked with the other math keys)."""
    files: dict[str, str] | None = {}
    if model_cfg.name_or_path is not None:
        root = model_root(model_cfg.name_or_path, model_cfg.revision)
        files = model_file_digests(root) if root is not None else None
    return {"config": _digest(resolved_model_config(model_cfg)), "files": files}


def check_same_reference(saved: dict[str, Any] | None, model_cfg: ModelConfig, path: Any) -> None:
    """ConfigError (one line) when the checkpoint at `path` was trained against a reference (or
    on a base) other than the one `model_cfg` now gives: its config or any of its files
    changed since. A checkpoint without one, or a base not available locally, passes."""
    if not saved:
        return
    what = _what_changed(saved, base_identity(model_cfg))
    if what is None:
        return
    source = model_cfg.name_or_path or "the inline model.config"
    raise ConfigError(
        "run.resume",
        f"checkpoint {path} was trained from another base than {source} now holds ({what}): "
        "its reference log-probs and its starting weights would differ",
        "resume with the base it was trained from (restore its files), or set "
        "run.resume=never (or a new run.dir)",
    )


def _what_changed(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """What differs between two base identities, in words; None when nothing (or nothing that
    can be compared: a base not available locally)."""
    if saved.get("config") != now["config"]:
        return "its config.json or model.rope_scaling changed"
    old, new = saved.get("files"), now["files"]
    if old is None or new is None or old == new:
        return None
    for name in sorted(set(old) | set(new)):
        if name not in new:
            return f"{name} is gone"
        if name not in old:
            return f"{name} was added"
        if old[name] != new[name]:
            return f"{name} changed: sha256 {old[name][:12]} -> {new[name][:12]}"
    return None


def reference_cache_key(cfg: JobConfig, data: Any, num_pairs: list[int]) -> str:
    """A digest of everything the precomputed reference's numbers depend on (module docstring)."""
    key = {
        "base": base_identity(cfg.model),
        "model_config": resolved_model_config(cfg.model),
        "trust_remote_code": cfg.model.trust_remote_code,
        "attn": cfg.model.attn_implementation,
        "precision": cfg.precision,
        "data": data.fingerprint,
        "eval": data.eval_fingerprint,
        "pairs": num_pairs,
        "eval_fraction": cfg.data.eval_fraction,
        "seq_len": cfg.data.seq_len,
        "seed": cfg.train.seed,
        "versions": [torch.__version__, transformers.__version__],
    }
    return _digest(key)[:24]
