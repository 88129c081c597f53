"""Peak memory per device and per host for one training step, for every strategy. Pure arithmetic.

The model describes what oomless's engine and backends allocate (docs/memory.md has the formulas
and their sources). Notation: N parameters, W ranks, b micro-batch, s sequence length, h hidden,
i MLP width, V vocabulary, L layers, c bytes of the compute dtype (2 for bf16/fp16, 4 for fp32).

- Model states (mixed precision keeps fp32 master weights, fp32 grads, two fp32 AdamW moments):
  4N + 4N + 8N on `single`/`ddp`; divided by W as each ZeRO/FSDP stage shards them; offload
  rungs move them to host memory.
- Activations: what autograd saves per decoder layer for the micro-batch (RMSNorm inputs kept in
  fp32, the 16-bit inputs autocast makes for every projection, rotary q/k, the attention output
  and log-sum-exp of a fused kernel, the SwiGLU intermediates), times the layers not checkpointed;
  a checkpointed layer keeps only its fp32 input, and one layer's activations are rebuilt at a time.
  Then the loss: 16-bit logits, their fp32 upcast, and cross-entropy's fp32 log-probabilities.
- Transients: the autocast weight-cast cache (a 16-bit copy of every weight used in forward),
  FSDP all-gathers of the current and prefetched layer plus the root and reduce-scatter buffers,
  DeepSpeed buckets and the live/prefetched ZeRO-3 parameters, AdamW's foreach temporaries.
- Runtime overhead: a constant for the CUDA context and the allocator's fragmentation as a ratio.

The breakdown lists the size of each part; the peak is the largest of the step's phases (end of
forward, start and end of backward, optimizer step), since activations and gradients, or the
autocast cache and the optimizer's temporaries, are never all alive at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from launcher.hardware import Hardware
from launcher.model_shape import ModelShape

GIB = 1024**3
CUDA_CONTEXT_BYTES = int(0.75 * GIB)  # CUDA context + cuBLAS/cuDNN workspaces, measured typical
FRAGMENTATION_RATIO = 0.08  # caching-allocator slack over peak tensor bytes
CPU_PROCESS_BYTES = int(1.0 * GIB)  # python + torch + transformers in a CPU process (RSS)
HOST_PROCESS_BYTES = int(2.0 * GIB)  # per rank on the host: libraries, dataloader, pinned staging
DEEPSPEED_BUCKET_ELEMENTS = 50_000_000  # reduce/allgather/prefetch bucket (trainer's DS config)
ZERO_OFFLOAD_PINNED_RATIO = 1.0  # pinned host gradient buffer per offloaded fp32 partition

STRATEGIES = (
    "single",
    "ddp",
    "fsdp",
    "fsdp_offload",
    "zero1",
    "zero2",
    "zero3",
    "zero3_offload",
    "zero3_offload_params",
    "zero3_nvme",
)
DEVICE_PARTS = ("params", "grads", "optimizer", "activations", "temporary", "runtime_overhead")


@dataclass(frozen=True)
class Estimate:
    strategy: str
    world_size: int
    micro_batch_size: int
    activation_checkpointing: str
    device_breakdown: dict[str, int]
    peak_tensor_bytes: int  # predicted torch.cuda.max_memory_allocated
    device_total_bytes: int  # + runtime overhead: what must fit in device memory
    host_breakdown: dict[str, int] = field(default_factory=dict)
    host_total_bytes: int = 0  # per node

    def fits(self, hw: Hardware, headroom: float) -> bool:
        device_ok = self.device_total_bytes <= hw.device_memory_bytes * (1 - headroom)
        host_ok = self.host_total_bytes <= hw.host_memory_bytes * (1 - headroom)
        return device_ok and host_ok

    def why_not(self, hw: Hardware, headroom: float) -> str | None:
        if self.device_total_bytes > hw.device_memory_bytes * (1 - headroom):
            return (
                f"needs {self.device_total_bytes / GIB:.1f} GiB per device, has "
                f"{hw.device_memory_bytes / GIB:.1f} GiB less {headroom:.0%} headroom"
            )
        if self.host_total_bytes > hw.host_memory_bytes * (1 - headroom):
            return (
                f"needs {self.host_total_bytes / GIB:.1f} GiB host memory per node, has "
                f"{hw.host_memory_bytes / GIB:.1f} GiB less {headroom:.0%} headroom"
            )
        return None

    def to_json(self, hw: Hardware, headroom: float) -> dict[str, Any]:
        """The `strategies[]` entry of INTERFACE.md."""
        return {
            "name": self.strategy,
            "world_size": self.world_size,
            "micro_batch_size": self.micro_batch_size,
            "activation_checkpointing": self.activation_checkpointing,
            "fits": self.fits(hw, headroom),
            "device": {
                "peak_tensor_bytes": self.peak_tensor_bytes,
                "total_bytes": self.device_total_bytes,
                "breakdown": dict(self.device_breakdown),
            },
            "host": {"total_bytes": self.host_total_bytes, "breakdown": dict(self.host_breakdown)},
        }


def activation_bytes_per_layer(shape: ModelShape, micro: int, seq: int, c: int) -> int:
    """Bytes autograd keeps for one decoder layer (Llama-style block, fused attention)."""
    tokens = micro * seq
    h, i, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q_width, kv_width = shape.num_heads * d, shape.num_kv_heads * d
    norms = 2 * 4 * tokens * h  # both RMSNorm inputs, fp32 residual stream
    proj_inputs = tokens * (3 * c * h + c * q_width + 2 * c * h)  # q/k/v, o, gate/up inputs
    rotary = tokens * c * (q_width + 2 * kv_width)  # q, k (rotated) and v for attention
    attention = tokens * c * q_width + 4 * micro * shape.num_heads * seq  # output + log-sum-exp
    mlp = tokens * 4 * c * i  # gate, up, silu(gate), product (down_proj input)
    return norms + proj_inputs + rotary + attention + mlp


def loss_bytes(shape: ModelShape, micro: int, seq: int, c: int) -> int:
    """Logits (compute dtype), their fp32 copy and cross-entropy's fp32 log-probabilities."""
    logits = micro * seq * shape.vocab_size
    return logits * (c + 4 + 4)


def estimate(
    shape: ModelShape,
    *,
    strategy: str,
    world_size: int,
    devices_per_node: int,
    micro_batch_size: int,
    seq_len: int,
    activation_checkpointing: str,
    precision: str,
    device: str = "cuda",
) -> Estimate:
    """Peak bytes on one device and on one host for a training step of this configuration."""
    n = shape.num_params
    w = max(1, world_size)
    c = 4 if precision == "fp32" else 2
    mixed = precision != "fp32"
    layer_n = shape.num_layer_params
    root_n = shape.num_root_params

    # Model states per rank: where they live.
    full = {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n}
    shard = {k: v // w for k, v in full.items()}
    on_device: dict[str, int]
    on_host: dict[str, int] = {}
    if strategy in ("single", "ddp"):
        on_device = dict(full)
    elif strategy == "zero1":
        on_device = {
            "params": full["params"],
            "grads": full["grads"],
            "optimizer": shard["optimizer"],
        }
    elif strategy == "zero2":
        on_device = {
            "params": full["params"],
            "grads": shard["grads"],
            "optimizer": shard["optimizer"],
        }
    elif strategy in ("fsdp", "zero3"):
        on_device = dict(shard)
    elif strategy in ("fsdp_offload",):
        on_device = {"params": 0, "grads": 0, "optimizer": 0}
        on_host = dict(shard)
    elif strategy == "zero3_offload":
        on_device = {"params": shard["params"], "grads": shard["grads"], "optimizer": 0}
        on_host = {
            "optimizer": shard["optimizer"],
            "params": shard["params"],  # fp32 master
            "grads": int(shard["grads"] * ZERO_OFFLOAD_PINNED_RATIO),
        }
    elif strategy == "zero3_offload_params":
        on_device = {"params": 0, "grads": 0, "optimizer": 0}
        on_host = {
            "optimizer": shard["optimizer"],
            "params": 2 * shard["params"],
            "grads": shard["grads"],
        }
    elif strategy == "zero3_nvme":  # states on NVMe; host keeps swap buffers for ~2 layers
        on_device = {"params": 0, "grads": 0, "optimizer": 0}
        on_host = {"nvme_buffers": 2 * 16 * layer_n}
    else:
        raise ValueError(f"unknown strategy {strategy}")

    # Activations for this micro-batch.
    per_layer = activation_bytes_per_layer(shape, micro_batch_size, seq_len, c)
    layer_input = 4 * micro_batch_size * seq_len * shape.hidden_size
    num_ckpt = {"none": 0, "selective": (shape.num_layers + 1) // 2, "full": shape.num_layers}[
        activation_checkpointing
    ]
    num_kept = shape.num_layers - num_ckpt
    rebuilt = per_layer if num_ckpt else 0  # one checkpointed layer recomputed at a time
    embed_and_norm = 2 * layer_input + c * micro_batch_size * seq_len * shape.hidden_size
    activations = (
        num_kept * per_layer
        + num_ckpt * layer_input
        + rebuilt
        + embed_and_norm
        + loss_bytes(shape, micro_batch_size, seq_len, c)
    )

    # Transients, by phase of the step.
    autocast_cache = 2 * n if strategy in ("single", "ddp", "zero1", "zero2") and mixed else 0
    comm = 0  # gathered parameters and communication buffers, alive through forward and backward
    if strategy in ("fsdp", "fsdp_offload"):
        gathered = c if mixed else 4
        comm += 2 * gathered * layer_n + gathered * root_n  # current + prefetched layer, root
        comm += 2 * 4 * layer_n  # reduce-scatter input/output in fp32
    if strategy.startswith("zero"):
        bucket = min(DEEPSPEED_BUCKET_ELEMENTS, n)
        comm += 4 * bucket * (2 if strategy in ("zero1", "zero2") else 1)
    if strategy.startswith("zero3"):
        comm += 4 * (2 * layer_n + root_n)  # live + prefetched layer and the root, fp32
        if mixed:
            comm += 2 * (2 * layer_n + root_n)  # their autocast copies
    foreach = on_device["params"] // 2 if on_device["optimizer"] and device != "cuda" else 0
    loss_grad = 4 * micro_batch_size * seq_len * shape.vocab_size

    # The peak is the largest of the step's phases, not the sum of every part.
    static = on_device["params"] + on_device["optimizer"]
    grads = on_device["grads"]
    head_grad = grads * root_n // max(n, 1)  # lm_head/embedding grads come first in backward
    phases = {
        "forward": static + activations + autocast_cache + comm,
        "backward_start": static + activations + autocast_cache + comm + loss_grad + head_grad,
        "backward_end": static + grads + comm + per_layer + layer_input * shape.num_layers,
        "optimizer": static + grads + foreach,
    }
    peak = max(phases.values())
    temporary = autocast_cache + comm + foreach
    breakdown = {**on_device, "activations": activations, "temporary": temporary}
    if device == "cuda":
        overhead = CUDA_CONTEXT_BYTES + int(FRAGMENTATION_RATIO * peak)
    else:
        overhead = CPU_PROCESS_BYTES
    breakdown["runtime_overhead"] = overhead

    # Host memory per node: every rank's offloaded states, the initial full fp32 state dict the
    # model factory builds on the host (rank 0 only for sharded rungs), process baseline.
    ranks_here = min(devices_per_node, w)
    host = {k: v * ranks_here for k, v in on_host.items()}
    sharded_load = strategy not in ("single", "ddp", "zero1", "zero2")
    host["initial_weights"] = 4 * n * (1 if sharded_load else ranks_here)
    host["processes"] = HOST_PROCESS_BYTES * ranks_here
    if device == "cpu":  # the "device" is host memory too
        host["device_memory_of_cpu_ranks"] = (peak + overhead) * ranks_here
    return Estimate(
        strategy=strategy,
        world_size=w,
        micro_batch_size=micro_batch_size,
        activation_checkpointing=activation_checkpointing,
        device_breakdown={k: int(breakdown.get(k, 0)) for k in DEVICE_PARTS},
        peak_tensor_bytes=int(peak),
        device_total_bytes=int(peak + overhead),
        host_breakdown={k: int(v) for k, v in host.items()},
        host_total_bytes=int(sum(host.values())),
    )
