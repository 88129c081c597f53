"""One rank's model states for a rung: parameters, gradients and optimizer state on the device and
on the host, and how gradients come and go during a step. Pure arithmetic (docs/memory.md).

Mixed precision keeps fp32 master weights, fp32 grads and two fp32 AdamW moments: 4N + 4N + 8N on
`single`/`ddp`, divided by the world as each ZeRO/FSDP stage shards them; offload rungs move them
to host memory. With adapters (LoRA, QLoRA) only the adapters train: their fp32 weights, fp32
gradients and optimizer state are what the rung shards or offloads, as it does a full model's;
the frozen base (16-bit, or NF4 under QLoRA) is replicated on `single`, `ddp`, `zero1` and
`zero2`, sharded on `fsdp` and `zero3`, on the host on the offload rungs that keep parameters
there. Full fine-tuning with 8-bit moments swaps the two fp32 moments for the 8-bit ones
(byte counts: `launcher/estimate/methods.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from launcher.estimate.methods import (
    MethodSizes,
    adam_state_bytes,
    adapter_tensors,
    layer_tensors,
    method_sizes,
    root_tensors,
)
from launcher.estimate.shape import ModelShape
from launcher.estimate.state_flow import GradFlow, ModelStates
from launcher.estimate.stream_states import stream_states
from trainer.core.step_spec import FULL, Finetune, StepSpec
from trainer.core.strategies import DEEPSPEED_BUCKET_ELEMENTS, Strategy

# `stage3_max_reuse_distance` (trainer/backends/deepspeed_config.py, DeepSpeed's default too):
# ZeRO-3 keeps a module's gathered parameters after its forward when the step's trace uses them
# again within this many elements (partitioned_param_coordinator.py `__params_to_release`); their
# next use, in backward, is twice the elements after them away: the forward's last half-distance
# of parameters stays gathered into backward (`zero3_kept_gathered` elements).
ZERO3_MAX_REUSE_DISTANCE = 1_000_000_000


def zero3_kept_gathered(num_params: int) -> int:
    return min(num_params, ZERO3_MAX_REUSE_DISTANCE // 2)


def model_states(spec: StepSpec, shape: ModelShape) -> ModelStates:
    """One rank's model states for `spec`: full fine-tuning by the rung's engine; LoRA and QLoRA
    train adapters over a frozen base; 8-bit moments shrink the optimizer state."""
    row, ft = spec.row, spec.finetune
    z = Sizes.of(shape, spec.shard_ranks, spec.compute_bytes, spec.grad_accum,
                 spec.trained_bytes)  # fmt: skip
    every = spec.fsdp_reduce_every_micro_batch
    sizes = method_sizes(shape, ft, z.c, z.p)
    if not ft.adapters:
        states = _FULL_STATES[row.engine](row, z, shape, every)
        if ft.optimizer != FULL.optimizer:
            states = _eight_bit_moments(row, z, states, sizes)
    else:
        states = _ADAPTER_STATES[row.engine](row, z, shape, every, sizes)
    if ft.optimizer == "paged_adamw_8bit":
        states = _paged_moments(row, z, states, shape, ft)
    return _stepped_in_backward(row, states) if ft.in_backward else states


def _paged_moments(
    row: Strategy, z: Sizes, states: ModelStates, shape: ModelShape, ft: Finetune
) -> ModelStates:
    """`paged_adamw_8bit`: the 8-bit states live in CUDA managed memory, which the driver moves
    to the host when the device runs short; on the device they need only what one step touches
    at a time, bitsandbytes prefetching the next tensor's while it steps one (the two largest
    tensors' states, sharded like them). The rest is counted on the host."""
    if row.optimizer_at != "device":
        return states
    tensors = adapter_tensors(shape, ft) if ft.adapters else layer_tensors(shape)
    tensors = tensors + ([] if ft.adapters else root_tensors(shape))
    largest = sorted(tensors)[-2:]
    shards = 1 if row.engine in ("single", "ddp") or row.zero_stage == 1 else z.w
    working = adam_state_bytes(largest, ft.optimizer) // shards
    held = states.on_device["optimizer"]
    moved = max(0, held - working)
    on_device = {**states.on_device, "optimizer": held - moved}
    on_host = {**states.on_host, "optimizer": states.on_host.get("optimizer", 0) + moved}
    return replace(states, on_device=on_device, on_host=on_host, base=states.base - moved)


def _stepped_in_backward(row: Strategy, states: ModelStates) -> ModelStates:
    """`train.optimizer_in_backward`: each parameter (each shard, under FSDP2) is stepped from
    its post-accumulate-grad hook and its gradient freed there, so no gradients are held from
    layer to layer or at the step; a layer's own, while it back-propagates, remain (with one
    micro-batch per step, which the config and the ladder hold to)."""
    flow = replace(states.first, held=0, per_layer=0, released_per_layer=0)
    on_device = {**states.on_device, "grads": flow.in_layer if row.params_at == "device" else 0}
    on_host = {k: v for k, v in states.on_host.items() if k != "grads"}
    return replace(states, on_device=on_device, on_host=on_host, grads_at_step=0, first=flow,
                   later=flow)  # fmt: skip


def zero_model_state_bytes(
    num_params: int,
    *,
    stage: int,
    world_size: int,
    param_bytes: int,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    largest_layer_params: int = 0,
) -> tuple[dict[str, int], dict[str, int]]:
    """(device, host per rank) model-state bytes of DeepSpeed ZeRO `stage` for one rank.

    The ZeRO paper's accounting (Rajbhandari et al. 2020, sec. 3 and 5: 2Ψ + 2Ψ + KΨ/Nd for
    stage 1, 2Ψ + (2 + K)Ψ/Nd for stage 2, (2 + 2 + K)Ψ/Nd for stage 3) with DeepSpeed's own
    refinements, so that with 16-bit parameters (`param_bytes=2`) it equals DeepSpeed's
    `estimate_zero2/3_model_states_mem_needs`: the optimizer keeps an fp32 master partition (4),
    two fp32 moments (8) and an fp32 gradient partition (4) besides the working parameters and
    their gradients, and stage 3 gathers the largest layer's parameters and gradients (2 x
    param_bytes per element). Our backend trains fp32 parameters under autocast
    (`param_bytes=4`): stage 3 then uses the parameter partition itself as the master copy
    (no clone), stages 1 and 2 still clone it.
    """
    n, w, p = num_params, max(1, world_size), param_bytes
    master = 0 if stage == 3 and p == 4 and not offload_optimizer else 4
    optimizer = (master + 8) * n // w
    fp32_grads = 4 * n // w
    if stage == 1:
        device = {"params": p * n, "grads": p * n + fp32_grads, "optimizer": optimizer}
    elif stage == 2:
        device = {"params": p * n, "grads": p * n // w + fp32_grads, "optimizer": optimizer}
    elif stage == 3:
        device = {"params": p * n // w, "grads": fp32_grads, "optimizer": optimizer}
    else:
        raise ValueError(f"ZeRO stage {stage}")
    host: dict[str, int] = {}
    if offload_optimizer:
        # DeepSpeed's stage3.py on the host: the fp32 master partition
        # (`_create_fp32_partitions`: `.to("cpu").clone()`, a copy even of fp32 parameters),
        # AdamW's moments (trainer/backends/deepspeed.py `_init_optimizer_state`), the fp32
        # gradient partition it steps (`initialize_optimizer_states`: each sub-group's `.grad`)
        host = {"optimizer": (4 + 8) * n // w, "grads": fp32_grads}
        if stage == 3:  # and the one backward's reduce-scatters fill (`_setup_for_real_optimizer`:
            # `grad_partitions_flat_buffer` on `self.device`, the CPU when the optimizer is
            # offloaded); `estimate_zero3_model_states_mem_needs` leaves it out
            host["grad_accumulation"] = 4 * n // w
        device["optimizer"] = 0
        device["grads"] = 0 if stage >= 2 else p * n
    if offload_params:  # the partitions in one flat host buffer per parameter group, pinned on
        # GPUs whatever the config says (`_create_param_groups_fp16_flat_cpu_memory`)
        host["params"] = device["params"]
        device["params"] = 0
    if stage == 3:
        device["gathered"] = 2 * p * largest_layer_params
    return device, host


@dataclass(frozen=True)
class Sizes:
    """Parameter counts and per-rank factors every model-state function uses."""

    n: int  # all parameters
    w: int  # ranks
    c: int  # compute dtype bytes
    layer_n: int  # a decoder layer, the layers' mean
    top_n: int  # the largest decoder layer (gathered, its gradients made, at the peak)
    root_n: int
    head_n: int  # lm_head (or the tied embedding) + final norm
    lm_head_n: int  # lm_head alone
    embed_n: int
    tied_embed: int  # the embedding's parameters when tied to the head, else 0
    accumulating: bool
    bucket: int  # DeepSpeed's fp32 reduce bucket
    p: int = 4  # bytes of a trained weight, its gradient and each moment (2: bf16_pure)

    @classmethod
    def of(cls, shape: ModelShape, w: int, c: int, grad_accum: int, p: int = 4) -> Sizes:
        embed_n = shape.num_embedding_params
        return cls(
            n=shape.num_params,
            w=w,
            c=c,
            layer_n=shape.num_layer_params,
            top_n=shape.gathered_layer_params,
            root_n=shape.num_root_params,
            head_n=shape.num_head_params + shape.hidden_size,
            lm_head_n=shape.num_head_params,
            embed_n=embed_n,
            tied_embed=embed_n if shape.tied_embeddings else 0,
            accumulating=grad_accum > 1,
            bucket=4 * min(DEEPSPEED_BUCKET_ELEMENTS, shape.num_params),
            p=p,
        )


def _replicated_states(row: Strategy, z: Sizes, shape: ModelShape, fsdp_every: bool):
    """single, ddp and ZeRO-1: full fp32 parameters and gradients on every rank (bf16 ones
    under bf16_pure, p = 2, where no autocast runs)."""
    n, w, p = z.n, z.w, z.p
    if row.zero_stage == 1:
        dev, _ = zero_model_state_bytes(n, stage=1, world_size=w, param_bytes=4)
        on_device = {k: dev[k] for k in ("params", "grads", "optimizer")}
    else:
        on_device = {"params": p * n, "grads": p * n, "optimizer": 2 * p * n}
    base = on_device["params"] + on_device["optimizer"]
    # AccumulateGrad: the first gradient of a weight becomes its .grad (fp32, from the 16-bit
    # one autocast's backward makes); a tied embedding's is summed out of place.
    untied_embed = z.embed_n - z.tied_embed
    first = GradFlow(
        held=0,
        per_layer=p * z.layer_n,
        in_layer=p * z.top_n,
        head=p * z.head_n,
        root_at_embedding=p * z.head_n + p * untied_embed + 2 * p * z.tied_embed,
    )
    later = GradFlow(held=p * n, root_at_embedding=p * z.embed_n)
    grads_at_step = on_device["grads"]
    if row.engine == "ddp":  # gradient_as_bucket_view: the buckets hold the grads for good
        base += on_device["grads"]
        first = later = GradFlow(root_at_embedding=p * z.embed_n)
        grads_at_step = 0
    if row.zero_stage == 1:  # the boundary reduces the full grads through the bucket
        first = replace(first, reduce_root=4 * n + z.bucket)
        later = replace(later, reduce_root=z.bucket)
    return ModelStates(on_device, {}, base, grads_at_step, first, later)


def _fsdp_states(row: Strategy, z: Sizes, shape: ModelShape, fsdp_every: bool):
    """FSDP2: everything sharded over the ranks (on the host under CPUOffloadPolicy); 16-bit
    gathers per layer; the root stays gathered from forward into backward. Under bf16_pure
    (p = 2) the shards are bf16 and gradients are reduced in bf16."""
    n, w, c, p, layer_n, root_n = z.n, z.w, z.c, z.p, z.layer_n, z.root_n
    shard = {"params": p * n // w, "grads": p * n // w, "optimizer": 2 * p * n // w}
    on_device, on_host = dict(shard), {}
    if row.offloads:  # fp32 params, grads and AdamW on the host
        on_device, on_host = {"params": 0, "grads": 0, "optimizer": 0}, dict(shard)
    # the root's 16-bit unsharded grads during the embedding's backward (tied: summed)
    root_unsharded = c * root_n + c * z.tied_embed
    sync = GradFlow(
        held=p * n if z.accumulating else 0,  # no_sync kept unsharded fp32 grads till now
        per_layer=on_device["grads"] and p * layer_n // w,
        head=c * z.head_n,
        root_at_embedding=root_unsharded,
        in_layer=c * z.top_n,  # its 16-bit unsharded grads, before the reduce-scatter
        released_per_layer=p * layer_n if z.accumulating else 0,
        reduce_root=reduce_scatter_bytes(root_n, c, w, p),
        pending_reduce=p * z.top_n,
    )
    no_sync = GradFlow(  # unsharded fp32 gradient accumulation on every rank
        per_layer=p * layer_n,
        in_layer=p * z.top_n,
        head=p * z.head_n,
        root_at_embedding=p * root_n + root_unsharded,
    )
    # the gathered layer: unsharded params + the all-gather output; the root (embeddings,
    # norm, lm_head) stays unsharded through forward and backward
    return _fsdp_model_states(on_device, on_host, sync, no_sync, z, fsdp_every, 2 * c * z.top_n)


def _zero_states(row: Strategy, z: Sizes, shape: ModelShape, fsdp_every: bool):
    """DeepSpeed ZeRO-2/3 and its offload rungs (ZeRO-1 accounts like a replica)."""
    if row.zero_stage == 1:
        return _replicated_states(row, z, shape, fsdp_every)
    dev, host = zero_model_state_bytes(
        z.n,
        stage=row.zero_stage,
        world_size=z.w,
        param_bytes=4,  # fp32 parameters, 16-bit compute by autocast
        offload_optimizer=row.optimizer_at != "device",
        offload_params=row.params_at != "device",
    )
    on_device = {k: dev[k] for k in ("params", "grads", "optimizer")}
    if row.needs_nvme:  # states on NVMe; the host keeps swap buffers
        host = {"nvme_buffers": 2 * 16 * z.top_n}
    # a layer's fp32 grads live until DeepSpeed's hooks copy them into the bucket
    flow = GradFlow(in_layer=4 * z.top_n, root_at_embedding=4 * z.embed_n)
    gather_layer = gather_root = 0
    root_kept = 0
    if row.zero_stage == 3:  # the gathered fp32 layer, the prefetch (stage3_prefetch_bucket_size
        gather_layer = 4 * z.top_n + z.bucket  # elements), root matrices and the parameters
        # kept gathered from forward's end into backward
        root_kept = 4 * zero3_kept_gathered(z.n)
        gather_root = max(4 * shape.num_head_params, root_kept)
    return ModelStates(
        on_device,
        host,
        base=sum(on_device.values()) + z.bucket,  # grads are reduced through the bucket
        grads_at_step=0,
        first=flow,
        later=flow,
        gather_layer=gather_layer,
        gather_root=gather_root,
        root_kept=root_kept,
    )


# Full fine-tuning's model states per engine (the `engine` column of trainer/core/strategies.py)
_FULL_STATES = {
    "single": _replicated_states,
    "ddp": _replicated_states,
    "fsdp": _fsdp_states,
    "deepspeed": _zero_states,
    "stream": stream_states,
}


def _fsdp_model_states(
    on_device: dict[str, int], on_host: dict[str, int], sync: GradFlow, no_sync: GradFlow,
    z: Sizes, every: bool, gather_layer: int,
) -> ModelStates:  # fmt: skip
    """FSDP2's model states. Gradients in the first and a later micro-batch: reduced after
    every one (later micro-batches add to the sharded grads), or accumulated unsharded under
    no-sync and reduced after the last. An untied embedding and the head are groups of their
    own (trainer/backends/fsdp.py): neither is unsharded while the layers compute."""
    untied = not z.tied_embed
    if untied:  # the head's grads are reduce-scattered after its backward (when they sync)
        norm_n = z.root_n - z.embed_n - z.lm_head_n
        rest = z.root_n - z.lm_head_n
        sync = replace(
            sync,
            head_released=z.c * z.lm_head_n if sync.head else 0,
            root_at_embedding=z.c * rest,
            reduce_root=reduce_scatter_bytes(rest, z.c, z.w, z.p),
        )
    if every:
        first = replace(sync, held=0, released_per_layer=0)
        later = replace(first, held=on_device["grads"], per_layer=0)
    else:
        first, later = (no_sync, sync) if z.accumulating else (sync, sync)
    root = z.c * z.root_n
    gathers = {"gather_root": root, "root_kept": root}
    if untied:
        held = z.c * (z.root_n - z.embed_n)  # the norm and the head, from the head's forward
        gathers = {
            "gather_root": held,
            "root_kept": held,
            "root_in_layers": z.c * norm_n,
            "head_group": z.c * z.lm_head_n,
            "embed_regather": z.c * z.embed_n,
        }
    return ModelStates(
        on_device, on_host, base=on_device["params"] + on_device["optimizer"],
        grads_at_step=on_device["grads"], first=first, later=later, gather_layer=gather_layer,
        **gathers,
    )  # fmt: skip


def reduce_scatter_bytes(num_params: int, c: int, w: int, r: int = 4) -> int:
    """FSDP2 reducing one unit: its 16-bit unsharded grads, the reduce-scatter input and output
    in the reduce dtype (r bytes: fp32, bf16 under bf16_pure; the grads are freed while the
    output is made)."""
    return r * num_params + max(c * num_params, c * num_params // 2 + r * num_params // w)


def _eight_bit_moments(row: Strategy, z: Sizes, states: ModelStates, sizes: MethodSizes):
    """Full fine-tuning with `adamw_8bit`: the moments shrink where they are stepped (on the
    host under fsdp_offload: bitsandbytes steps each rank's rows there)."""
    shards = 1 if row.engine in ("single", "ddp") else z.w
    saved = (2 * z.p * z.n - sizes.optimizer) // shards
    if row.optimizer_at != "device":
        on_host = {**states.on_host, "optimizer": states.on_host.get("optimizer", 0) - saved}
        return replace(states, on_host=on_host)
    on_device = {**states.on_device, "optimizer": states.on_device["optimizer"] - saved}
    return replace(states, on_device=on_device, base=states.base - saved)


def _replicated_adapters(
    row: Strategy, z: Sizes, shape: ModelShape, fsdp_every: bool, s: MethodSizes
):
    """single, ddp and ZeRO-1 with adapters: the frozen base and fp32 adapters on every rank."""
    a, a_layer, w, p = s.trainable, s.trainable_layer, z.w, z.p
    if row.zero_stage == 1:  # fp32 master partition (a clone) and moments partitioned
        dev, _ = zero_model_state_bytes(a, stage=1, world_size=w, param_bytes=4)
        on_device = {"params": dev["params"], "grads": dev["grads"],
                     "optimizer": 4 * a // w + s.optimizer // w}  # fmt: skip
    else:
        on_device = {"params": p * a, "grads": p * a, "optimizer": s.optimizer}
    on_device["params"] += s.frozen
    base = on_device["params"] + on_device["optimizer"]
    first = GradFlow(per_layer=p * a_layer, in_layer=p * a_layer)
    later = GradFlow(held=p * a)
    grads_at_step = on_device["grads"]
    if row.engine == "ddp":  # the buckets hold the adapters' grads for good
        base += on_device["grads"]
        first = later = GradFlow()
        grads_at_step = 0
    if row.zero_stage == 1:
        bucket = 4 * min(DEEPSPEED_BUCKET_ELEMENTS, a)
        first = replace(first, reduce_root=4 * a + bucket)
        later = replace(later, reduce_root=bucket)
    return ModelStates(on_device, {}, base, grads_at_step, first, later)


def _fsdp_adapters(row: Strategy, z: Sizes, shape: ModelShape, fsdp_every: bool, s: MethodSizes):
    """FSDP2 with adapters: frozen base and adapters sharded together (16-bit gathers of both),
    only the adapters' gradients reduce-scattered."""
    a, a_layer, w, c, p = s.trainable, s.trainable_layer, z.w, z.c, z.p
    shard = {"params": (s.frozen + p * a) // w, "grads": p * a // w, "optimizer": s.optimizer // w}
    on_device, on_host = dict(shard), {}
    if row.offloads:
        on_device, on_host = {"params": 0, "grads": 0, "optimizer": 0}, dict(shard)
    sync = GradFlow(
        held=p * a if z.accumulating else 0,
        per_layer=on_device["grads"] and p * a_layer // w,
        in_layer=c * a_layer,
        released_per_layer=p * a_layer if z.accumulating else 0,
        reduce_root=0,
        pending_reduce=reduce_scatter_bytes(a_layer, c, w, p),
    )
    no_sync = GradFlow(per_layer=p * a_layer, in_layer=p * a_layer)
    gather_layer = 2 * (s.frozen_top + c * a_layer)
    return _fsdp_model_states(on_device, on_host, sync, no_sync, z, fsdp_every, gather_layer)


def _zero_adapters(row: Strategy, z: Sizes, shape: ModelShape, fsdp_every: bool, s: MethodSizes):
    """DeepSpeed ZeRO-2/3 with adapters: the adapters as ZeRO accounts a model; the frozen base
    replicated under stage 2, partitioned under stage 3 (on the host with offloaded params)."""
    if row.zero_stage == 1:
        return _replicated_adapters(row, z, shape, fsdp_every, s)
    a, a_layer, w = s.trainable, s.trainable_layer, z.w
    on_host_opt = row.optimizer_at != "device"
    dev, host = zero_model_state_bytes(
        a,
        stage=row.zero_stage,
        world_size=w,
        param_bytes=4,
        offload_optimizer=on_host_opt,
        offload_params=row.params_at != "device",
    )
    on_device = {k: dev[k] for k in ("params", "grads", "optimizer")}
    if not on_host_opt:  # the moments as the optimizer stores them
        on_device["optimizer"] += (s.optimizer - 8 * a) // w
    frozen = s.frozen
    if row.zero_stage == 3:  # partitioned, but for QLoRA's quantisation states (on the device)
        frozen = (s.frozen - s.unpartitioned) // w
        on_device["params"] += s.unpartitioned
    if row.params_at == "device":
        on_device["params"] += frozen
    else:
        host["params"] = host.get("params", 0) + frozen
    if row.needs_nvme:
        host = {"nvme_buffers": 2 * 16 * a_layer + 2 * s.frozen_top}
    bucket = 4 * min(DEEPSPEED_BUCKET_ELEMENTS, a)
    flow = GradFlow(in_layer=4 * a_layer)
    gather_layer = gather_root = root_kept = 0
    if row.zero_stage == 3:  # the gathered layer and the prefetched one; the output layer;
        layer = s.frozen_top - s.unpartitioned // shape.num_layers + 4 * a_layer
        gather_layer = layer + min(bucket, layer)
        # what stays gathered from forward's end into backward, the base's and the adapters'
        gathered = s.frozen - s.unpartitioned + 4 * a
        root_kept = gathered * zero3_kept_gathered(z.n) // max(1, z.n)
        gather_root = max(z.c * shape.num_head_params, root_kept)
    return ModelStates(
        on_device,
        host,
        base=sum(on_device.values()) + bucket,
        grads_at_step=0,
        first=flow,
        later=flow,
        gather_layer=gather_layer,
        gather_root=gather_root,
        root_kept=root_kept,
    )


_ADAPTER_STATES = {
    "single": _replicated_adapters,
    "ddp": _replicated_adapters,
    "fsdp": _fsdp_adapters,
    "deepspeed": _zero_adapters,
}
