"""The ladder as data: one row per strategy, read by the config, the estimator, the planner, the
backend registry, the DeepSpeed config and the `--emit` writers. Torch-free.

Adding a rung is one row here plus one backend file (docs/adding-a-rung.md). Readers look rows up
through `rows()` / `row()` at call time, never through a copy taken at import, so a row added to
`TABLE` is seen everywhere.

Row order is the ladder's order: fastest and simplest first. Where a planner tie or the
`SIMPLER_RUNG_MARGIN` rule needs "earlier on the ladder", it means earlier in `TABLE`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Engine = Literal["single", "ddp", "fsdp", "deepspeed", "stream"]
Place = Literal["device", "cpu", "nvme"]

# Activation checkpointing levels, cheapest in memory last; `checkpointed_layers` says which
# decoder layers each level wraps (the engine applies it, the estimator counts it).
AC_LEVELS = ("none", "selective", "full")

# DeepSpeed's reduce / all-gather / prefetch buckets, in elements: the backend's DeepSpeed config
# sets them and the estimate counts them.
DEEPSPEED_BUCKET_ELEMENTS = 50_000_000

# AdamW on the host, parameters per second per node over all cores: DeepSpeed's CPU Adam (AVX,
# fused), and torch's fused AdamW on CPU tensors (FSDP2's CPUOffloadPolicy, `stream`). The
# ZeRO-Offload paper's 5.1-6.5x (Ren et al. 2021, sec. 5.1) was torch's unfused loop; re-measured
# for `stream` (torch 2.13, 50M fp32 parameters, a shared 2-core VM): fused 0.25e9 a core, 4.4x
# foreach; a 16-core node, held by memory bandwidth (28 bytes move per parameter) to about half
# of 16 x that: 2e9 (bench/stream_vs_zero3.py measures it on a GPU node).
DEEPSPEED_HOST_ADAM_PARAMS_S = 1.5e9
TORCH_HOST_ADAM_PARAMS_S = 2.0e9


@dataclass(frozen=True)
class Strategy:
    """One rung: what runs it, where each kind of state lives, and what it costs per step."""

    name: str
    engine: Engine  # which family of model-state accounting and which kind of backend
    backend: str  # "module:Class" of the backend that runs it (imported lazily)
    description: str
    zero_stage: int = 0  # DeepSpeed ZeRO stage (deepspeed rows)
    params_at: Place = "device"  # where the fp32 parameters live between uses
    optimizer_at: Place = "device"  # where AdamW's state and step live
    min_world: int = 1  # data ranks (a tensor group counts once)
    max_world: int | None = None
    tensor_parallel: bool = False  # runs under a tensor split (`parallel.tensor` > 1)
    expert_parallel: bool = False  # runs under an expert split (`parallel.expert` > 1)
    # Cost model: bytes moved per rank per step, as multiples of N (interconnect) or N / W (PCIe)
    grad_comm: float = 0.0  # gradient reduction, once per step or (ZeRO-2/3) per micro-batch
    grads_every_micro: bool = False  # reduces every micro-batch (no no_sync)
    param_comm_per_micro: float = 0.0  # parameter gathers, every micro-batch
    pcie_per_step: float = 0.0  # host <-> device once per step
    pcie_per_micro: float = 0.0  # host <-> device every micro-batch
    offloaded_grads: float = 0.0  # gradients to the host, each time they are reduced
    host_adam_params_s: float = 0.0  # AdamW on the host: parameters per second per node
    nvme_per_step: float = 0.0
    # oomless's own streaming (`stream`): the engine recomputes every layer (checkpointing is
    # `full`), and its copies and host step overlap compute (launcher/plan/cost.py)
    streams_layers: bool = False

    @property
    def shards_params(self) -> bool:
        """Each rank holds a slice of the parameters (FSDP, ZeRO-3): loads and gathers per layer."""
        return self.engine == "fsdp" or self.zero_stage == 3

    @property
    def offloads(self) -> bool:
        return self.optimizer_at != "device" or self.params_at != "device"

    @property
    def needs_nvme(self) -> bool:
        return "nvme" in (self.optimizer_at, self.params_at)


_DS = "trainer.backends.deepspeed:DeepSpeedBackend"
_FSDP = "trainer.backends.fsdp:FsdpBackend"
_ZERO3 = dict(grad_comm=4.0, grads_every_micro=True, param_comm_per_micro=4.0)
_HOST_ADAM = dict(offloaded_grads=4.0, host_adam_params_s=DEEPSPEED_HOST_ADAM_PARAMS_S)

TABLE: list[Strategy] = [
    Strategy(
        "single", "single", "trainer.backends.single:SingleBackend",
        "everything on one device", max_world=1, tensor_parallel=True,
    ),
    Strategy(
        "ddp", "ddp", "trainer.backends.ddp:DdpBackend",
        "a full replica per device, gradients all-reduced", min_world=2, grad_comm=8.0,
    ),
    Strategy(  # x c/2 on the gathers: FSDP gathers 16-bit parameters
        "fsdp", "fsdp", _FSDP,
        "parameters, gradients and optimizer sharded (FSDP2)",
        grad_comm=4.0, param_comm_per_micro=2.0, tensor_parallel=True, expert_parallel=True,
    ),
    Strategy(
        "zero1", "deepspeed", _DS, "optimizer state sharded (DeepSpeed ZeRO-1)",
        zero_stage=1, grad_comm=8.0,
    ),
    Strategy(
        "zero2", "deepspeed", _DS, "optimizer state and gradients sharded (DeepSpeed ZeRO-2)",
        zero_stage=2, grad_comm=8.0, grads_every_micro=True,
    ),
    Strategy(
        "zero3", "deepspeed", _DS, "all model states sharded (DeepSpeed ZeRO-3)",
        zero_stage=3, **_ZERO3,
    ),
    Strategy(  # fp32 shards copied in for the forward's and the backward's gathers
        "fsdp_offload", "fsdp", _FSDP,
        "FSDP2 with parameters, gradients and AdamW on the host (CPUOffloadPolicy)",
        params_at="cpu", optimizer_at="cpu",
        grad_comm=4.0, param_comm_per_micro=2.0, pcie_per_micro=8.0, offloaded_grads=4.0,
        host_adam_params_s=TORCH_HOST_ADAM_PARAMS_S, tensor_parallel=True,
        expert_parallel=True,
    ),
    Strategy(  # updated fp32 partitions back to the device once per step
        "zero3_offload", "deepspeed", _DS, "ZeRO-3 with the optimizer on the host (CPU Adam)",
        zero_stage=3, optimizer_at="cpu", pcie_per_step=4.0, **_ZERO3, **_HOST_ADAM,
    ),
    Strategy(  # parameters streamed in for forward and backward every micro-batch
        "zero3_offload_params", "deepspeed", _DS,
        "ZeRO-3 with optimizer and parameters on the host, streamed per layer",
        zero_stage=3, params_at="cpu", optimizer_at="cpu", pcie_per_micro=8.0,
        **_ZERO3, **_HOST_ADAM,
    ),
    Strategy(
        "zero3_nvme", "deepspeed", _DS,
        "ZeRO-Infinity: optimizer and parameters on NVMe",
        zero_stage=3, params_at="nvme", optimizer_at="nvme", pcie_per_micro=8.0,
        nvme_per_step=32.0, **_ZERO3, **_HOST_ADAM,
    ),
    Strategy(  # weights in twice, gradients out once per micro-batch (x c/2: the compute dtype)
        "stream", "stream", "trainer.backends.stream:StreamBackend",
        "fp32 master weights, gradients and AdamW on the host, layers streamed through one "
        "device (MegaTrain)",
        params_at="cpu", optimizer_at="cpu", max_world=1, streams_layers=True,
        pcie_per_micro=6.0, host_adam_params_s=TORCH_HOST_ADAM_PARAMS_S,
    ),
]  # fmt: skip


def rows() -> tuple[Strategy, ...]:
    """Every rung, in ladder order."""
    return tuple(TABLE)


def names() -> tuple[str, ...]:
    return tuple(s.name for s in TABLE)


def row(name: str) -> Strategy:
    """The row of a strategy name (KeyError for an unknown one: the config validated it)."""
    for s in TABLE:
        if s.name == name:
            return s
    raise KeyError(f"unknown strategy {name!r}; known: {', '.join(names())}")


def checkpointed_layers(num_layers: int, level: str, count: int | None = None) -> list[int]:
    """Indices of the decoder layers that activation checkpointing `level` wraps.

    'full' wraps every layer; 'selective' `count` of them spread over the depth (layer
    i * num_layers // count for each i; ConfigError above `num_layers`), every other one without
    a count (half the activations kept, half the recompute); 'none' none.
    """
    if level == "full":
        return list(range(num_layers))
    if level == "selective":
        if count is None:
            return list(range(0, num_layers, 2))
        if count > num_layers:
            from trainer.core.errors import ConfigError

            raise ConfigError(
                "memory.checkpointed_layers",
                f"{count} is more than the model's {num_layers} decoder layers",
                f"use 1 to {num_layers}, or memory.activation_checkpointing=full",
            )
        return [i * num_layers // count for i in range(count)]
    return []


# Chunked loss (trainer/memory/chunked_loss.py): logit elements per chunk when
# `memory.loss_chunk_tokens` is not set: 2^26 (256 MiB in fp32), about 512 tokens of a 128k
# vocabulary, so a 4096-token micro-batch goes in 8 chunks (torchtitan's count).
CHUNK_LOGIT_ELEMENTS = 1 << 26


def loss_chunk_tokens(vocab_size: int, configured: int | None = None) -> int:
    """Tokens per chunk of the chunked loss: `memory.loss_chunk_tokens`, or what keeps a chunk's
    logits near CHUNK_LOGIT_ELEMENTS. The engine chunks and the estimator sizes by this."""
    if configured:
        return configured
    return max(1, CHUNK_LOGIT_ELEMENTS // max(vocab_size, 1))
