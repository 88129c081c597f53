"""`oomless export` and the run's own `final/`: a Hugging Face model directory from full weights,
or for lora/qlora runs a PEFT adapter directory (`--merge`: a plain HF model, adapters merged).

CHECKPOINT is a checkpoint (`checkpoints/step_N`, verified against its manifest), a run directory
(its newest good checkpoint) or a run's `final/` (which carries the run's config.yaml and, for
adapters, the base they trained on in trainer_state.json). `--merge` refuses a base whose weights
changed since training, as resume does.

Export never deletes what it did not write: it refuses a non-empty OUT_DIR unless `--overwrite`,
refuses an OUT_DIR that is, lies inside or contains the run or checkpoint directory, that is or
contains the base model, the data or the current directory, and builds the model directory in a
fresh temporary sibling that replaces OUT_DIR with one rename. Whether
Hub code may run (`trust_remote_code`) comes from the export command line only, never from the
checkpoint's own config.yaml: exporting someone else's checkpoint must not run their code.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from trainer.checkpoint.layout import read_full_weights
from trainer.checkpoint.manifest import STATE_FILE
from trainer.checkpoint.store import check_intact, find_latest, is_complete
from trainer.core.config import (
    ConfigError,
    FinetuneConfig,
    JobConfig,
    ModelConfig,
    dump_config,
    read_yaml,
)
from trainer.core.contract import CONFIG_FILE
from trainer.core.errors import disk_full, no_space
from trainer.core.files import fsync_dir, umask_mode
from trainer.model.build import HFModelFactory, load_hf_config
from trainer.model.finetune import ADAPTER_NAME, apply_finetune, base_pointer, check_same_base
from trainer.model.pretrained import INDEX_FILE, SINGLE_FILE

log = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def save_hf_model(
    hf_config: Any,
    state_dict: dict[str, torch.Tensor],
    out_dir: str | Path,
    tokenizer: Any | None = None,
    trust_remote_code: bool = False,
    replace: bool = False,
    side_files: dict[str, str] | None = None,
) -> Path:
    """Save fp32 weights as an HF directory, atomically (a new temporary sibling, then rename).

    An existing non-empty `out_dir` is replaced only with `replace`; nothing else next to it is
    touched. The model is instantiated on the meta device and the weights are assigned, so no
    second copy of the weights is allocated. It generates with the KV cache on (training turns it
    off in the config, and transformers carries that into generation_config.json).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards": the run prints its own lines

    out_dir = Path(out_dir)
    with _staged(out_dir, replace, tokenizer, side_files, state_dict) as tmp:
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
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.use_cache = True
        model.save_pretrained(tmp, safe_serialization=True)
    return out_dir


@contextlib.contextmanager
def _staged(
    out_dir: Path,
    replace: bool,
    tokenizer: Any | None,
    side_files: dict[str, str] | None,
    weights: dict[str, torch.Tensor],
) -> Iterator[Path]:
    """A fresh temporary sibling of `out_dir` to save into; when the body succeeds the tokenizer
    and the side files join it and it replaces `out_dir` in one rename. Removed either way; a
    full disk is one line (OUT_DIR, the bytes of `weights` needed and those free)."""
    tmp: Path | None = None
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
        os.chmod(tmp, umask_mode())
        yield tmp
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _write_side_files(tmp, side_files)
        _install(tmp, out_dir, replace)
    except BaseException as err:
        full = disk_full(err)
        if full is None:
            raise
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise no_space(
            "OUT_DIR",
            out_dir,
            "the model",
            sum(t.numel() * t.element_size() for t in weights.values()),
            full,
            "free space there, or write it to another directory",
        ) from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def save_final_model(
    cfg: JobConfig, hf_config: Any, weights: dict[str, torch.Tensor], out_dir: Path, tokenizer: Any
) -> Path:
    """run.dir/final: the HF model of a full fine-tune, the PEFT adapter dir of lora/qlora; with
    the run's config.yaml and trainer_state.json (the step; for adapters the base they trained
    on), so that `oomless export RUN/final OUT --merge` knows the base and can check it."""
    state: dict[str, Any] = {"step": cfg.train.steps}
    if cfg.finetune.method != "full":
        state["base"] = base_pointer(cfg.model)
    side = {CONFIG_FILE: dump_config(cfg), STATE_FILE: json.dumps(state, indent=2) + "\n"}
    try:
        if cfg.finetune.method == "full":
            return save_hf_model(
                hf_config, weights, out_dir, tokenizer, cfg.model.trust_remote_code, True, side
            )
        return save_adapter(
            cfg.finetune, cfg.model, hf_config, weights, out_dir, tokenizer, True, side
        )
    except ConfigError as err:  # a full disk: the run's key and what running again does
        if err.key != "OUT_DIR":
            raise
        again = (
            "the last step is in a checkpoint, so it trains nothing and writes final/"
            if cfg.run.checkpoint_every
            else "it resumes from its newest checkpoint"
        )
        raise ConfigError(
            "run.dir", err.problem, f"free space there and run again: {again}"
        ) from None


def _write_side_files(directory: Path, files: dict[str, str] | None) -> None:
    for name, text in (files or {}).items():
        (directory / name).write_text(text)


def _peft_model(
    finetune: FinetuneConfig, base: torch.nn.Module, weights: dict[str, torch.Tensor]
) -> Any:
    """`base` (plain HF model, maybe on meta) with the run's LoRA adapters, their trained weights
    loaded (QLoRA adapters go onto the unquantised base: the structure and names are the same)."""
    lora = finetune.model_copy(update={"method": "lora"})
    model = apply_finetune(base, lora, "fp32", seed=0)
    names = {n for n, _ in model.named_parameters() if ".lora_" in n}
    adapters = {}
    for name in names:  # a checkpoint's names hold the adapter's name, peft's saved files do not
        key = next(
            (k for k in (name, name.replace(f".{ADAPTER_NAME}.", ".")) if k in weights), None
        )
        if key is not None:
            adapters[name] = weights[key].float()
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
    side_files: dict[str, str] | None = None,
) -> Path:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors), atomically;
    `PeftModel.from_pretrained(base, out_dir)` loads it. The base is built on the meta device:
    only the adapters are written."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    with _staged(out_dir, replace, tokenizer, side_files, weights) as tmp:
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(
                hf_config, dtype=torch.float32, trust_remote_code=model_cfg.trust_remote_code
            )
        model = _peft_model(finetune, base, weights)
        model.peft_config["default"].base_model_name_or_path = model_cfg.name_or_path
        model.peft_config["default"].revision = model_cfg.revision
        model.save_pretrained(tmp, save_embedding_layers=False)
    return out_dir


def merged_weights(
    finetune: FinetuneConfig, model_cfg: ModelConfig, seed: int, weights: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The base's fp32 weights (pretrained, or the seeded init of an inline config) with the
    trained adapters merged in: a plain HF model's state dict."""
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


_EXPORT_TRIES = 5


def export_command(
    checkpoint: str, out_dir: str, overwrite: bool = False, trust_remote_code: bool = False,
    merge: bool = False,
) -> int:  # fmt: skip
    """`oomless export CHECKPOINT OUT`: an HF model directory from any strategy's checkpoint or a
    run's final/; a PEFT adapter directory from a lora/qlora run's, or with `merge` the merged HF
    model. The path written goes to stdout.

    From a run directory that a live run prunes (`run.keep_checkpoints`), the newest checkpoint
    can vanish while it is read: export then takes the newest again (a few times)."""
    source: list[Path] = []
    for _ in range(_EXPORT_TRIES):
        try:
            return _export(checkpoint, out_dir, overwrite, trust_remote_code, merge, source)
        except (OSError, ConfigError) as err:
            if not _pruned_meanwhile(checkpoint, source, err):
                raise
            log.warning("%s was removed while it was read (pruned by the run): taking the "
                        "newest checkpoint again", source[-1])  # fmt: skip
    raise ConfigError(
        "CHECKPOINT",
        f"the checkpoints of '{checkpoint}' were removed while they were read, "
        f"{_EXPORT_TRIES} times (the run prunes them: run.keep_checkpoints)",
        "export again, or export when the run has ended or with more run.keep_checkpoints",
    )


def _pruned_meanwhile(checkpoint: str, source: list[Path], err: Exception) -> bool:
    """The checkpoint export chose from a run directory is gone (FileNotFoundError, or found
    damaged half-way through its removal)."""
    run = Path(checkpoint).expanduser()
    if not (run / "checkpoints").is_dir() or not source or source[-1].parent.name != "checkpoints":
        return False
    gone = not is_complete(source[-1])
    return gone and (isinstance(err, FileNotFoundError) or isinstance(err, ConfigError))


def _export(
    checkpoint: str, out_dir: str, overwrite: bool, trust_remote_code: bool, merge: bool,
    source: list[Path],
) -> int:  # fmt: skip
    path = _export_source(checkpoint)
    source.append(path)
    saved = read_yaml(_config_file(path).read_text()) or {}
    out = check_out_dir(path, Path(out_dir), overwrite, saved)
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
    if merge:
        _check_same_base(path, model_cfg)
    hf_config = _load_hf_config(load_hf_config, model_cfg)
    weights = read_full_weights(path) if is_complete(path) else _final_weights(path)
    tokenizer = None
    if (tokenizer_dir := path / "tokenizer" if is_complete(path) else path).is_dir():
        from transformers import AutoTokenizer

        if any(tokenizer_dir.glob("tokenizer*")):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if finetune.method != "full" and not merge:
        save_adapter(finetune, model_cfg, hf_config, weights, out, tokenizer, replace=overwrite)
        log.info("wrote the %s adapters (%d tensors) from %s", finetune.method, len(weights), path)
        print(out)
        return 0
    if merge:
        seed = int((saved.get("train") or {}).get("seed", 0))
        weights = merged_weights(finetune, model_cfg, seed, weights)
    save_hf_model(hf_config, weights, out, tokenizer, trust_remote_code, replace=overwrite)
    log.info("wrote the model (%d tensors) from %s", len(weights), path)
    print(out)
    return 0


def _export_source(checkpoint: str) -> Path:
    """The checkpoint (verified against its manifest) or final/ model directory to export."""
    path = Path(checkpoint).expanduser().resolve()
    if path.is_dir() and (path / "checkpoints").is_dir():
        path = find_latest(path) or path
    if is_complete(path):
        check_intact(path, "CHECKPOINT")
        return path
    weights = (ADAPTER_WEIGHTS, SINGLE_FILE, INDEX_FILE)
    if any((path / name).is_file() for name in weights) and _config_file(path).is_file():
        return path  # a run's final/
    raise ConfigError(
        "CHECKPOINT",
        f"'{checkpoint}' is not a complete checkpoint or a run's final/ model",
        "give RUN, RUN/final or RUN/checkpoints/step_N",
    )


def _config_file(path: Path) -> Path:
    """The run's config.yaml: in the checkpoint or final/, or (a final/ written before final/
    held one) in the run directory above it."""
    return path / CONFIG_FILE if (path / CONFIG_FILE).is_file() else path.parent / CONFIG_FILE


def _final_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a final/ directory: the adapters, or the model's safetensors files."""
    if (path / ADAPTER_WEIGHTS).is_file():
        return load_file(str(path / ADAPTER_WEIGHTS))
    files = [SINGLE_FILE]
    if (path / INDEX_FILE).is_file():
        files = sorted(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values()))
    return {k: t for name in files for k, t in load_file(str(path / name)).items()}


def _check_same_base(path: Path, model_cfg: ModelConfig) -> None:
    """Refuse (one line) to merge adapters onto a base other than the one they trained on."""
    state_file = path / STATE_FILE
    saved = json.loads(state_file.read_text()).get("base") if state_file.is_file() else None
    check_same_base(saved, model_cfg, path, "--merge", "merge onto the base they were trained "
                    "on, or export without --merge (a PEFT adapter dir)")  # fmt: skip


def check_out_dir(
    checkpoint: Path, out_dir: Path, overwrite: bool, saved: dict[str, Any] | None = None
) -> Path:
    """The resolved OUT_DIR, or a ConfigError when writing there could lose the user's files:
    OUT_DIR is, lies inside or contains the run or checkpoint; is or contains the base model,
    the tokenizer, the data or the current directory; lies inside the base model's or the data's
    directory (the base's fingerprint, or the data read next time, would change)."""
    out = out_dir.expanduser().resolve()
    run = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent
    inside_too = [("the run", run)] if (run / CONFIG_FILE).is_file() else []
    inside_too.append(("the checkpoint", checkpoint))
    holds = [("the current directory", Path.cwd())]
    for what, p in _inputs(saved or {}):  # files written into these dirs would be read back
        (inside_too if p.is_dir() and what != "the tokenizer" else holds).append((what, p))
    for what, p in inside_too + holds:
        if out == p or out in p.parents:
            problem = f"'{out_dir}' is {what} ({p})" if out == p else f"'{out_dir}' holds {what}"
        elif p in out.parents and (what, p) in inside_too:
            problem = f"'{out_dir}' is inside {what} ({p})"
        else:
            continue
        raise ConfigError(
            "OUT_DIR", f"{problem}: writing there could delete it", "export to a new directory"
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


def _inputs(saved: dict[str, Any]) -> list[tuple[str, Path]]:
    """The local paths the run read: the base model, its tokenizer, the data."""
    paths = [
        ("the base model", (saved.get("model") or {}).get("name_or_path")),
        ("the tokenizer", (saved.get("model") or {}).get("tokenizer")),
        ("the data", (saved.get("data") or {}).get("path")),
    ]
    found = []
    for what, value in paths:
        if isinstance(value, str) and value and (p := Path(value).expanduser()).exists():
            found.append((what, p.resolve()))
    return found


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
