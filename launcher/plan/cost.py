"""The cost model: predicted seconds per optimizer step of a `StepSpec` on the given hardware.

Compute (FLOPs at an effective utilisation that grows with the micro-batch), recomputation
(activation checkpointing, chunked loss), communication (gradient reduction and parameter
gathers per the rung's row), and host traffic (offloaded state over PCIe, host AdamW, NVMe,
activation offload). Effective rates, not peaks; they rank candidates coarsely
(docs/planner.md). Pure arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from launcher.estimate.methods import method_cost
from launcher.estimate.shape import ModelShape
from launcher.plan.hardware import Hardware
from trainer.core.flops import attention_flops_per_token
from trainer.core.step_spec import StepSpec

# Cost-model constants (docs/planner.md): effective bandwidths and rates, not peaks. The
# bandwidths are defaults for the `hardware.*_bandwidth` keys.
INTRA_NODE_BYTES_S = {"cuda": 150e9, "cpu": 2e9}  # NVLink-class / shared memory via gloo
INTER_NODE_BYTES_S = {"cuda": 20e9, "cpu": 1e9}  # per device over the network
PCIE_BYTES_S = 12e9
# Pinned host memory a node's devices copy to and from at once: their PCIe links share it
HOST_MEMORY_BYTES_S = {"cuda": 80e9, "cpu": 20e9}
NVME_BYTES_S = 3e9
BASE_UTILIZATION = 0.45  # fraction of peak FLOP/s a well-fed step reaches
SATURATION_TOKENS = 512  # tokens per micro-batch at which utilisation is half its base
# A rung later on the ladder must be predicted this much faster to be chosen over an earlier one:
# the cost model ranks rungs coarsely, and earlier rungs have fewer moving parts.
SIMPLER_RUNG_MARGIN = 0.10
CPU_PEAK_FLOPS = 0.2e12  # when planning CPU processes (tests, the demo)
DEVICE_MEMORY_BYTES_S = {"cuda": 1.5e12, "cpu": 20e9}  # QLoRA's dequantisation is memory-bound
UNKNOWN_GPU_PEAK_FLOPS = 100e12


@dataclass(frozen=True)
class Links:
    """Effective bandwidths in bytes per second (the `hardware.*_bandwidth` keys, or defaults)."""

    intra_node: float
    inter_node: float
    pcie: float
    nvme: float
    host: float  # the node's pinned host memory, shared by its devices

    @classmethod
    def of(cls, hardware_cfg: Any, device: str) -> Links:
        given = hardware_cfg
        return cls(
            intra_node=given.intra_node_bandwidth or INTRA_NODE_BYTES_S[device],
            inter_node=given.inter_node_bandwidth or INTER_NODE_BYTES_S[device],
            pcie=given.pcie_bandwidth or PCIE_BYTES_S,
            nvme=given.nvme_bandwidth or NVME_BYTES_S,
            host=HOST_MEMORY_BYTES_S[device],
        )


def step_time_s(
    shape: ModelShape, spec: StepSpec, hw: Hardware, links: Links, offloaded_bytes: int = 0,
    stream: list[StreamTimes] | None = None,
) -> float:  # fmt: skip
    """Predicted seconds per optimizer step: compute + recompute + communication + host traffic.
    `offloaded_bytes`: what activation offload moves per micro-batch (the estimate's); `stream`:
    where a `stream` step's parts are appended (the plan's reasons say them)."""
    compute = _compute_s(shape, spec, hw)
    rung = spec.row
    if not rung.streams_layers:
        return (
            compute
            + _comm_s(shape, spec, hw, links, compute)
            + _host_s(shape, spec, hw, links, compute, offloaded_bytes)
        )
    # `stream` (trainer/backends/stream.py): per micro-batch every layer's weights cross PCIe
    # twice and its gradients once, in the compute dtype (`pcie_per_micro` x c/2), on copy
    # streams beside the compute: the slower of the two sets the pace (the resident parts come in
    # once a step, their gradients go out each micro-batch; with activation offload the kept
    # layer inputs share the link). Host AdamW follows the global norm
    # and overlaps the next step's first forward (a layer is fetched once it is updated): what it
    # does not hide is added. (Inline: the walk of tests/test_architecture.py counts modules.)
    c, root = spec.compute_bytes, shape.num_root_params
    cost = method_cost(shape, spec.finetune, c)
    per_micro = rung.pcie_per_micro * c / 2 * (cost.gathered - root) + c * root
    if spec.offload_activations:  # the kept layer inputs out in forward and back in backward
        per_micro += 2 * offloaded_bytes
    copied = per_micro * spec.grad_accum + c * root
    adam_s = cost.trained / rung.host_adam_params_s
    forward_s = compute / spec.grad_accum / 4  # of forward 1, recompute 1, backward 2
    exposed = max(adam_s / max(1, shape.num_layers), adam_s - forward_s)
    times = StreamTimes(compute, copied / links.pcie, copied, adam_s, exposed)
    if stream is not None:
        stream.append(times)
    return times.step_s


@dataclass(frozen=True)
class StreamTimes:
    """`stream`'s step (trainer/backends/stream.py): its copies run beside the compute, so the
    slower of the two sets the pace; of its host AdamW only what the next step's first forward
    does not hide is added."""

    compute_s: float
    copies_s: float
    copied_bytes: float
    host_adam_s: float
    exposed_adam_s: float

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.copies_s) + self.exposed_adam_s

    def words(self) -> str:
        """The plan's line on why the step takes what it takes."""
        pace = "copies" if self.copies_s > self.compute_s else "compute"
        return (
            f"stream's step is the slower of compute ({self.compute_s:.3g} s) and its copies "
            f"beside it ({self.copied_bytes / 1e9:.3g} GB over PCIe, {self.copies_s:.3g} s): "
            f"{pace} sets the pace; {self.exposed_adam_s:.3g} s of its host AdamW "
            f"({self.host_adam_s:.3g} s) is not hidden behind the next step's first forward "
            "(the other offload rungs add their copies and host AdamW to the compute)"
        )


def _recomputed(shape: ModelShape, spec: StepSpec) -> float:
    """The share of the decoder layers whose forward runs again in backward: all under full,
    `checkpointed_layers` under selective (every other one without a count); at op level, the
    share of a layer's matmul work recomputed (Llama: k, o and up; attention is saved)."""
    level, layers = spec.activation_checkpointing, max(1, shape.num_layers)
    if level == "selective" and spec.checkpoint_ops:
        q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        i = shape.intermediate_size
        return (kv + q + i) / (2 * q + 2 * kv + 3 * i)
    if level == "selective":
        return min(spec.checkpointed_layers or (layers + 1) // 2, layers) / layers
    return 1.0 if level == "full" else 0.0


def _compute_s(shape: ModelShape, spec: StepSpec, hw: Hardware) -> float:
    """FLOPs of the step (the method's, attention, recomputation) at an effective rate, plus
    QLoRA's memory-bound dequantisation."""
    seq, world, micro = spec.seq_len, max(1, spec.world_size), spec.num_sequences
    tokens = spec.data_ranks * micro * spec.grad_accum * seq  # a sequence group shares its own
    cost = method_cost(shape, spec.finetune, spec.compute_bytes)  # full, LoRA or QLoRA; MoE
    attention = attention_flops_per_token(shape.num_layers, shape.hidden_size, seq)
    if not spec.packed:  # causal kernels (flash, flex, causal sdpa) skip the masked half; a
        attention /= 2  # dense mask goes to a kernel that computes every block of the square
    recomputed = _recomputed(shape, spec)
    again = 0.0 if spec.checkpoint_ops else attention / 3  # op level: attention is saved
    recompute = recomputed * (cost.recompute_flops_per_token + again)
    if spec.chunked_loss:
        recompute += recomputed_head_flops_per_token(shape.hidden_size, shape.vocab_size)
    if spec.tiled_mlp:  # each chunk's MLP forward again in backward (and in a recompute)
        mlp_flops = 6 * shape.hidden_size * shape.intermediate_size * shape.num_layers
        recompute += (1 + recomputed) * mlp_flops
    # DPO under lora/qlora: the base's no-grad forward with the adapters off, per micro-batch
    off = spec.reference == "adapters_off"
    reference = 2 * shape.num_compute_params + attention / 3 if off else 0
    flops = tokens * (cost.flops_per_token + attention + recompute + reference)
    # MoE: the routed experts' matmuls are as tall as the rows each expert gets, not the tokens
    passes_per_weight = (4.0 if spec.finetune.adapters else 6.0) + 2 * recomputed + 2 * off
    routed = tokens * passes_per_weight * shape.num_routed_params * shape.experts_per_token
    routed /= max(1, shape.num_experts)
    peak = hw.peak_flops or (CPU_PEAK_FLOPS if hw.device == "cpu" else UNKNOWN_GPU_PEAK_FLOPS)
    micro_tokens = micro * spec.local_seq_len
    passes = spec.grad_accum * (2 + recomputed)  # forward, backward, recompute per micro-batch
    dequant = cost.dequant_bytes * passes / DEVICE_MEMORY_BYTES_S[hw.device]
    seconds = (flops - routed) / (world * peak * utilization(micro_tokens)) + dequant
    if routed:
        seconds += routed / (world * peak * utilization(expert_rows(shape, micro_tokens)))
    return seconds


def utilization(rows: float) -> float:
    """The fraction of peak FLOP/s a step's matmuls reach when `rows` tall: a micro-batch's
    tokens for the dense layers, the rows each expert gets for the routed experts."""
    return BASE_UTILIZATION * rows / (rows + SATURATION_TOKENS)


def expert_rows(shape: ModelShape, micro_tokens: int) -> float:
    """The rows each of a rank's experts multiplies per micro-batch, on average: the tokens x
    top-k spread over every expert; under a split of N, the N ranks' tokens over the rank's
    experts / N, so each expert's matmul is N times taller (the grouped GEMM of few rows an
    expert is memory-bound: docs/planner.md)."""
    e, k = max(1, shape.num_experts), shape.experts_per_token
    return micro_tokens * k * shape.expert_parallel / e


def _grad_reductions(spec: StepSpec) -> int:
    every = spec.row.grads_every_micro or spec.fsdp_reduce_every_micro_batch
    return spec.grad_accum if every else 1


def _comm_s(
    shape: ModelShape, spec: StepSpec, hw: Hardware, links: Links, compute_s: float
) -> float:
    """What communication adds to compute: gradient reductions and parameter gathers over the
    ring of the ranks that shard (all, or under a tensor split those of one tensor rank, each
    moving its 1/tensor of the model; under an expert split of N each rank's experts / N over
    the ring of their copies), less what compute hides; Ulysses' all-to-alls, the tensor
    split's all-reduces and the expert split's dispatch and combine in full (on the critical
    path)."""
    rung, ring, tp, ep = spec.row, spec.shard_ranks, spec.tensor_parallel, shape.expert_parallel
    cost = method_cost(shape, spec.finetune, spec.compute_bytes)
    bandwidth = links.intra_node if hw.nodes == 1 else links.inter_node
    gather_scale = spec.compute_bytes / 2 if rung.engine == "fsdp" else 1.0
    reduced = rung.grad_comm * _grad_reductions(spec)
    gathered = rung.param_comm_per_micro * gather_scale * spec.grad_accum
    routed = shape.num_routed_params if ep > 1 else 0  # LoRA leaves the experts frozen
    routed_trained = 0 if spec.finetune.adapters else routed
    dense = (cost.trained - routed_trained) * reduced + (cost.gathered - routed) * gathered
    experts = (routed_trained * reduced + routed * gathered) / ep
    copies = max(1, ring // ep)
    moved = (ring - 1) / ring * dense + (copies - 1) / copies * experts
    exposed = overlapped_s(moved / tp / bandwidth, compute_s, shape.num_layers)
    return (
        exposed + all_to_all_s(shape, spec, links) + tensor_all_reduce_s(shape, spec, links)
        + expert_all_to_all_s(shape, spec, links)
    )  # fmt: skip


def overlapped_s(comm_s: float, compute_s: float, layers: int) -> float:
    """The part of per-layer collectives that compute does not hide. FSDP2 and ZeRO-3 gather
    the next layer's parameters while this one computes and reduce-scatter a layer's gradients
    while the one before it runs backward; DDP and ZeRO-1/2 reduce gradient buckets during
    backward. Exposed: what exceeds compute, and at least one layer's share a micro-batch
    (the first gather, the last reduction) (docs/planner.md)."""
    return max(comm_s / max(1, layers), comm_s - compute_s)


def tensor_all_reduce_s(shape: ModelShape, spec: StepSpec, links: Links) -> float:
    """The tensor split's collectives (trainer/parallel/tensor.py), inside the node: per layer
    and pass (forward, backward, a checkpoint's recompute) two all-reduces of the hidden states
    (the row-wise outputs forward, the column-wise inputs' gradients backward), a ring moving
    2 (tp-1)/tp of them; and the head's logits gathered once per micro-batch."""
    tp = spec.tensor_parallel
    if tp == 1:
        return 0.0
    tokens = spec.num_sequences * spec.local_seq_len
    hidden = spec.compute_bytes * tokens * shape.hidden_size
    passes = (2 + _recomputed(shape, spec)) * spec.grad_accum
    layers = 2 * 2 * (tp - 1) / tp * hidden * shape.num_layers * passes
    logits = (tp - 1) / tp * spec.compute_bytes * tokens * shape.vocab_size * spec.grad_accum
    bandwidth = links.intra_node if tp <= spec.ranks_per_node else links.inter_node
    return (layers + logits) / bandwidth


def all_to_all_s(shape: ModelShape, spec: StepSpec, links: Links) -> float:
    """Ulysses' all-to-alls (trainer/parallel/sequence.py): per layer and pass (forward,
    backward, a checkpoint's recompute) q, k, v and the output, each rank sending (sp-1)/sp of
    its slice's; within a node while the sequence group fits in one, else over the network."""
    sp = spec.sequence_parallel
    if sp == 1:
        return 0.0
    tokens = spec.num_sequences * spec.local_seq_len
    kv = max(shape.num_kv_heads, sp) * shape.head_dim
    per_layer = spec.compute_bytes * tokens * (2 * shape.num_heads * shape.head_dim + 2 * kv)
    recomputed = _recomputed(shape, spec)
    passes = (2 + recomputed) * spec.grad_accum
    bandwidth = links.intra_node if sp <= spec.ranks_per_node else links.inter_node
    return (sp - 1) / sp * per_layer * shape.num_layers * passes / bandwidth


def expert_all_to_all_s(shape: ModelShape, spec: StepSpec, links: Links) -> float:
    """The expert split's all-to-alls (trainer/parallel/expert.py): per MoE layer and pass
    (forward, backward, a checkpoint's recompute) the dispatch and the combine, each moving a
    rank's tokens x top-k rows of the hidden size, (N-1)/N of them to other ranks on average
    (every layer counted as an MoE one); within a node while the expert group fits in one."""
    ep = shape.expert_parallel
    if ep == 1:
        return 0.0
    rows = spec.num_sequences * spec.local_seq_len * shape.experts_per_token
    per_layer = 2 * spec.compute_bytes * rows * shape.hidden_size
    passes = (2 + _recomputed(shape, spec)) * spec.grad_accum
    bandwidth = links.intra_node if ep <= spec.ranks_per_node else links.inter_node
    return (ep - 1) / ep * per_layer * shape.num_layers * passes / bandwidth


def _host_s(
    shape: ModelShape, spec: StepSpec, hw: Hardware, links: Links, compute_s: float,
    offloaded_bytes: int,
) -> float:  # fmt: skip
    """Offloaded state over PCIe, AdamW on the host, NVMe, and activation offload's copies."""
    rung, world = spec.row, max(1, spec.world_size)
    cost = method_cost(shape, spec.finetune, spec.compute_bytes)
    per_rank = cost.trained / world  # what is stepped and moved once per step or reduction
    pcie_bytes = (rung.pcie_per_step + rung.offloaded_grads * _grad_reductions(spec)) * per_rank
    # parameters, per use: a rank gathers its tensor rank's share of each
    gathered = cost.gathered / spec.tensor_parallel
    pcie_bytes += rung.pcie_per_micro * spec.grad_accum * gathered / spec.shard_ranks
    seconds = pcie_bytes / links.pcie
    if rung.host_adam_params_s:
        seconds += per_rank * min(hw.devices_per_node, world) / rung.host_adam_params_s
    seconds += rung.nvme_per_step * per_rank / links.nvme
    if spec.offload_activations:
        per_node = spec.ranks_per_node * offloaded_bytes * spec.grad_accum
        recomputed = _recomputed(shape, spec)
        forward_s = compute_s / (3 + recomputed)  # forward 1, backward 2, the recompute in it
        seconds += offload_seconds(
            offloaded_bytes * spec.grad_accum, per_node, links.pcie, links.host, forward_s,
            compute_s - forward_s,
        )  # fmt: skip
    return seconds


def recomputed_head_flops_per_token(hidden: int, vocab: int) -> float:
    """Chunked loss runs the output layer's forward matmul again in backward."""
    return 2.0 * hidden * vocab


def offload_seconds(
    saved_bytes: int, node_bytes: int, pcie_bytes_per_s: float, host_bytes_per_s: float,
    forward_s: float, backward_s: float,
) -> float:  # fmt: skip
    """Activation offload's copies on side streams: what compute does not hide. The copies out
    run during forward and can hide only behind it; the copies back during backward (with its
    recompute). Each device's bytes cross its own PCIe link, and all of the node's devices'
    bytes (`node_bytes`) cross the host memory they share; the slower of the two is the
    transfer each way. Charge what exceeds the pass it overlaps (torchtune measured <1%
    slowdown at 8B where it hides), plus a fixed 2% of compute for the stream syncs."""
    each_way = max(saved_bytes / pcie_bytes_per_s, node_bytes / host_bytes_per_s)
    exposed = max(0.0, each_way - forward_s) + max(0.0, each_way - backward_s)
    return exposed + 0.02 * (forward_s + backward_s)
