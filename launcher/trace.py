"""`oomless estimate --trace`: one real training step of our engine, traced without allocating.

The step is the engine's own code: the HF model built on the meta device by `HFModelFactory`,
activation checkpointing by `apply_activation_checkpointing`, `compute_loss`'s tensors (logits
upcast to fp32), backward, grad-norm clipping, AdamW (`build_adamw` as on CUDA: fused, no foreach
temporaries) and `zero_grad(set_to_none=True)`. It runs under `FakeTensorMode`, so tensors have
shapes and dtypes but no storage, and `MemTracker` (single) or `FSDPMemTracker` (fsdp, with
FSDP2 `fully_shard` over a fake process group of any world size) counts the live tensor bytes of
every operation. The peak of a steady-state step (optimizer state already present) is what
`torch.cuda.max_memory_allocated` would see, less allocator rounding.

LoRA traces the same way (peft's layers are plain modules). QLoRA and 8-bit AdamW run for real
on CPU (bitsandbytes quantises real weights, and its 8-bit step reads a scalar, which a fake
tensor cannot give); the tracker counts real allocations just as well, and the grid's models
step on a CPU in seconds.

CPU stands in for the device (a CPU-only torch cannot fake CUDA tensors): autocast runs as CPU
autocast in the same 16-bit dtype, and SDPA dispatches to its CPU flash kernel, which saves what
the CUDA kernels save (output and fp32 log-sum-exp). The trace counts tensor bytes only; compare
it with the analytic `peak_tensor_bytes`, not with `total_bytes`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from launcher.estimate_finetune import FULL, Finetune
from trainer.backends import OptimizerSpec
from trainer.backends.common import COMPUTE_DTYPES
from trainer.backends.fsdp import apply_fsdp, gradient_sync
from trainer.core.config import ModelConfig
from trainer.levers import MemoryLevers
from trainer.loss import compute_loss
from trainer.model import HFModelFactory, apply_activation_checkpointing
from trainer.phases import HEAD, OPTIMIZER, STEP, phase_markers

TRACEABLE = ("single", "fsdp")
# `until=` for a trace of the layers' forward phases only, or of the step up to its optimizer
FORWARD_END, BACKWARD_END = HEAD, OPTIMIZER
_SPEC = OptimizerSpec(lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, grad_clip=1.0)


def _real(ft: Finetune) -> bool:
    return ft.method == "qlora" or ft.optimizer == "adamw_8bit"


def traceable(strategy: str, ft: Finetune = FULL) -> bool:
    """single and fsdp; with real tensors (QLoRA, 8-bit AdamW) single only."""
    return strategy == "single" or (strategy in TRACEABLE and not _real(ft))


@dataclass(frozen=True)
class Trace:
    strategy: str
    world_size: int
    micro_batch_size: int
    seq_len: int
    activation_checkpointing: str
    grad_accum: int
    peak_bytes: int  # live tensor bytes at the step's peak, on one device
    breakdown: dict[str, int]  # the tracker's categories at that peak
    # (label, peak live bytes) of each phase of the step in order (trainer/phases.py's labels)
    phases: tuple[tuple[str, int], ...] = ()


def trace_step(
    hf_config: dict[str, Any],
    *,
    strategy: str,
    world_size: int,
    micro_batch_size: int,
    seq_len: int,
    activation_checkpointing: str,
    grad_accum: int = 1,
    precision: str = "bf16",
    attn_implementation: str = "sdpa",
    reshard_after_forward: bool = True,
    reduce_every_micro_batch: bool = False,
    chunked_loss: bool = False,
    offload_activations: bool = False,
    loss_chunk_tokens: int | None = None,
    finetune: Finetune = FULL,
    phase_local_peaks: bool = False,
    until: str | None = None,
) -> Trace:
    """Peak live tensor bytes on one device for a steady-state training step (the second one):
    `grad_accum` micro-batches, all but the last under the backend's no-sync (unless FSDP
    reduces every micro-batch), as the engine runs them.

    Build, shard, fake and track read in the order the engine does them; `_step` is the
    engine's step line for line. With `phase_local_peaks`, each phase's peak is the highest
    live bytes inside that phase, even where an earlier phase went higher (by default a phase
    below the step's peak so far reports the live bytes at its ends), and the tracker keeps no
    per-module peaks. With `until` (a phase label of trainer/phases.py: FORWARD_END,
    BACKWARD_END) the traced step stops where that phase begins: a quicker trace of the phases
    before it only (then `peak_bytes` is theirs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if strategy not in TRACEABLE:
        raise ValueError(f"--trace covers {', '.join(TRACEABLE)}, not {strategy}")
    model_cfg = ModelConfig(config=dict(hf_config), attn_implementation=attn_implementation)
    factory = HFModelFactory(model_cfg, seed=0)
    # 4-bit weights are quantised from real ones; bitsandbytes' 8-bit step reads a scalar
    real = _real(finetune)
    if not traceable(strategy, finetune):
        raise ValueError(f"--trace covers {finetune.words()} on single only")
    model = apply_finetune(factory.build("cpu" if real else "meta"), finetune, precision)
    apply_activation_checkpointing(model, activation_checkpointing)
    model.train()
    device = torch.device("cpu")
    with contextlib.ExitStack() as stack:
        if strategy == "fsdp":
            stack.enter_context(_fake_process_group(world_size))
            apply_fsdp(model, precision=precision, reshard_after_forward=reshard_after_forward)
        stack.enter_context(moe_fake_kernels())
        if not real:
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            model.to_empty(device=device)
        if strategy == "single" and hasattr(model, "tie_weights") and not real:
            model.tie_weights()  # to_empty made fake copies of tied weights: one tensor again
        MemoryLevers(
            model,
            device,
            chunked_loss,
            offload_activations,
            loss_chunk_tokens,
            offload_host=torch.device("meta"),  # host copies: not counted as the device's
        )
        optimizer = _optimizer(model, finetune)
        batch = _batch(hf_config["vocab_size"], micro_batch_size, seq_len)
        _init_optimizer_state(model, optimizer)  # the traced step is a steady-state one
        tracker = _tracker(strategy, model, optimizer, batch)
        if phase_local_peaks:
            _global_peak_only(tracker)
        marks: list[tuple[str, int, int]] = []  # (label, live bytes, peak so far) as it begins

        highest: list[Any] = []  # with phase-local peaks: the step's peak snapshot so far

        def mark(label: str) -> None:
            current = tracker.get_tracker_snapshot("current")
            peak = tracker.get_tracker_snapshot("peak")
            marks.append((label, _total(current), _total(peak)))
            if phase_local_peaks:
                if not highest or _total(peak) > _total(highest[0]):
                    highest[:] = [peak]
                _restart_peak(tracker, current)
            if label == until:
                raise _Stop

        with contextlib.suppress(_Stop), tracker, phase_markers(model, mark):
            _step(
                model,
                optimizer,
                batch,
                strategy,
                precision,
                grad_accum,
                reduce_every_micro_batch,
                tracker,
                mark,
            )
            mark("end")
        snapshot = highest[0] if highest else tracker.get_tracker_snapshot("peak")
    dev = next(d for d in snapshot if torch.device(d).type == device.type)
    breakdown = {getattr(k, "name", k).lower(): int(v) for k, v in snapshot[dev].items()}
    return Trace(
        strategy=strategy,
        world_size=world_size if strategy == "fsdp" else 1,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        activation_checkpointing=activation_checkpointing,
        grad_accum=grad_accum,
        peak_bytes=breakdown.pop("total"),
        breakdown=breakdown,
        phases=phase_peaks(marks) if not phase_local_peaks else _local_peaks(marks),
    )


def _step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    strategy: str,
    precision: str,
    grad_accum: int,
    reduce_every_micro_batch: bool,
    tracker: Any,
    mark: Any,
) -> None:
    """One training step as the engine runs it: the micro-batches (all but the last under
    FSDP's no-sync unless it reduces every micro-batch), clipping, AdamW, zero_grad."""
    compute = _autocast(precision) if strategy == "single" else contextlib.nullcontext
    tokens = batch["input_ids"].numel()
    mark(STEP)
    for i in range(grad_accum):
        tracker.reset_mod_stats()  # its per-module stats allow one call per module
        last = reduce_every_micro_batch or i == grad_accum - 1
        sync = contextlib.nullcontext() if strategy != "fsdp" else gradient_sync(model, last)
        with sync:
            with compute():
                loss_sum = compute_loss(model, batch)
            (loss_sum / tokens).backward()
            del loss_sum
    mark(OPTIMIZER)
    torch.nn.utils.clip_grad_norm_(model.parameters(), _SPEC.grad_clip, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def phase_peaks(marks: list[tuple[str, int, int]]) -> tuple[tuple[str, int], ...]:
    """(label, peak live bytes) per phase from the marks at phase starts: the live bytes at its
    two ends, or the tracker's peak if that rose in between (then it was reached in there)."""
    out = []
    for (label, live0, peak0), (_, live1, peak1) in zip(marks, marks[1:], strict=False):
        out.append((label, max(live0, live1, peak1 if peak1 > peak0 else 0)))
    return tuple(out)


class _Stop(Exception):
    """Raised at the phase a trace stops at (`trace_step(until=...)`)."""


def _local_peaks(marks: list[tuple[str, int, int]]) -> tuple[tuple[str, int], ...]:
    """(label, peak live bytes) per phase where the tracker's peak restarts at each mark."""
    return tuple((a[0], max(a[1], b[1], b[2])) for a, b in zip(marks, marks[1:], strict=False))


def _global_peak_only(tracker: Any) -> None:
    """The tracker updates its step-wide peak only, not the per-module peaks (a loop over
    every module seen, after every operation: a fifth of a traced step's time) that nothing
    here reads. MemTracker's `_update_peak_stats` without its module loop."""
    from copy import deepcopy

    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    def update(peak_state: Any) -> None:
        for dev, snap in tracker._curr_mem_snap.items():
            total = snap[_TOTAL_KEY]
            if tracker._peak_mem.get(dev, 0) < total:
                tracker._peak_mem[dev] = total
                tracker._peak_mem_snap[dev] = deepcopy(snap)

    tracker._update_peak_stats = update


def _restart_peak(tracker: Any, current: dict[Any, dict[Any, int]]) -> None:
    """The tracker's peak from now on: the live bytes now (MemTracker keeps one running peak,
    in `_peak_mem` and `_peak_mem_snap`, and offers no public reset)."""
    tracker._peak_mem_snap = current
    tracker._peak_mem = {dev: _total({dev: snap}) for dev, snap in current.items()}


def _total(snapshot: dict[Any, dict[Any, int]]) -> int:
    dev = next(iter(snapshot))
    return int(next(v for k, v in snapshot[dev].items() if getattr(k, "name", k) == "Total"))


def _init_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """AdamW's moments and step, as after a first step (a step on zero grads: no forward)."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _autocast(precision: str):
    dtype = COMPUTE_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast("cpu", dtype=dtype)


def _batch(vocab_size: int, micro: int, seq: int) -> dict[str, torch.Tensor]:
    """A packed window as the data pipeline makes it: position ids restart per document (two
    documents here; a real step's transformers reads them and builds the block-causal mask)."""
    ids = torch.zeros(micro, seq, dtype=torch.long)
    return {
        "input_ids": ids,
        "labels": ids.clone(),
        "position_ids": (torch.arange(seq) % max(1, seq // 2)).repeat(micro, 1),
    }


def _tracker(strategy: str, model: nn.Module, optimizer: torch.optim.Optimizer, batch) -> Any:
    if strategy == "fsdp":
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker = FSDPMemTracker(model, optimizer)
        _skip_frozen(tracker, model)
        tracker.track_inputs(tuple(batch.values()))
        return tracker
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    _skip_frozen(tracker, model)
    tracker.track_external(model, optimizer, *batch.values())
    return tracker


class _NoHook:
    def remove(self) -> None:
        pass


def _skip_frozen(tracker: Any, model: nn.Module) -> None:
    """The tracker hooks every parameter's gradient; a frozen one (LoRA's base) has none."""
    for p in model.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())


def apply_finetune(model: nn.Module, ft: Finetune, precision: str) -> nn.Module:
    """What `finetune.method` trains, built by the engine's own trainer/finetune.py."""
    from trainer.core.config import FinetuneConfig, LoraConfig
    from trainer.finetune import apply_finetune as engine_apply

    targets = ft.target_modules if isinstance(ft.target_modules, str) else list(ft.target_modules)
    lora = LoraConfig(r=ft.r, dropout=ft.dropout, target_modules=targets)
    return engine_apply(model, FinetuneConfig(method=ft.method, lora=lora), precision, seed=0)


def _optimizer(model: nn.Module, ft: Finetune) -> torch.optim.Optimizer:
    """The engine's optimizer over what trains: fused AdamW, or bitsandbytes' AdamW8bit."""
    from dataclasses import replace

    from trainer.optim import build_optimizer

    return build_optimizer(list(model.parameters()), replace(_SPEC, name=ft.optimizer))


@contextlib.contextmanager
def moe_fake_kernels():
    """MoE experts under fake tensors: transformers' grouped_mm experts call torch's grouped_mm,
    whose meta kernel accepts bf16 only (its CUDA kernel's restriction), so fp32 experts cannot
    be traced through it; its own fallback op (a loop over experts, registered with a fake
    kernel) takes every dtype and saves the same tensors for backward (input, weight, offsets).
    A no-op for dense models or without transformers' MoE integration."""
    try:
        from transformers.integrations import moe
    except ImportError:
        yield
        return
    original = moe._can_use_grouped_mm
    moe._can_use_grouped_mm = lambda *args, **kwargs: False
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


@contextlib.contextmanager
def _fake_process_group(world_size: int):
    """A process group of `world_size` ranks that exists in this process only (rank 0)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
