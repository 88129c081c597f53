"""The two-process trainings of tests/trainer/test_lowbit.py, one after another in ONE torchrun
launch: `torchrun ... lowbit_worker.py BASE_CONFIG WORK_DIR`. Each is the real engine
(`run_training`) with its own run dir under WORK_DIR; the test reads their files afterwards."""

from __future__ import annotations

import sys
from pathlib import Path

# wide enough that bitsandbytes keeps 8-bit moments for the matrices (4096+ elements) and that
# their rows hold whole blocks of 256 (hidden 256): each FSDP2 shard holds whole blocks
WIDE = (
    "model.config={model_type: llama, vocab_size: 45, hidden_size: 256, intermediate_size: 512, "
    "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, "
    "max_position_embeddings: 256}"
)
ADAMW_8BIT = (WIDE, "train.optimizer=adamw_8bit", "run.checkpoint_every=2")
# the base model's matrices (64 or 128 wide, 4096+ values): a replica quantises them in blocks
# that run across rows, an FSDP2 shard keeps fp32 moments; checkpoints hold them as fp32 moments
ODD_8BIT = ("train.optimizer=adamw_8bit", "run.checkpoint_every=2")
# LoRA r=16 on the wide model: lora_B [256, 16] is 8-bit on a replica, fp32 on a shard; lora_A
# [16, 256] holds whole blocks per row
LORA_8BIT = (
    WIDE,
    *ODD_8BIT,
    "finetune.method=lora",
    "finetune.lora.r=16",
    "finetune.lora.alpha=32",
)
# QLoRA's 4-bit base (bf16 compute), adapters of rank 4 on every linear of the blocks
QLORA = (
    WIDE,
    "finetune.method=qlora",
    "finetune.lora.r=4",
    "finetune.lora.alpha=8",
    "precision=bf16",
    "run.checkpoint_every=2",
)
# the model tests/trainer/saved_model.py saves, loaded by two QLoRA runs: ddp (transformers'
# from_pretrained on each rank, quantised whole) and fsdp (each rank quantising its own rows)
PRETRAINED = ("model.name_or_path={work}/pretrained", "model.config=null", "train.steps=2")
# name: overrides of the base config (fp32, 2 ranks x micro-batch 4 = global batch 8, no
# accumulation, no clipping); `{work}` is WORK_DIR
RUNS = {
    "fsdp_8bit": ("strategy=fsdp", *ADAMW_8BIT),
    "fsdp_8bit_resumed": (
        "strategy=fsdp",
        *ADAMW_8BIT,
        "run.resume={work}/fsdp_8bit/checkpoints/step_2",
    ),
    # the 8-bit moments of one process, resharded by rows onto two
    "fsdp_8bit_from_single": (
        "strategy=fsdp",
        *ADAMW_8BIT,
        "run.resume={work}/single_8bit/checkpoints/step_2",
    ),
    "fsdp_offload_8bit": ("strategy=fsdp_offload", *ADAMW_8BIT),
    # paged_adamw_8bit: on CPU processes it runs as adamw_8bit (no CUDA memory to page)
    "fsdp_paged_8bit": ("strategy=fsdp", *ADAMW_8BIT, "train.optimizer=paged_adamw_8bit"),
    "fsdp_paged_8bit_resumed": (
        "strategy=fsdp",
        *ADAMW_8BIT,
        "train.optimizer=paged_adamw_8bit",
        "run.resume={work}/fsdp_paged_8bit/checkpoints/step_2",
    ),
    # every move of 8-bit moments between replica and shard layouts, full and LoRA
    # (tests/trainer/test_lowbit.py::test_8bit_moments_of_any_shape_move_between_every_rung)
    "ddp_8bit_odd": ("strategy=ddp", *ODD_8BIT),
    "fsdp_8bit_odd": ("strategy=fsdp", *ODD_8BIT),
    "fsdp_8bit_odd_from_ddp": (
        "strategy=fsdp",
        *ODD_8BIT,
        "run.resume={work}/ddp_8bit_odd/checkpoints/step_2",
    ),
    "ddp_8bit_odd_from_fsdp": (
        "strategy=ddp",
        *ODD_8BIT,
        "run.resume={work}/fsdp_8bit_odd/checkpoints/step_2",
    ),
    "fsdp_offload_8bit_odd_from_single": (
        "strategy=fsdp_offload",
        *ODD_8BIT,
        "run.resume={work}/single_8bit_odd/checkpoints/step_2",
    ),
    "fsdp_lora_8bit": ("strategy=fsdp", *LORA_8BIT),
    "fsdp_bf16_pure_8bit": ("strategy=fsdp", *ODD_8BIT, "precision=bf16_pure"),
    "ddp_lora_8bit_from_fsdp": (
        "strategy=ddp",
        *LORA_8BIT,
        "run.resume={work}/fsdp_lora_8bit/checkpoints/step_2",
    ),
    "fsdp_lora_8bit_from_single": (
        "strategy=fsdp",
        *LORA_8BIT,
        "run.resume={work}/single_lora_8bit/checkpoints/step_2",
    ),
    "ddp_qlora": ("strategy=ddp", *QLORA),
    "fsdp_qlora": ("strategy=fsdp", *QLORA, "run.save_final=true"),
    "fsdp_qlora_resumed": (
        "strategy=fsdp",
        *QLORA,
        "run.resume={work}/fsdp_qlora/checkpoints/step_2",
    ),
    "fsdp_offload_qlora": ("strategy=fsdp_offload", *QLORA),
    "ddp_qlora_pretrained": ("strategy=ddp", *QLORA, *PRETRAINED),
    "fsdp_qlora_pretrained": ("strategy=fsdp", *QLORA, *PRETRAINED),
    "fsdp_fp32": ("strategy=fsdp",),
    "fsdp_in_backward": ("strategy=fsdp", "train.optimizer_in_backward=true"),
    "fsdp_bf16_pure": ("strategy=fsdp", "precision=bf16_pure", "run.checkpoint_every=2"),
    "ddp_bf16_pure": ("strategy=ddp", "precision=bf16_pure"),
    "fsdp_offload_bf16_pure_in_backward": (
        "strategy=fsdp_offload",
        "precision=bf16_pure",
        "train.optimizer_in_backward=true",
    ),
}


def main() -> int:
    base, work = sys.argv[1], Path(sys.argv[2])
    from trainer.core.config import load_config
    from trainer.engine import run_training

    for name, overrides in RUNS.items():
        overrides = [o.replace("{work}", str(work)) for o in overrides]
        code = run_training(load_config(base, [*overrides, f"run.dir={work / name}"]))
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    from trainer.runtime.dist import exit_without_teardown

    exit_without_teardown(main())
