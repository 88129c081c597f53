"""Runs several trainings one after another in ONE torchrun launch (each torchrun start costs
seconds, and the process group is reused): `torchrun ... dist_worker.py BASE_CONFIG WORK_DIR`.

Every run is the real engine (`run_training`) with its own run dir under WORK_DIR; the test reads
their metrics.jsonl files and checkpoints afterwards.
"""

from __future__ import annotations

import sys
from pathlib import Path

RUNS: dict[str, list[str]] = {
    "ddp_fp32": ["strategy=ddp"],
    "fsdp_fp32": ["strategy=fsdp", "run.checkpoint_every=4"],
    "fsdp_offload_fp32": ["strategy=fsdp_offload"],
    # gradients reduce-scattered after each of the 2 micro-batches, accumulated sharded
    "fsdp_every_micro_fp32": ["strategy=fsdp", "fsdp.reduce_every_micro_batch=true"],
    # HSDP: the two ranks as two "nodes" of one device each: replicate x shard = 2 x 1
    "fsdp_hybrid_fp32": [
        "strategy=fsdp",
        "fsdp.hybrid=true",
        "hardware.nodes=2",
        "hardware.devices_per_node=1",
    ],
    # each decoder layer torch.compiled, inside its checkpoint wrapper and under fully_shard
    "fsdp_compiled_fp32": [
        "strategy=fsdp",
        "train.compile=true",
        "memory.activation_checkpointing=full",
    ],
    # the exact memory levers (compared with fsdp_fp32 and zero3_fp32): chunked loss over
    # 6 chunks of a micro-batch's 128 positions, activation offload, both with full recomputation
    # (ZeRO-3 leaves out offload alone, to save a DeepSpeed start: the both-levers run has it)
    **{
        f"{strategy}_{name}": [f"strategy={strategy}", *levers]
        for strategy in ("fsdp", "zero3")
        for name, levers in (
            ("chunked_loss", ["memory.chunked_loss=true", "memory.loss_chunk_tokens=24"]),
            ("offload_activations", ["memory.offload_activations=true"]),
            (
                "both_levers_full",
                [
                    "memory.chunked_loss=true",
                    "memory.loss_chunk_tokens=24",
                    "memory.offload_activations=true",
                    "memory.activation_checkpointing=full",
                ],
            ),
        )
        if (strategy, name) != ("zero3", "offload_activations")
    },
    "ddp_bf16": ["strategy=ddp", "precision=bf16"],
    "fsdp_bf16": ["strategy=fsdp", "precision=bf16"],
    "zero2_bf16": ["strategy=zero2", "precision=bf16"],
    "zero3_offload_bf16": ["strategy=zero3_offload", "precision=bf16"],
    "ddp_micro2": ["strategy=ddp", "train.micro_batch_size=2"],
    "ddp_oom_rank1_step3": [
        "strategy=ddp",
        "debug.inject_oom={step: 3, rank: 1, times: 1, where: backward}",
    ],
    # an OOM on rank 1 at step 3 on ZeRO: before backward, and at the entry of the optimizer
    # step (DeepSpeed's step holds collectives: the ranks must agree before it)
    **{
        f"{strategy}_oom_{where}": [
            f"strategy={strategy}",
            f"debug.inject_oom={{step: 3, rank: 1, times: 1, where: {where}}}",
        ]
        for strategy in ("zero2", "zero3")
        for where in ("backward", "optimizer")
    },
    "zero1_fp32": ["strategy=zero1"],
    "zero2_fp32": ["strategy=zero2"],
    "zero3_fp32": ["strategy=zero3", "run.checkpoint_every=4"],
    "zero3_offload_fp32": ["strategy=zero3_offload", "run.checkpoint_every=4"],
    "zero3_offload_params_fp32": ["strategy=zero3_offload_params"],
    # ZeRO-Infinity: parameters and optimizer state swapped through files (async_io, libaio)
    "zero3_nvme_fp32": [
        "strategy=zero3_nvme",
        "deepspeed.nvme_path={work}/nvme_swap",
        "run.checkpoint_every=4",
    ],
    # 2N steps straight vs N, stop, resume (N = 4): the same rung on the same ranks; the resumed
    # runs write checkpoints/step_8 too, to compare their optimizer moments with the straight run's
    "fsdp_resumed": [
        "strategy=fsdp",
        "run.checkpoint_every=4",
        "run.resume={work}/fsdp_fp32/checkpoints/step_4",
    ],
    "zero3_offload_resumed": [
        "strategy=zero3_offload",
        "run.checkpoint_every=4",
        "run.resume={work}/zero3_offload_fp32/checkpoints/step_4",
    ],
    # checkpoints moving between rungs and world sizes
    "fsdp_from_single": [
        "strategy=fsdp",
        "run.checkpoint_every=4",
        "run.resume={work}/single_fp32/checkpoints/step_4",
    ],
    "zero3_offload_from_fsdp": [
        "strategy=zero3_offload",
        "run.checkpoint_every=4",
        "run.resume={work}/fsdp_fp32/checkpoints/step_4",
    ],
    # moments loaded into optimizer state that lives on NVMe
    "zero3_nvme_from_fsdp": [
        "strategy=zero3_nvme",
        "deepspeed.nvme_path={work}/nvme_swap_resumed",
        "run.checkpoint_every=4",
        "run.resume={work}/fsdp_fp32/checkpoints/step_4",
    ],
}


def main() -> int:
    """argv: BASE_CONFIG WORK_DIR [SKIP]: SKIP is a comma-separated list of run names to leave
    out (the zero3_nvme runs where DeepSpeed's async_io op cannot be built)."""
    base, work = sys.argv[1], Path(sys.argv[2])
    skip = set(sys.argv[3].split(",")) if len(sys.argv) > 3 else set()
    from trainer.config import load_config
    from trainer.engine import run_training

    for name, overrides in RUNS.items():
        if name in skip:
            continue
        overrides = [o.replace("{work}", str(work)) for o in overrides]
        cfg = load_config(base, [*overrides, f"run.dir={work / name}"])
        code = run_training(cfg)
        if code != 0:
            return code
    probe_deepspeed_state_split(base, work)
    return 0


def probe_deepspeed_state_split(base: str, work: Path) -> None:
    """What each rank keeps of the canonical state a ZeRO-3 checkpoint gathers (the full tensors
    of its own parameters only), written to WORK_DIR/zero3_split_rank{R}.json."""
    import json

    import torch

    from trainer.backends import BackendContext, build_backend
    from trainer.config import load_config
    from trainer.dist import env_rank
    from trainer.engine import _optimizer_spec
    from trainer.model import HFModelFactory

    cfg = load_config(base, ["strategy=zero3", f"run.dir={work / 'zero3_split'}"])
    rank, local_rank, world_size = env_rank()
    ctx = BackendContext(
        cfg=cfg,
        device=torch.device("cpu"),
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        precision=cfg.precision,
        activation_checkpointing="none",
        micro_batch_size=cfg.train.micro_batch_size,
        grad_accum=cfg.train.global_batch_size // (cfg.train.micro_batch_size * world_size),
    )
    backend = build_backend("zero3", ctx)
    backend.setup(HFModelFactory(cfg.model, cfg.train.seed), _optimizer_spec(cfg))
    state = backend.state_dict()
    kept = {
        "weights": {name: t.numel() for name, t in state["model"].items()},
        "moments": sorted(state["optim"]),
    }
    (work / f"zero3_split_rank{rank}.json").write_text(json.dumps(kept))


if __name__ == "__main__":
    from trainer.dist import exit_without_teardown

    exit_without_teardown(main())
