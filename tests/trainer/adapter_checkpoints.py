"""The model an adapter checkpoint holds, as the engine trained it, and the logits the export
tests compare (tests/trainer/test_finetune.py, tests/trainer/test_lowbit.py)."""

from __future__ import annotations

from pathlib import Path

import torch


def engine_model(ckpt: Path) -> torch.nn.Module:
    """The model the engine trained, rebuilt from the checkpoint's config (a QLoRA base is
    quantised again) and its adapter weights; every adapter weight is in the checkpoint."""
    from trainer.checkpoint.layout import read_full_weights
    from trainer.core.config import load_config
    from trainer.model.build import HFModelFactory
    from trainer.model.finetune import FinetuneFactory

    cfg = load_config(ckpt / "config.yaml", [])
    model = FinetuneFactory(HFModelFactory(cfg.model, cfg.train.seed), cfg).build("cpu")
    missing, _ = model.load_state_dict(read_full_weights(ckpt), strict=False)
    assert not [n for n in missing if ".lora_" in n]
    return model.eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    """fp32 logits of two fixed rows of 20 tokens of the demo vocabulary."""
    ids = torch.arange(40).reshape(2, 20) % 45
    with torch.no_grad():
        return model(input_ids=ids).logits.float()
