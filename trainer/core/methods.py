"""Which rung can run which fine-tune method and optimizer: one table, torch-free.

The config refuses a forced `strategy` that cannot run the configured `finetune.method` or
`train.optimizer` (exit 2 with the reason below); the planner reads the same function to mark a
rung "no: <reason>" and never picks it. `finetune.method` and `train.optimizer` change what is
learned, so they are never changed to make a rung work: the rung is left out instead.
"""

from __future__ import annotations

from trainer.core import strategies

# The methods and optimizers the engine runs (trainer/finetune.py).
METHODS = ("full", "lora", "qlora")
OPTIMIZERS = ("adamw", "adamw_8bit")

# QLoRA needs the 4-bit weights to stay bitsandbytes `Params4bit` tensors with their
# quantisation state through the backend's wrapping: a plain replica keeps them (single, ddp).
# FSDP2 would shard the packed storage as plain tensors and DeepSpeed ZeRO partitions and
# re-creates parameters (and, on ZeRO-1/2, flattens only the trainable ones but still casts the
# module), which drops the quantisation state.
_QLORA_NO = {
    "fsdp": "FSDP2 shards the packed 4-bit weights without their quantisation state",
    "deepspeed": "DeepSpeed ZeRO re-creates the parameters and drops the 4-bit quantisation state",
}
# bitsandbytes' 8-bit AdamW steps plain tensors held whole by a replica (single, ddp): not
# FSDP2's DTensor shards, and not DeepSpeed's flat partitions, whose checkpoint gathers fp32
# moments (and whose offload rungs step with DeepSpeed's CPU Adam, which has no 8-bit states).
_ADAMW_8BIT_NO = {
    "fsdp": "bitsandbytes' 8-bit AdamW cannot step FSDP2's sharded (DTensor) parameters",
    "deepspeed": "DeepSpeed ZeRO steps and checkpoints fp32 optimizer partitions, not "
    "bitsandbytes' 8-bit states",
}


def method_support(strategy: str, method: str = "full", optimizer: str = "adamw") -> str | None:
    """None when rung `strategy` runs `finetune.method=method` with `train.optimizer=optimizer`;
    else the reason it does not, one clause without a trailing period ("qlora: ...").

    The planner calls this for every rung it considers; the config calls it for a forced one.
    """
    rung = strategies.row(strategy)
    if method == "qlora" and rung.engine in _QLORA_NO:
        return f"qlora: {_QLORA_NO[rung.engine]}"
    if optimizer == "adamw_8bit" and rung.engine in _ADAMW_8BIT_NO:
        return f"adamw_8bit: {_ADAMW_8BIT_NO[rung.engine]}"
    return None


def supported_rungs(method: str = "full", optimizer: str = "adamw") -> tuple[str, ...]:
    """The rungs, in ladder order, that run `method` with `optimizer`."""
    return tuple(s for s in strategies.names() if method_support(s, method, optimizer) is None)
