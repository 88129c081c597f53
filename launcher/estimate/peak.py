"""Peak memory per device and per host for one training step (a `StepSpec`). Pure arithmetic.

The model describes what oomless's engine and backends allocate (docs/memory.md has the formulas
and their sources). It composes three parts: one rank's model states
(`launcher/estimate/model_states.py`), one micro-batch's activations
(`launcher/estimate/analytic_activations.py`), and the transients of the step: the autocast
weight-cast cache (a 16-bit copy of every weight used in forward), FSDP all-gathers of the current
and prefetched layer plus the root and reduce-scatter buffers, DeepSpeed buckets and the
live/prefetched ZeRO-3 parameters (AdamW is fused: no temporaries). Runtime overhead is a constant
for the CUDA context plus what the caching allocator reserves beyond the live tensors, a ratio of
the bytes that come and go, by allocator mode (docs/memory.md "What the allocator reserves").

The breakdown lists the size of each part; the peak is the largest of the step's phases (end of
forward, the loss, the backward of every layer, the embedding's, the optimizer step), since
activations and gradients, or the autocast cache and the optimizer's temporaries, are never all
alive at once. Single and fsdp are calibrated against `launcher/estimate/trace.py` (tests/launcher/
test_estimate_trace.py); the DeepSpeed rungs follow the ZeRO paper and DeepSpeed's source.
Notation: N parameters, W ranks, b micro-batch, s sequence length, h hidden, V vocabulary, L
layers, c bytes of the compute dtype (2 for bf16/fp16, 4 for fp32).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from launcher.estimate.analytic_activations import (
    MODELLED_TYPES,
    Micro,
    MicroActivations,
    checkpoint_kept,
    layer_activation_bytes,
    micro_activations,
    micro_for,
)
from launcher.estimate.expert_split import expert_rank_shape
from launcher.estimate.methods import method_sizes, quantising_bytes
from launcher.estimate.model_states import model_states
from launcher.estimate.shape import ModelShape
from launcher.estimate.state_flow import GradFlow, ModelStates
from launcher.estimate.tensor_split import tensor_rank_shape
from trainer.core.errors import ConfigError
from trainer.core.step_spec import (
    OFFLOAD_LAYERS_IN_FLIGHT,
    OFFLOAD_MAX_IN_FLIGHT_BYTES,
    StepSpec,
)
from trainer.core.strategies import Strategy
from trainer.core.units import GIB

CUDA_CONTEXT_BYTES = int(0.75 * GIB)  # CUDA context + cuBLAS/cuDNN workspaces, measured typical
# What the caching allocator reserves beyond the peak of live tensors, per byte that comes and goes
# in a step (docs/memory.md "What the allocator reserves"), both from oomless's own engine on one
# H200 (docs/gpu.md, estimate runs 4 and 5, fsdp): `expandable` (PYTORCH_CUDA_ALLOC_CONF=
# expandable_segments:True, which the launcher sets on CUDA ranks), what the steps needed: capped
# at the estimate they ran; `default`, what they held above their peak with the card's room
# (9.63 GiB over 14.13 GiB that came and went), until the default allocator itself is measured.
ALLOCATOR_SLACK_RATIO = {"default": 0.68, "expandable": 0.08}
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
CPU_PROCESS_BYTES = int(1.0 * GIB)  # python + torch + transformers in a CPU process (RSS)
HOST_PROCESS_BYTES = int(2.0 * GIB)  # per rank on the host: libraries, dataloader, pinned staging
# Bytes per trained parameter that DeepSpeed's canonical checkpoint state holds on the host: its
# full fp32 weight and two fp32 AdamW moments (trainer/backends/deepspeed.py `state_dict`)
DEEPSPEED_CHECKPOINT_BYTES_PER_PARAM = 4 + 8
# The host buffers DeepSpeed's ZeRO-3 pins on GPUs (`get_accelerator().pin_memory`: torch's
# `pin_memory()`), and the most elements one holds: the fp32 gradient partition, one per
# sub-group of `sub_group_size` (10^9) elements (stage3.py `initialize_optimizer_states`); the
# one backward fills, whole (`_setup_for_real_optimizer`); the parameters', one per parameter
# group (`_create_param_groups_fp16_flat_cpu_memory`). torch's caching host allocator rounds
# each pinned block up to a power of two (CachingHostAllocator.h: `PowerOf2Ceil`, by default
# at every size).
DEEPSPEED_PINNED_TERMS = {"grads": 1_000_000_000, "grad_accumulation": None, "params": None}

# With activation offload on a GPU, the phases from the layers' forward to backward's first
# unpack, where copies to the host may still hold their device tensors (`in_flight_bytes`); on
# CPU processes the copies are done when they return.
IN_FLIGHT_PHASES = ("forward", "forward_layers", "layer_gather", "loss", "backward_start",
                    "backward_head")  # fmt: skip
DEVICE_PARTS = ("params", "grads", "optimizer", "activations", "temporary", "runtime_overhead")


@dataclass(frozen=True)
class Estimate:
    strategy: str
    world_size: int
    micro_batch_size: int
    activation_checkpointing: str
    device_breakdown: dict[str, int]
    peak_tensor_bytes: int  # predicted torch.cuda.max_memory_allocated
    # + runtime overhead (CUDA context, the allocator's reserve): what must fit in device memory
    device_total_bytes: int
    host_breakdown: dict[str, int] = field(default_factory=dict)
    host_total_bytes: int = 0  # per node
    phases: dict[str, int] = field(default_factory=dict)  # live bytes at each point of the step
    offloaded_bytes: int = 0  # per rank and micro-batch, with activation offload (PCIe each way)
    chunked_loss: bool = False
    offload_activations: bool = False
    calibrated: bool = False  # the runtime overhead is what a launch probe measured

    def to_json(self, fits: bool) -> dict[str, Any]:
        """The `strategies[]` entry of docs/interface.md."""
        return {
            "name": self.strategy,
            "world_size": self.world_size,
            "micro_batch_size": self.micro_batch_size,
            "activation_checkpointing": self.activation_checkpointing,
            "chunked_loss": self.chunked_loss,
            "offload_activations": self.offload_activations,
            "fits": fits,
            "device": {
                "peak_tensor_bytes": self.peak_tensor_bytes,
                "total_bytes": self.device_total_bytes,
                "breakdown": dict(self.device_breakdown),
            },
            "host": {"total_bytes": self.host_total_bytes, "breakdown": dict(self.host_breakdown)},
        }


def _backward_layers(
    shape: ModelShape, m: Micro, a: MicroActivations, head: int, grads: GradFlow, gather: int
) -> int:
    """The highest live bytes of any decoder layer's backward: what the layers below it saved,
    its own activations (rebuilt if checkpointed), the gradients of the layers above it."""
    num_layers, f = shape.num_layers, a.forward
    peak, below, ops_below = 0, 0, 0
    for k in range(num_layers):
        above = num_layers - 1 - k
        live = (
            head - above * grads.released_per_layer + below + f.rotary + f.per_layer
            + above * grads.per_layer + a.layer_backward + gather + grads.in_layer + m.dequant
            + m.adapter_grad * m.tokens + (grads.pending_reduce if above else 0)
        )  # fmt: skip
        peak = max(peak, live)
        below += f.kept_ckpt if k in m.ckpt else f.per_layer
        if m.offload:  # the layers below wait on the host (but op-level outputs); the next one
            below = (f.kept_ckpt if k in m.ckpt else f.per_layer) + ops_below  # comes back
            ops_below += f.kept_ops if k in m.ckpt else 0
    return peak


def _forward_backward_peaks(
    shape: ModelShape, m: Micro, a: MicroActivations, states: ModelStates, grads: GradFlow
) -> dict[str, int]:
    """Live bytes at the points where one micro-batch's forward and backward peak, with the
    gradients coming and going as `grads` says (the first or a later micro-batch).

    `states.gather_*`: parameters a sharded rung holds unsharded while a layer or the root
    computes; `states.root_kept`: the part of it held from forward's end into backward (FSDP2
    does not reshard the root after forward)."""
    num_layers, t, h = shape.num_layers, m.tokens, shape.hidden_size
    f, hd, final = a.forward, a.head, a.final
    gather_root, root_kept = states.gather_root, states.root_kept
    in_layers = gather_root if states.root_in_layers is None else states.root_in_layers
    start = states.base + grads.held
    head = start + f.mask_kept + gather_root + grads.head
    released = (num_layers - 1) * grads.released_per_layer  # by the first layer's backward
    in_forward = start + f.saved + f.mask + f.cache + in_layers
    # the head's own group is resharded, and its grads reduced, after the head's backward
    after_head = head - states.head_group - grads.head_released
    measured = {}
    if a.forward_transient is not None:  # a layer's own transients in forward (eager attention)
        measured["forward_layers"] = (
            in_forward + a.forward_transient + states.gather_layer + a.layer_transient
        )
    loss_tensors = hd.logits + hd.copy + 4 * hd.rows_v
    backward_layers = _backward_layers(shape, m, a, after_head, grads, states.gather_layer)
    return measured | {
        # (with chunked loss the loss runs inside the model's forward, one chunk at a time)
        # (LoRA under autocast: the last block's largest fp32 cast of an adapter's input)
        "forward": in_forward + gather_root - in_layers + final + hd.logits + hd.in_forward
        + m.adapter_grad * t,
        "layer_gather": in_forward + states.gather_layer + a.layer_transient,
        "loss": start + f.saved + f.mask_kept + f.cache + final + loss_tensors + root_kept,
        "backward_start": start + f.saved + f.mask_kept + final + 12 * hd.rows_v + root_kept,
        "backward_head": head + f.saved + final + hd.backward,
        "backward_layers": backward_layers,
        # the embedding's backward, with the last layer's reduce-scatter still in flight
        "backward_embedding": start - released - grads.released_per_layer + f.mask_kept
        + num_layers * grads.per_layer + 4 * t * h + grads.root_at_embedding + grads.pending_reduce
        + (gather_root if states.root_in_layers is None else in_layers + states.embed_regather),
        # a sharded root is resharded, then its gradients are reduced
        "backward_end": start - num_layers * grads.released_per_layer
        + num_layers * grads.per_layer + grads.reduce_root,
    }  # fmt: skip


def _step_phases(
    shape: ModelShape, m: Micro, a: MicroActivations, states: ModelStates, accumulating: bool
) -> dict[str, int]:
    """Live bytes at each peak point of the step: the first micro-batch, a later one (with the
    accumulated gradients alive), and the optimizer step."""
    phases = _forward_backward_peaks(shape, m, a, states, states.first)
    if accumulating:
        again = _forward_backward_peaks(shape, m, a, states, states.later)
        phases = {k: max(v, again[k]) for k, v in phases.items()}
    phases["optimizer"] = states.base + states.grads_at_step  # fused AdamW: no temporaries
    return phases


def in_flight_bytes(shape: ModelShape, m: Micro, offloaded: int) -> int:
    """What waits on a GPU for its copy to the host under activation offload: at most
    OFFLOAD_MAX_IN_FLIGHT_BYTES, the tensors of the last OFFLOAD_LAYERS_IN_FLIGHT layers
    (trainer/memory/offload.py), and what the micro-batch offloads."""
    plain = shape.num_layers > len(m.ckpt)
    per_layer = layer_activation_bytes(shape, m) if plain else checkpoint_kept(shape, m)[0]
    return min(OFFLOAD_MAX_IN_FLIGHT_BYTES, OFFLOAD_LAYERS_IN_FLIGHT * per_layer, offloaded)


def expandable_segments(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the ranks' caching allocator runs with expandable segments: the launcher sets it
    on CUDA (launcher/run/launch.py) unless the user's own allocator setting says otherwise."""
    conf = next((environ[k] for k in ALLOC_CONF_VARS if k in environ), None)
    return conf is None or "expandable_segments:true" in conf.replace(" ", "").lower()


def allocator_slack_bytes(transient_bytes: int, expandable: bool) -> int:
    """Bytes the caching allocator reserves beyond the peak of live tensors. Model states are
    allocated once, in large blocks; the slack grows with what is allocated and freed every step
    (activations, gathers, buffers): `transient_bytes`, the peak less the persistent states."""
    ratio = ALLOCATOR_SLACK_RATIO["expandable" if expandable else "default"]
    return int(ratio * max(0, transient_bytes))


def _runtime_overhead(spec: StepSpec, peak: int, persistent: int) -> int:
    """Device bytes outside the step's tensors: on CUDA the context and the allocator's reserve,
    on CPU processes the interpreter and libraries; as a launch probe of this hardware and rung
    measured them where one did (`spec.runtime_fixed_bytes`, launcher/plan/calibration.py)."""
    fixed = spec.runtime_fixed_bytes
    if spec.device != "cuda":
        return CPU_PROCESS_BYTES if fixed is None else fixed
    # A first step reserves less than later ones (on one H200 the second step's pool grew by
    # FSDP2's all-gather buffer, docs/gpu.md): a probe raises the reserve, never lowers it.
    reserve = allocator_slack_bytes(peak - persistent, expandable_segments())
    if spec.reserve_ratio is not None:
        reserve = max(reserve, int(spec.reserve_ratio * max(0, peak - persistent)))
    return (CUDA_CONTEXT_BYTES if fixed is None else fixed) + reserve


def loading_host_bytes(
    shape: ModelShape,
    row: Strategy,
    ranks_here: int,
    bytes_per_param: int = 4,
    built_whole: bool = False,
) -> int:
    """Host bytes per node that loading the initial (pretrained) weights adds at its peak.

    A replica (single, ddp, ZeRO-1/2) is built whole on the host by each rank: in fp32 (4N per
    rank), or for a frozen LoRA/QLoRA base loaded from pretrained weights in the 16-bit compute
    dtype (`bytes_per_param` 2: 2N; QLoRA quantises it layer by layer afterwards). A sharded
    rung reads its own part from the safetensors files into its parameters
    (`trainer/model/pretrained.py`): beyond the part itself (counted with the model states) at most
    one tensor in flight per rank, its fp32 copy on the way to the device (4 x the largest
    tensor); QLoRA's rank streams each weight through in chunks and keeps its rows of the 4-bit
    storage (`trainer/model/qlora_load.py`), less than that. zero3_nvme builds the full weights on
    rank 0 (the model, then its state dict cloned: 8N) and sends each rank its part, as random
    init does on every sharded rung. QLoRA on ZeRO-3 (`built_whole`) is built whole by each rank
    before ZeRO-3 partitions it, as a replica is."""
    n = shape.num_params
    if row.streams_layers:  # built whole, each parameter moved into the host buffers it counts
        return 0
    if not row.shards_params or built_whole:
        return bytes_per_param * n * ranks_here
    if row.needs_nvme:
        return 8 * n
    return 4 * shape.largest_tensor_params * ranks_here


def checkpoint_host_bytes(
    row: Strategy, trained_params: int, world_size: int, ranks_here: int
) -> int:
    """Host bytes per node that saving or resuming a checkpoint adds beside the model states.

    A DeepSpeed rung's canonical state (trainer/backends/deepspeed.py `state_dict`) copies the
    full fp32 weight and both AdamW moments of each parameter a rank owns to the host, the ranks
    owning about 1/W of the trained parameters each; a resume fills that same form from the files
    (`trainer/engine.py` `_resume`: `load_template(backend.state_dict())`) before copying it into
    the partitions. FSDP2 and the replicas hand DCP their own tensors, which it reads into in
    place: nothing beside them."""
    if row.engine != "deepspeed":
        return 0
    per_rank = DEEPSPEED_CHECKPOINT_BYTES_PER_PARAM * trained_params // max(1, world_size)
    return per_rank * ranks_here


def pinned_block_bytes(nbytes: int, elements: int | None = None) -> int:
    """What pinning `nbytes` of fp32 buffers of at most `elements` values each takes (None:
    one buffer), each rounded up to a power of two."""
    chunk = 4 * elements if elements else max(1, nbytes)
    full, rest = divmod(nbytes, chunk)
    return full * (1 << (chunk - 1).bit_length()) + (rest and 1 << (rest - 1).bit_length())


def _host_bytes(
    row: Strategy,
    states: ModelStates,
    shape: ModelShape,
    ranks_here: int,
    device_bytes: int,
    device: str,
    load_bytes: int,
    qlora: bool = False,
    checkpoint_bytes: int = 0,
) -> dict[str, int]:
    """Host memory per node: every rank's offloaded states, loading the initial weights
    (`loading_host_bytes` with `load_bytes` per parameter), a checkpoint's save or load
    (`checkpoint_host_bytes`), process baseline."""
    host = {k: v * ranks_here for k, v in states.on_host.items()}
    built_whole = qlora and row.engine == "deepspeed"
    host["initial_weights"] = loading_host_bytes(shape, row, ranks_here, load_bytes, built_whole)
    if checkpoint_bytes:  # beyond the step's peak
        host["checkpoint"] = checkpoint_bytes
    if device == "cuda" and row.engine == "deepspeed" and row.zero_stage == 3:
        pinned = [(states.on_host.get(k, 0), n) for k, n in DEEPSPEED_PINNED_TERMS.items()]
        rounding = sum(pinned_block_bytes(b, n) - b for b, n in pinned)
        if rounding:
            host["pinned_rounding"] = rounding * ranks_here
    host["processes"] = HOST_PROCESS_BYTES * ranks_here
    if device == "cpu":  # the "device" is host memory too
        host["device_memory_of_cpu_ranks"] = device_bytes * ranks_here
    return host


def estimate(shape: ModelShape, spec: StepSpec) -> Estimate:
    """Peak bytes on one device and on one host for one training step of `spec`.

    Every `grad_accum` above 1 costs the same (later micro-batches run with the earlier ones'
    gradients alive); the exact levers count as the engine runs them
    (launcher/estimate/analytic_activations.py); the method and optimizer as
    launcher/estimate/methods.py says."""
    _check_modelled(shape)
    shape = tensor_rank_shape(shape, spec.tensor_parallel)
    shape = expert_rank_shape(shape, spec.compute_bytes)
    m = micro_for(spec, shape)
    acts = micro_activations(shape, m)
    states = model_states(spec, shape)
    phases = _step_phases(shape, m, acts, states, spec.grad_accum > 1)
    if spec.offload_activations and spec.device == "cuda":
        in_flight = in_flight_bytes(shape, m, acts.offloaded)
        phases |= {k: v + in_flight for k, v in phases.items() if k in IN_FLIGHT_PHASES}
    peak = max(phases.values())
    persistent = states.base + states.grads_at_step
    overhead = _runtime_overhead(spec, peak, persistent)
    breakdown = {
        **states.on_device,
        "activations": acts.on_device,
        "temporary": max(0, peak - persistent - acts.on_device),
        "runtime_overhead": overhead,
    }
    ranks_here = spec.ranks_per_node
    # a frozen base (and a bf16_pure model) from pretrained weights loads in its compute
    # dtype (trainer/model/finetune.py)
    ft, row = spec.finetune, spec.row
    sixteen = ft.adapters or spec.precision == "bf16_pure"
    load_bytes = m.c if sixteen and ft.pretrained else 4
    if ft.method == "qlora" and row.engine == "fsdp":
        # each rank quantises one chunk of a weight at a time into its shard
        # (trainer/model/qlora_load.py): its states plus the chunk and the weight's block scales
        phases["loading"] = states.base + quantising_bytes(shape, spec.device)
        peak = max(peak, phases["loading"])
    trained = method_sizes(shape, ft, m.c, spec.trained_bytes).trainable
    saving = checkpoint_host_bytes(row, trained, spec.world_size, ranks_here)
    if spec.device == "cpu":  # a CPU rank saves or loads without the step's transients
        saving = max(0, saving - (peak - persistent) * ranks_here)
    host = _host_bytes(row, states, shape, ranks_here, peak + overhead, spec.device, load_bytes,
                       qlora=ft.method == "qlora", checkpoint_bytes=saving)  # fmt: skip
    offloaded = acts.offloaded
    if spec.offload_activations:  # pinned blocks on a GPU, plain copies on CPU processes
        held = acts.pinned if spec.device == "cuda" else offloaded
        host["offloaded_activations"] = held * ranks_here
    return Estimate(
        strategy=spec.strategy,
        world_size=max(1, spec.world_size),
        micro_batch_size=spec.micro_batch_size,
        activation_checkpointing=spec.activation_checkpointing,
        device_breakdown={k: int(breakdown.get(k, 0)) for k in DEVICE_PARTS},
        peak_tensor_bytes=int(peak),
        device_total_bytes=int(peak + overhead),
        host_breakdown={k: int(v) for k, v in host.items()},
        host_total_bytes=int(sum(host.values())),
        phases=phases,
        offloaded_bytes=offloaded,
        chunked_loss=spec.chunked_loss,
        offload_activations=spec.offload_activations,
        calibrated=spec.runtime_fixed_bytes is not None,
    )


def _check_modelled(shape: ModelShape) -> None:
    if shape.model_type not in MODELLED_TYPES and shape.activations is None:
        raise ConfigError(
            "model.model_type",
            f"the memory estimate models {', '.join(MODELLED_TYPES)} decoder blocks, not "
            f"{shape.model_type} (its activations are not checked against a trace)",
            "plan it with `oomless plan` or `oomless estimate` (they measure other blocks' "
            "activations: launcher/estimate/activations.py)",
        )
