"""`oomless export` and the run's own `final/`: a Hugging Face model directory from full weights,
or for lora/qlora runs a PEFT adapter directory (`--merge`: a plain HF model, adapters merged).

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

from trainer.core.config import ConfigError, FinetuneConfig, JobConfig, ModelConfig, read_yaml
from trainer.core.contract import CONFIG_FILE
from trainer.core.files import fsync_dir, umask_mode


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


def save_final_model(
    cfg: JobConfig, hf_config: Any, weights: dict[str, torch.Tensor], out_dir: Path, tokenizer: Any
) -> Path:
    """run.dir/final: the HF model of a full fine-tune, the PEFT adapter dir of lora/qlora."""
    if cfg.finetune.method == "full":
        return save_hf_model(
            hf_config, weights, out_dir, tokenizer, cfg.model.trust_remote_code, replace=True
        )
    return save_adapter(cfg.finetune, cfg.model, hf_config, weights, out_dir, tokenizer, True)


def _peft_model(
    finetune: FinetuneConfig, base: torch.nn.Module, weights: dict[str, torch.Tensor]
) -> Any:
    """`base` (plain HF model, maybe on meta) with the run's LoRA adapters, their trained weights
    loaded (QLoRA adapters go onto the unquantised base: the structure and names are the same)."""
    from trainer.finetune import apply_finetune

    lora = finetune.model_copy(update={"method": "lora"})
    model = apply_finetune(base, lora, "fp32", seed=0)
    adapters = {n: t.float() for n, t in weights.items() if ".lora_" in n}
    names = {n for n, _ in model.named_parameters() if ".lora_" in n}
    if not adapters or names - set(adapters):
        raise ConfigError(
            "CHECKPOINT",
            f"has {len(adapters)} of the {len(names)} adapter weights this config's LoRA has",
            "export the checkpoint with the config it was trained with",
        )
    model.load_state_dict(adapters, strict=False, assign=True)
    return model


def save_adapter(
    finetune: FinetuneConfig,
    model_cfg: ModelConfig,
    hf_config: Any,
    weights: dict[str, torch.Tensor],
    out_dir: str | Path,
    tokenizer: Any | None = None,
    replace: bool = False,
) -> Path:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors), atomically;
    `PeftModel.from_pretrained(base, out_dir)` loads it. The base is built on the meta device:
    only the adapters are written."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        os.chmod(tmp, umask_mode())
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(
                hf_config, dtype=torch.float32, trust_remote_code=model_cfg.trust_remote_code
            )
        model = _peft_model(finetune, base, weights)
        model.peft_config["default"].base_model_name_or_path = model_cfg.name_or_path
        model.peft_config["default"].revision = model_cfg.revision
        model.save_pretrained(tmp, save_embedding_layers=False)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _install(tmp, out_dir, replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def merged_weights(
    finetune: FinetuneConfig, model_cfg: ModelConfig, seed: int, weights: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The base's fp32 weights (pretrained, or the seeded init of an inline config) with the
    trained adapters merged in: a plain HF model's state dict."""
    from trainer.model import HFModelFactory

    base = HFModelFactory(model_cfg, seed).build("cpu")
    merged = _peft_model(finetune, base, weights).merge_and_unload()
    return {n: t.detach() for n, t in merged.state_dict().items()}


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
    checkpoint: str,
    out_dir: str,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    merge: bool = False,
) -> int:
    """`oomless export CHECKPOINT OUT`: an HF model directory from any strategy's checkpoint; a
    PEFT adapter directory from a lora/qlora run's, or with `merge` the merged HF model."""
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
    saved = read_yaml((path / CONFIG_FILE).read_text())
    model_cfg = ModelConfig.model_validate(
        dict(saved["model"], trust_remote_code=trust_remote_code)
    )
    finetune = FinetuneConfig.model_validate(saved.get("finetune") or {})
    if merge and finetune.method == "full":
        raise ConfigError(
            "--merge",
            "the checkpoint is a full fine-tune: it has no adapters to merge",
            "drop --merge",
        )
    hf_config = _load_hf_config(load_hf_config, model_cfg)
    weights = read_full_weights(path)
    tokenizer = None
    if (path / "tokenizer").is_dir():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer")
    if finetune.method != "full" and not merge:
        save_adapter(finetune, model_cfg, hf_config, weights, out, tokenizer, replace=overwrite)
        print(f"wrote the {finetune.method} adapters to {out} ({len(weights)} tensors) from {path}")
        return 0
    if merge:
        seed = int((saved.get("train") or {}).get("seed", 0))
        weights = merged_weights(finetune, model_cfg, seed, weights)
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
