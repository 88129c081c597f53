"""Free functions the backends share (no base class): optimizer, autocast, state, memory."""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from trainer.backends import OptimizerSpec
from trainer.core import host_memory
from trainer.model.build import checkpoint_count, checkpoint_ops
from trainer.model.materialise import materialise
from trainer.model.pretrained import canonical_name
from trainer.optim import (
    FP32_MOMENTS,
    OptimizerInBackward,
    build_optimizer,
    canonical_8bit_moments,
    load_8bit_moments,
)
from trainer.optim import set_lr as set_optimizer_lr
from trainer.parallel.parallelize import ModelChanges, parallelize
from trainer.parallel.tensor import clip_grad_norm, is_split, on_several_meshes
from trainer.runtime.oom import OutOfMemoryInStep

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_context(device: torch.device, precision: str) -> AbstractContextManager:
    """16-bit compute over fp32 weights; fp32 precision runs without autocast."""
    dtype = COMPUTE_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def build_adamw(
    params: Iterable[nn.Parameter], optim: OptimizerSpec, grad_accum: int = 1
) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (`requires_grad`; a LoRA base is frozen): torch's
    fused kernel (CUDA and CPU: one pass per tensor, no foreach temporaries; on CPU also 1.2-4x
    faster than foreach on a 29M-parameter step here), or with `train.optimizer: adamw_8bit`
    bitsandbytes' 8-bit AdamW, `precision: bf16_pure` torchao's stochastically rounded one, and
    `train.optimizer_in_backward` a step per parameter in backward (`trainer.optim`)."""
    return build_optimizer(list(params), optim, grad_accum)


def canonical_optim_state(
    optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor]
) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW moments and step per canonical parameter name, on CPU (portable layout): fp32
    `exp_avg`/`exp_avg_sq` for torch AdamW (bf16 under bf16_pure); for adamw_8bit the form
    every rung shares (`trainer.optim.canonical_8bit_moments`).

    On CPU these are the live tensors, not copies: a synchronous save writes them before training
    goes on, and an asynchronous one stages its own copy first.
    """
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in params.items():
        state = optimizer.state.get(p)
        if not state:
            continue
        if "state1" in state:  # bitsandbytes
            moments = canonical_8bit_moments(p, state)
        else:
            moments = {key: state[key] for key in FP32_MOMENTS}
        out[name] = {key: _portable(t) for key, t in moments.items()}
        out[name]["step"] = torch.as_tensor(float(state["step"]), dtype=torch.float32)
    return out


def load_canonical_optim_state(
    optimizer: torch.optim.Optimizer,
    params: dict[str, torch.Tensor],
    state: dict[str, dict[str, torch.Tensor]],
) -> None:
    fused = any(g.get("fused") for g in optimizer.param_groups)
    for name, p in params.items():
        if name not in state:
            continue
        s = state[name]
        live = optimizer.state.get(p)
        if live and "state1" in live:  # bitsandbytes: into the state it created at setup
            load_8bit_moments(live, s)
            live["step"] = int(s["step"])
            continue
        step_device = p.device if fused else "cpu"
        optimizer.state[p] = {
            "exp_avg": s["exp_avg"].to(p.device, p.dtype).reshape_as(p),
            "exp_avg_sq": s["exp_avg_sq"].to(p.device, p.dtype).reshape_as(p),
            "step": torch.as_tensor(float(s["step"]), dtype=torch.float32, device=step_device),
        }


def trained_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters that train, by canonical name: all of them for a full fine-tune, the
    adapters for LoRA. What the optimizer steps and what a checkpoint holds."""
    return {canonical_name(n): p for n, p in model.named_parameters() if p.requires_grad}


def _portable(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor on the CPU; a tensor split's DTensor as it is (DCP writes each rank's
    block and reshards on load)."""
    return t if is_split(t) else t.to("cpu")


def device_memory_stats(device: torch.device) -> dict[str, int]:
    """Peak bytes since the last reset: allocator peak on CUDA; on CPU the process's peak
    resident set (host memory: its high-water mark, reset with the device's)."""
    if device.type == "cuda":
        return {
            "peak_device_bytes": torch.cuda.max_memory_allocated(device),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }
    return {"peak_device_bytes": host_memory.rss_peak_bytes() or _lifetime_rss_peak()}


def _lifetime_rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_device_peak(device: torch.device) -> None:
    """The device's peaks, and the process's resident-set mark (the host's, and on CPU the
    device's), start again from now."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    host_memory.reset_peak()


def clip_and_step(
    parameters: Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    grad_clip: float,
) -> torch.Tensor:
    """Unscale, clip the global grad norm, step, free the grads. Returns the pre-clip norm as a
    tensor (a DTensor for sharded parameters; under `train.optimizer_in_backward` the step is
    done: only the norm is left); `scaler` None: no loss scaling."""
    if isinstance(optimizer, OptimizerInBackward):
        return torch.as_tensor(optimizer.finish_step())
    if scaler is not None:
        scaler.unscale_(optimizer)
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    parameters = list(parameters)
    if on_several_meshes(parameters):  # a tensor split: its parameters and the whole ones
        grad_norm = clip_grad_norm(parameters, max_norm)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def replica_step(backend: Any) -> float:
    """`step` of a replica backend (single, ddp): clip and step its optimizer, the norm."""
    norm = clip_and_step(backend.model.parameters(), backend.optimizer, backend.scaler,
                         backend.grad_clip)  # fmt: skip
    return float(norm)


def attach(backend: Any, model: nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float):
    """A backend over a model and optimizer built elsewhere (the planner's traced step,
    launcher/estimate/trace.py): what `setup` would have left on it, for `no_sync`, `backward`,
    `compute_context` and `clip_and_step` to act on."""
    backend.model, backend.optimizer, backend.grad_clip = model, optimizer, grad_clip
    return backend


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    set_optimizer_lr(optimizer, lr)


def drop_grads(optimizer: torch.optim.Optimizer) -> None:
    """Discard an abandoned step's gradients (an OOM the engine retries in process)."""
    if isinstance(optimizer, OptimizerInBackward):
        optimizer.abandon_step("out of memory with train.optimizer_in_backward")
    optimizer.zero_grad(set_to_none=True)


def refuse_accumulation(optimizer: torch.optim.Optimizer, grad_accum: int) -> None:
    """The OOM back-off's new cut: more than one micro-batch cannot step in backward."""
    if isinstance(optimizer, OptimizerInBackward) and grad_accum > 1:
        raise OutOfMemoryInStep(
            torch.OutOfMemoryError(
                "out of memory with train.optimizer_in_backward: the back-off would accumulate "
                f"{grad_accum} micro-batches; resuming on the next rung instead"
            )
        )


def replica_state_dict(
    params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
) -> dict[str, Any]:
    """Canonical state of a backend that holds full (unsharded) parameters, in the dtype they
    train in (fp32 masters; bf16 under bf16_pure)."""
    return {
        "model": {n: _portable(p.detach()) for n, p in params.items()},
        "optim": canonical_optim_state(optimizer, params),
        "scaler": scaler.state_dict() if scaler.is_enabled() else {},
    }


def load_replica_state_dict(
    state: dict[str, Any],
    params: dict[str, nn.Parameter],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
) -> None:
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state["model"][name])
    load_canonical_optim_state(optimizer, params, state["optim"])
    if state.get("scaler") and scaler.is_enabled():
        scaler.load_state_dict(state["scaler"])


def model_changes(ctx: Any, compile: bool = True) -> ModelChanges:
    """What `trainer.parallel.parallelize` does to this backend's model: the context's groups and
    checkpointing level, the job's checkpointed layers and op level, and `train.compile` (unless
    the backend cannot run compiled layers: `compile` False)."""
    return ModelChanges(
        mesh=ctx.mesh,
        activation_checkpointing=ctx.activation_checkpointing,
        checkpointed_layers=checkpoint_count(ctx.cfg),
        checkpoint_ops=checkpoint_ops(ctx.cfg),
        compile=compile and ctx.cfg.train.compile,
    )


def build_replica(factory: Any, ctx: Any, wrap: Any = None) -> nn.Module:
    """The whole model on this rank's device, changed in the one order (`parallelize`), in train
    mode: what `single` runs and what `ddp` wraps (`wrap`). Under a tensor split, this rank's
    blocks of it: built on the meta device, split, then made real (`materialise`)."""
    changes = model_changes(ctx)
    if ctx.mesh is None or ctx.mesh.tensor == 1:
        return parallelize(lambda: factory.build(ctx.device), factory.hf_config, changes, wrap)
    model = parallelize(lambda: factory.build("meta"), factory.hf_config, changes, wrap)
    materialise(model, factory, ctx, ctx.device, "tensor-parallel blocks")
    return model


def full_replica_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A replica's weights, canonical names, copied to the CPU (a tensor split's gathered:
    a collective, every rank joins)."""
    return {
        canonical_name(n): (t.full_tensor() if is_split(t) else t).detach().to("cpu", copy=True)
        for n, t in model.state_dict().items()
    }
