"""Writing a Hugging Face model directory (safetensors + config + tokenizer) from full weights."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch


def save_hf_model(
    hf_config: Any,
    state_dict: dict[str, torch.Tensor],
    out_dir: str | Path,
    tokenizer: Any | None = None,
    trust_remote_code: bool = False,
) -> Path:
    """Save fp32 weights as an HF directory, atomically (temp dir, then rename).

    The model is instantiated on the meta device and the weights are assigned, so no second copy
    of the weights is allocated.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards": the run prints its own lines

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            hf_config, dtype=torch.float32, trust_remote_code=trust_remote_code
        )
    model.load_state_dict(state_dict, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"final weights are missing {len(missing)} tensors, e.g. {missing[0]}")
    model.config.use_cache = True
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir
