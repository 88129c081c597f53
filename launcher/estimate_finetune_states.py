"""One rank's model states under LoRA, QLoRA and 8-bit AdamW, per engine (the counterpart of
estimate.py's `_MODEL_STATES` for `finetune.method` and `train.optimizer`; the byte counts are
launcher/estimate_finetune.py's).

With adapters only the adapters train: their fp32 weights, fp32 gradients and optimizer state
are what the rung shards or offloads, as it does a full model's; the frozen base (16-bit, or
NF4 under QLoRA) is replicated on `single`, `ddp`, `zero1` and `zero2` (DeepSpeed partitions
what its optimizer holds), sharded on `fsdp` and `zero3`, on the host on the offload rungs that
keep parameters there. Full fine-tuning with 8-bit moments keeps the rung's accounting and swaps
the two fp32 moments (8 bytes per parameter) for the 8-bit ones.
"""

from __future__ import annotations

from dataclasses import replace

from launcher.estimate import (
    _MODEL_STATES,
    _GradFlow,
    _head_params,
    _ModelStates,
    _reduce_scatter_bytes,
    _Sizes,
    zero_model_state_bytes,
)
from launcher.estimate_finetune import Finetune, MethodSizes, method_sizes
from launcher.model_shape import ModelShape
from trainer.core.strategies import DEEPSPEED_BUCKET_ELEMENTS, Strategy


def finetune_states(
    row: Strategy, z: _Sizes, shape: ModelShape, fsdp_every: bool, ft: Finetune
) -> _ModelStates:
    sizes = method_sizes(shape, ft, z.c)
    if not ft.adapters:
        full = _MODEL_STATES[row.engine](row, z, shape, fsdp_every)
        return _eight_bit_moments(row, z, full, sizes)
    return _ADAPTER_STATES[row.engine](row, z, shape, fsdp_every, sizes)


def _eight_bit_moments(row: Strategy, z: _Sizes, states: _ModelStates, sizes: MethodSizes):
    """Full fine-tuning with `adamw_8bit`: the moments shrink where the device steps them."""
    if row.optimizer_at != "device":
        return states
    shards = 1 if row.engine in ("single", "ddp") else z.w
    saved = (8 * z.n - sizes.optimizer) // shards
    on_device = {**states.on_device, "optimizer": states.on_device["optimizer"] - saved}
    return replace(states, on_device=on_device, base=states.base - saved)


def _replicated(row: Strategy, z: _Sizes, shape: ModelShape, fsdp_every: bool, s: MethodSizes):
    """single, ddp and ZeRO-1 with adapters: the frozen base and fp32 adapters on every rank."""
    a, a_layer, w = s.trainable, s.trainable_layer, z.w
    if row.zero_stage == 1:  # fp32 master partition (a clone) and moments partitioned
        dev, _ = zero_model_state_bytes(a, stage=1, world_size=w, param_bytes=4)
        on_device = {"params": dev["params"], "grads": dev["grads"],
                     "optimizer": 4 * a // w + s.optimizer // w}  # fmt: skip
    else:
        on_device = {"params": 4 * a, "grads": 4 * a, "optimizer": s.optimizer}
    on_device["params"] += s.frozen
    base = on_device["params"] + on_device["optimizer"]
    first = _GradFlow(per_layer=4 * a_layer, in_layer=4 * a_layer)
    later = _GradFlow(held=4 * a)
    grads_at_step = on_device["grads"]
    if row.engine == "ddp":  # the buckets hold the adapters' grads for good
        base += on_device["grads"]
        first = later = _GradFlow()
        grads_at_step = 0
    if row.zero_stage == 1:
        bucket = 4 * min(DEEPSPEED_BUCKET_ELEMENTS, a)
        first = replace(first, reduce_root=4 * a + bucket)
        later = replace(later, reduce_root=bucket)
    return _ModelStates(on_device, {}, base, grads_at_step, first, later)


def _fsdp(row: Strategy, z: _Sizes, shape: ModelShape, fsdp_every: bool, s: MethodSizes):
    """FSDP2 with adapters: frozen base and adapters sharded together (16-bit gathers of both),
    only the adapters' gradients reduce-scattered."""
    a, a_layer, w, c = s.trainable, s.trainable_layer, z.w, z.c
    shard = {"params": (s.frozen + 4 * a) // w, "grads": 4 * a // w, "optimizer": s.optimizer // w}
    on_device, on_host = dict(shard), {}
    if row.offloads:
        on_device, on_host = {"params": 0, "grads": 0, "optimizer": 0}, dict(shard)
    sync = _GradFlow(
        held=4 * a if z.accumulating else 0,
        per_layer=on_device["grads"] and 4 * a_layer // w,
        in_layer=c * a_layer,
        released_per_layer=4 * a_layer if z.accumulating else 0,
        reduce_root=0,
        pending_reduce=_reduce_scatter_bytes(a_layer, c, w),
    )
    no_sync = _GradFlow(per_layer=4 * a_layer, in_layer=4 * a_layer)
    if fsdp_every:
        first = replace(sync, held=0, released_per_layer=0)
        later = replace(first, held=on_device["grads"], per_layer=0)
    else:
        first, later = (no_sync, sync) if z.accumulating else (sync, sync)
    root = c * z.root_n
    return _ModelStates(
        on_device,
        on_host,
        base=on_device["params"] + on_device["optimizer"],
        grads_at_step=on_device["grads"],
        first=first,
        later=later,
        gather_layer=2 * (s.frozen_layer + c * a_layer),
        gather_root=root,
        root_kept=root,
    )


def _zero(row: Strategy, z: _Sizes, shape: ModelShape, fsdp_every: bool, s: MethodSizes):
    """DeepSpeed ZeRO-2/3 with adapters: the adapters as ZeRO accounts a model; the frozen base
    replicated under stage 2, partitioned under stage 3 (on the host with offloaded params)."""
    if row.zero_stage == 1:
        return _replicated(row, z, shape, fsdp_every, s)
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
    frozen = s.frozen // w if row.zero_stage == 3 else s.frozen
    if row.params_at == "device":
        on_device["params"] += frozen
    else:
        host["params"] = host.get("params", 0) + frozen
    if row.needs_nvme:
        host = {"nvme_buffers": 2 * 16 * a_layer + 2 * s.frozen_layer}
    bucket = 4 * min(DEEPSPEED_BUCKET_ELEMENTS, a)
    flow = _GradFlow(in_layer=4 * a_layer)
    gather_layer = gather_root = 0
    if row.zero_stage == 3:  # the gathered layer and the prefetched one; the output layer
        layer = s.frozen_layer + 4 * a_layer
        gather_layer = layer + min(bucket, layer)
        gather_root = z.c * _head_params(shape)
    return _ModelStates(
        on_device,
        host,
        base=sum(on_device.values()) + bucket,
        grads_at_step=0,
        first=flow,
        later=flow,
        gather_layer=gather_layer,
        gather_root=gather_root,
    )


_ADAPTER_STATES = {"single": _replicated, "ddp": _replicated, "fsdp": _fsdp, "deepspeed": _zero}
