"""Which rung can run which fine-tune method, optimizer and opt-in precision: one table,
torch-free.

The config refuses a forced `strategy` that cannot run the configured `finetune.method`,
`train.optimizer`, `precision: bf16_pure` or `train.optimizer_in_backward` (exit 2 with the
reason below); the planner reads the same function to mark a rung "no: <reason>" and never picks
it. These opt-ins change what is learned (or how it is stepped), so they are never changed to make
a rung work: the rung is left out instead.
"""

from __future__ import annotations

from trainer.core import strategies

# The methods, optimizers and precisions the engine runs (trainer/model/finetune.py,
# trainer/optim.py).
METHODS = ("full", "lora", "qlora")
OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit")
# bitsandbytes' 8-bit AdamW; paged: its states in CUDA managed memory, which the driver moves to
# the host when the device runs short (the same math and checkpoint; on CPU processes it runs as
# adamw_8bit)
EIGHT_BIT_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit")
PRECISIONS = ("bf16", "fp16", "fp32", "bf16_pure")

# QLoRA needs each 4-bit weight's quantisation state through the backend's wrapping: a plain
# replica keeps the `Params4bit` tensors (single, ddp); FSDP2 shards the packed weights in their
# bf16 storage and each `Linear4bit` keeps the state for the gathered weight (trainer/backends/
# fsdp.py); ZeRO-3 partitions a built quantised model in place, the state staying on each
# parameter (trainer/backends/deepspeed.py). ZeRO-1/2 cast every parameter of the module they
# wrap to one dtype, which unpacks the 4-bit storage.
_QLORA_NO = {
    "deepspeed": "DeepSpeed ZeRO-1/2 cast the 4-bit storage with the rest of the module; ZeRO-3 "
    "partitions it (strategy=zero3)",
}
# bitsandbytes' 8-bit AdamW steps plain tensors: a replica's whole ones (single, ddp) and each
# FSDP2 shard's local rows (trainer/optim.py); not DeepSpeed's flat partitions, whose checkpoint
# gathers fp32 moments (and whose offload rungs step with DeepSpeed's CPU Adam, which has no
# 8-bit states).
_ADAMW_8BIT_NO = {
    "deepspeed": "DeepSpeed ZeRO steps and checkpoints fp32 optimizer partitions, not "
    "bitsandbytes' 8-bit states",
}
# bf16_pure keeps no fp32 master: DeepSpeed's bf16 mode always keeps one (and its CPU Adam
# steps fp32 partitions).
_BF16_PURE_NO = {
    "deepspeed": "DeepSpeed keeps an fp32 master copy of every bf16 parameter",
}
# The step in backward needs each parameter's final gradient inside its post-accumulate-grad
# hook: FSDP2 calls the hook on the reduce-scattered shard; DDP reduces in buckets after the
# hook has run; DeepSpeed owns the step.
_IN_BACKWARD_NO = {
    "ddp": "DDP reduces gradients in buckets after a parameter's gradient is ready, so the "
    "parameter cannot be stepped then",
    "deepspeed": "DeepSpeed owns the optimizer step",
}


# `stream` steps fp32 flat host buffers with torch's AdamW and streams every trained weight: a
# frozen base, 4-bit storage, 8-bit states and a step per parameter in backward are each another
# design (docs/stream.md "Next: LoRA over a streamed base").
_STREAM_NO = {
    "lora": "lora: stream trains every weight from its fp32 host master; the frozen base of "
    "LoRA is not streamed yet",
    "qlora": "qlora: stream does not stream 4-bit storage",
    "8bit": "stream steps fp32 AdamW states on the host",
    "bf16_pure": "bf16_pure: stream keeps fp32 masters on the host",
    "in_backward": "optimizer_in_backward: stream steps every layer on the host after the "
    "global grad norm",
}


def _stream_support(method: str, optimizer: str, precision: str, in_backward: bool) -> str | None:
    if method in _STREAM_NO:
        return _STREAM_NO[method]
    if optimizer in EIGHT_BIT_OPTIMIZERS:
        return f"{optimizer}: {_STREAM_NO['8bit']}"
    if precision == "bf16_pure":
        return _STREAM_NO["bf16_pure"]
    return _STREAM_NO["in_backward"] if in_backward else None


def method_support(
    strategy: str,
    method: str = "full",
    optimizer: str = "adamw",
    precision: str = "bf16",
    in_backward: bool = False,
) -> str | None:
    """None when rung `strategy` runs `finetune.method=method` with `train.optimizer=optimizer`,
    `precision` and `train.optimizer_in_backward=in_backward`; else the reason it does not, one
    clause without a trailing period ("qlora: ...").

    The planner calls this for every rung it considers; the config calls it for a forced one.
    """
    row = strategies.row(strategy)
    engine = row.engine
    if engine == "stream":
        return _stream_support(method, optimizer, precision, in_backward)
    if method == "qlora" and engine in _QLORA_NO and row.zero_stage != 3:
        return f"qlora: {_QLORA_NO[engine]}"
    if method == "qlora" and row.needs_nvme:
        return "qlora: ZeRO-Infinity's NVMe swapping of the 4-bit storage is untried"
    if optimizer in EIGHT_BIT_OPTIMIZERS and engine in _ADAMW_8BIT_NO:
        return f"{optimizer}: {_ADAMW_8BIT_NO[engine]}"
    if precision == "bf16_pure" and engine in _BF16_PURE_NO:
        return f"bf16_pure: {_BF16_PURE_NO[engine]}"
    if in_backward and engine in _IN_BACKWARD_NO:
        return f"optimizer_in_backward: {_IN_BACKWARD_NO[engine]}"
    return None


def supported_rungs(
    method: str = "full",
    optimizer: str = "adamw",
    precision: str = "bf16",
    in_backward: bool = False,
) -> tuple[str, ...]:
    """The rungs, in ladder order, that run `method` with `optimizer`, `precision` and
    `in_backward`."""
    return tuple(
        s
        for s in strategies.names()
        if method_support(s, method, optimizer, precision, in_backward) is None
    )


# Where DPO's reference log-probs come from (trainer/objectives/reference.py): LoRA and QLoRA
# use their own base with the adapters off (no copy, computed in each step's no-grad forward); a
# full fine-tune reads the log-probs of one no-grad pass over the data before step 1 (the
# initial weights are the reference), cached beside the tokenised data.
REFERENCES = {"adapters_off": "the base with the adapters off", "precomputed": "precomputed"}
# (objective.type, finetune.method) -> the reference; an objective not here needs none
REFERENCE_SOURCES = {
    ("dpo", "full"): "precomputed",
    ("dpo", "lora"): "adapters_off",
    ("dpo", "qlora"): "adapters_off",
}


def reference_source(objective: str, method: str) -> str | None:
    """`adapters_off`, `precomputed`, or None for an objective without a reference."""
    return REFERENCE_SOURCES.get((objective, method))
