"""`oomless export` and the run's own `final/`: a Hugging Face model directory from full weights.

Export never deletes what it did not write: it refuses a non-empty OUT_DIR unless `--overwrite`,
refuses an OUT_DIR that is, lies inside or contains the run or checkpoint directory, and builds
the model directory in a fresh temporary sibling that replaces OUT_DIR with one rename. Whether
Hub code may run (`trust_remote_code`) comes from the export command line only, never from the
checkpoint's own config.yaml: exporting someone else's checkpoint must not run their code.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from trainer.config import ConfigError, ModelConfig, read_yaml
from trainer.contract import CONFIG_FILE
from trainer.files import fsync_dir, umask_mode


def save_hf_model(
    hf_config: Any,
    state_dict: dict[str, torch.Tensor],
    out_dir: str | Path,
    tokenizer: Any | None = None,
    trust_remote_code: bool = False,
    replace: bool = False,
) -> Path:
    """Save fp32 weights as an HF directory, atomically (a new temporary sibling, then rename).

    An existing non-empty `out_dir` is replaced only with `replace`; nothing else next to it is
    touched. The model is instantiated on the meta device and the weights are assigned, so no
    second copy of the weights is allocated.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards": the run prints its own lines

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        os.chmod(tmp, umask_mode())
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                hf_config, dtype=torch.float32, trust_remote_code=trust_remote_code
            )
        model.load_state_dict(state_dict, strict=False, assign=True)
        model.tie_weights()
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:
            raise RuntimeError(
                f"final weights are missing {len(missing)} tensors, e.g. {missing[0]}"
            )
        model.config.use_cache = True
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _install(tmp, out_dir, replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _install(tmp: Path, out_dir: Path, replace: bool) -> None:
    """Rename `tmp` to `out_dir`; a non-empty `out_dir` is moved aside first, only if `replace`."""
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()
    if not out_dir.exists():
        tmp.rename(out_dir)
    elif not replace:
        raise FileExistsError(f"{out_dir} is not empty")
    else:
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
        old.rmdir()
        out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(out_dir.parent)


def export_command(
    checkpoint: str, out_dir: str, overwrite: bool = False, trust_remote_code: bool = False
) -> int:
    """`oomless export CHECKPOINT OUT`: an HF model directory from any strategy's checkpoint."""
    from trainer.checkpoint import find_latest, is_complete, read_full_weights
    from trainer.model import load_hf_config

    path = Path(checkpoint).expanduser().resolve()
    if path.is_dir() and (path / "checkpoints").is_dir():
        path = find_latest(path) or path
    if not is_complete(path):
        raise ConfigError(
            "CHECKPOINT", f"'{checkpoint}' is not a complete checkpoint", "give checkpoints/step_N"
        )
    out = check_out_dir(path, Path(out_dir), overwrite)
    tree = read_yaml((path / CONFIG_FILE).read_text())["model"]
    model_cfg = ModelConfig.model_validate(dict(tree, trust_remote_code=trust_remote_code))
    hf_config = _load_hf_config(load_hf_config, model_cfg)
    weights = read_full_weights(path)
    tokenizer = None
    if (path / "tokenizer").is_dir():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer")
    save_hf_model(hf_config, weights, out, tokenizer, trust_remote_code, replace=overwrite)
    print(f"wrote {out} ({len(weights)} tensors) from {path}")
    return 0


def check_out_dir(checkpoint: Path, out_dir: Path, overwrite: bool) -> Path:
    """The resolved OUT_DIR, or a ConfigError when writing there could lose the user's files."""
    out = out_dir.expanduser().resolve()
    protected = [checkpoint]
    if checkpoint.parent.name == "checkpoints":
        protected.append(checkpoint.parent.parent)  # the run directory
    for p in protected:
        if out == p or p in out.parents:
            raise ConfigError(
                "OUT_DIR", f"'{out_dir}' is inside {p}", "export to a directory outside the run"
            )
        if out in p.parents:
            raise ConfigError(
                "OUT_DIR", f"'{out_dir}' contains {p}", "export to a directory outside the run"
            )
    if out.exists() and not out.is_dir():
        raise ConfigError("OUT_DIR", f"'{out_dir}' is a file", "give a directory path")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(
            "OUT_DIR",
            f"'{out_dir}' is not empty",
            "give a new or empty directory, or pass --overwrite to replace its contents",
        )
    return out


def _load_hf_config(load: Any, model_cfg: ModelConfig) -> Any:
    try:
        return load(model_cfg)
    except ValueError as err:
        if "trust_remote_code" not in str(err):
            raise
        raise ConfigError(
            "--trust-remote-code",
            f"the checkpoint's model '{model_cfg.name_or_path}' runs its own Python code",
            "pass --trust-remote-code only if you trust that code",
        ) from None
