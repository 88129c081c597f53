"""`oomless estimate --trace`: one real training step of our engine, traced without allocating.

The step is the engine's own code: the HF model built on the meta device by `HFModelFactory`,
changed as the engine's backends change it (`trainer.parallel.parallelize`: the sequence split,
activation checkpointing, FSDP2), `compute_loss`'s tensors (logits upcast to fp32), backward,
grad-norm clipping, AdamW (`build_adamw` as on CUDA: fused, no foreach temporaries) and
`zero_grad(set_to_none=True)`. It runs under `FakeTensorMode`, so tensors have
shapes and dtypes but no storage, and `MemTracker` (single) or `FSDPMemTracker` (fsdp, with
FSDP2 `fully_shard` over a fake process group of any world size) counts the live tensor bytes of
every operation. The peak of a steady-state step (optimizer state already present) is what
`torch.cuda.max_memory_allocated` would see, less allocator rounding.

LoRA traces the same way (peft's layers are plain modules). QLoRA, 8-bit AdamW and bf16_pure run
for real on CPU (bitsandbytes quantises real weights, and its 8-bit step reads a scalar, which a
fake tensor cannot give; torchao's bf16 step is compiled), on fsdp over the same fake process
group (its collectives leave the outputs unwritten, which a memory count does not read); the
tracker counts real allocations just as well, and the grid's models step on a CPU in seconds.
torch.compile refuses to run under the tracker's dispatch mode, so a bf16_pure step is traced
up to its optimizer step (`until=BACKWARD_END`); compiled, that step is one fused kernel per
parameter, with no temporaries.

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

from launcher.estimate.expert_trace import worst_case_dispatch
from launcher.estimate.trace_patches import moe_fake_kernels, untracked_sharding_propagation
from launcher.estimate.trace_stream import land_gradients, traced_stream_model
from trainer.backends import BackendContext, OptimizerSpec, build_backend
from trainer.backends.common import COMPUTE_DTYPES, attach, clip_and_step
from trainer.backends.fsdp import apply_fsdp
from trainer.core.config import JobConfig, ModelConfig
from trainer.core.methods import EIGHT_BIT_OPTIMIZERS
from trainer.core.parallel_dims import ParallelDims
from trainer.core.step_spec import FULL, Finetune, StepSpec
from trainer.memory.levers import MemoryLevers
from trainer.memory.tiled_mlp import apply_tiled_mlp
from trainer.model.build import HFModelFactory
from trainer.observe.phases import HEAD, OPTIMIZER, STEP, phase_markers
from trainer.parallel.mesh import ParallelMesh, build_mesh
from trainer.parallel.parallelize import ModelChanges, parallelize
from trainer.parallel.sequence import split_sequence
from trainer.step import accumulation_context, micro_batch_loss

TRACEABLE = ("single", "fsdp", "stream")
# `until=` for a trace of the layers' forward phases only, or of the step up to its optimizer
FORWARD_END, BACKWARD_END = HEAD, OPTIMIZER
_SPEC = OptimizerSpec(lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, grad_clip=1.0)


def _real(spec: StepSpec) -> bool:
    """Real CPU tensors: QLoRA's 4-bit weights are quantised from real ones, bitsandbytes'
    8-bit step reads a scalar, and torchao's bf16 step (bf16_pure) is compiled."""
    ft = spec.finetune
    eight_bit = ft.optimizer in EIGHT_BIT_OPTIMIZERS
    return ft.method == "qlora" or eight_bit or spec.precision == "bf16_pure"


def traceable(strategy: str, ft: Finetune = FULL) -> bool:
    """single and fsdp (with real tensors over a fake process group too); 8-bit AdamW on single
    only: FSDP's tracker hooks the optimizer's step, and the engine's 8-bit AdamW over FSDP2
    shards is no torch optimizer that has such hooks. stream: what it runs (a full fine-tune
    in 16 bit or fp32, launcher/estimate/trace_stream.py)."""
    eight_bit = ft.optimizer in EIGHT_BIT_OPTIMIZERS
    if strategy == "stream":
        return ft.method == "full" and not eight_bit
    return strategy == "single" or (strategy in TRACEABLE and not eight_bit)


@dataclass(frozen=True)
class Trace:
    spec: StepSpec
    peak_bytes: int  # live tensor bytes at the step's peak, on one device
    breakdown: dict[str, int]  # the tracker's categories at that peak
    # (label, peak live bytes) of each phase of the step in order (trainer/observe/phases.py's
    # labels)
    phases: tuple[tuple[str, int], ...] = ()


def trace_step(
    hf_config: dict[str, Any],
    spec: StepSpec,
    *,
    attn_implementation: str = "sdpa",
    reshard_after_forward: bool = True,
    phase_local_peaks: bool = False,
    until: str | None = None,
    expert: int = 1,
) -> Trace:
    """Peak live tensor bytes on one device for a steady-state training step (the second one)
    of `spec`: `grad_accum` micro-batches, all but the last under the backend's no-sync (unless
    FSDP reduces every micro-batch), as the engine runs them.

    Build, shard, fake and track read in the order the engine does them; the step runs through
    the engine's own backend and step functions. With `phase_local_peaks`, each phase's peak is
    the highest live bytes inside that phase, even where an earlier phase went higher (by
    default a phase below the step's peak so far reports the live bytes at its ends), and the
    tracker keeps no per-module peaks. With `until` (a phase label of trainer/observe/phases.py:
    FORWARD_END, BACKWARD_END) the traced step stops where that phase begins: a quicker trace of
    the phases before it only (then `peak_bytes` is theirs). With `expert` > 1 (fsdp) the
    experts are split over that many ranks and routed at the estimate's worst case
    (launcher/estimate/expert_trace.py)."""
    if not traceable(spec.strategy, spec.finetune):
        raise ValueError(f"--trace covers {', '.join(TRACEABLE)} ({spec.finetune.words()} on "
                         f"single only), not {spec.strategy}")  # fmt: skip
    with contextlib.ExitStack() as stack:
        model, backend, dims = _traced_model(hf_config, spec, attn_implementation,
                                             reshard_after_forward, stack, expert)  # fmt: skip
        stack.enter_context(untracked_sharding_propagation())
        batch = packed_batch(hf_config["vocab_size"], spec.num_sequences, spec.seq_len)
        if dims.sequence > 1:  # rank 0's slice of every sequence, as the engine splits it
            doc_ids = (batch["position_ids"] == 0).cumsum(dim=1) - 1
            batch = split_sequence({**batch, "doc_ids": doc_ids}, dims, 0)
        optimizer = getattr(backend, "optimizer", None)  # stream's steps on the host
        if optimizer is not None:  # the traced step is a steady-state one
            _init_optimizer_state(model, optimizer)
        tracker = _tracker(spec.strategy, model, optimizer, batch)
        marks = _PhaseMarks(tracker, phase_local_peaks, until)
        with contextlib.suppress(_Stop), tracker, phase_markers(model, marks):
            _step(model, backend, [batch] * spec.grad_accum, tracker, marks)
            marks("end")
        snapshot = marks.highest or tracker.get_tracker_snapshot("peak")
    dev = next(d for d in snapshot if torch.device(d).type == "cpu")
    breakdown = {getattr(k, "name", k).lower(): int(v) for k, v in snapshot[dev].items()}
    phases = _local_peaks(marks.marks) if phase_local_peaks else phase_peaks(marks.marks)
    return Trace(spec, breakdown.pop("total"), breakdown, phases)


def _traced_model(
    hf_config: dict[str, Any], spec: StepSpec, attn_implementation: str,
    reshard_after_forward: bool, stack: contextlib.ExitStack, expert: int = 1,
) -> tuple[nn.Module, Any, ParallelDims]:  # fmt: skip
    """The engine's model for `spec` on fake tensors (QLoRA, 8-bit AdamW: real CPU tensors),
    sharded over a fake process group for fsdp, split over a sequence group as `spec` says, and
    its backend attached to it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if spec.row.streams_layers:
        ctx = _backend_context(spec, torch.device("cpu"), build_mesh(ParallelDims(1), 0))
        model, backend = traced_stream_model(hf_config, spec, ctx, attn_implementation, stack)
        stack.enter_context(moe_fake_kernels())
        return model, backend, ParallelDims(1)
    real = _real(spec)
    model_cfg = ModelConfig(config=dict(hf_config), attn_implementation=attn_implementation)
    factory = HFModelFactory(model_cfg, seed=0)
    sharded = spec.row.engine == "fsdp"
    mesh = _sequence_split(spec, sharded, stack, expert)
    if expert > 1:
        stack.enter_context(worst_case_dispatch())

    def build() -> nn.Module:
        model = apply_finetune(factory.build("cpu" if real else "meta"), spec.finetune,
                               spec.precision)  # fmt: skip
        if spec.precision == "bf16_pure" and not spec.finetune.adapters:
            from trainer.model.finetune import params_to_bf16

            params_to_bf16(model)  # as the engine's Bf16PureFactory builds it
        return model

    def wrap(model: nn.Module) -> nn.Module:
        if sharded:
            apply_fsdp(model, precision=spec.precision, reshard_after_forward=reshard_after_forward,
                       mesh=mesh.token_mesh, experts=mesh if expert > 1 else None)  # fmt: skip
        return model

    changes = ModelChanges(
        mesh=mesh, activation_checkpointing=spec.activation_checkpointing,
        checkpointed_layers=spec.checkpointed_layers, checkpoint_ops=spec.checkpoint_ops,
    )  # fmt: skip
    model = parallelize(build, factory.hf_config, changes, wrap)
    stack.enter_context(moe_fake_kernels())
    if not real:
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        model.to_empty(device="cpu")
        if not sharded and hasattr(model, "tie_weights"):
            model.tie_weights()  # to_empty made fake copies of tied weights: one tensor again
    device = torch.device("cpu")
    MemoryLevers(
        model, device, spec.chunked_loss, spec.offload_activations, spec.loss_chunk_tokens,
        offload_host=torch.device("meta"),  # host copies: not counted as the device's
    )  # fmt: skip
    if spec.tiled_mlp:  # after the backend's wrapping, as the engine does
        apply_tiled_mlp(model, spec.mlp_chunk_tokens)
    backend = build_backend(spec.strategy, _backend_context(spec, device, mesh))
    return model, attach(backend, model, _optimizer(model, spec), _SPEC.grad_clip), mesh.dims


def _sequence_split(
    spec: StepSpec, sharded: bool, stack: contextlib.ExitStack, expert: int = 1
) -> ParallelMesh:
    """The data x sequence x tensor world whose rank 0 is traced, over a fake process group (of
    the world for fsdp, of one sequence x tensor group for single), its model attending through
    the engine's Ulysses all-to-alls and split by transformers' tensor plan (the fake group
    completes their collectives without moving data)."""
    sp, tp = spec.sequence_parallel, spec.tensor_parallel
    world = spec.world_size if sharded else sp * tp
    if sharded or sp * tp > 1:
        stack.enter_context(fake_process_group(world))
    return build_mesh(ParallelDims(world, sp, tp, expert), 0)


def _backend_context(spec: StepSpec, device: torch.device, mesh: ParallelMesh) -> BackendContext:
    job = JobConfig(
        model={"config": {"model_type": "traced"}},
        data={"path": "traced"},
        fsdp={"reduce_every_micro_batch": spec.fsdp_reduce_every_micro_batch},
    )
    return BackendContext(
        cfg=job, device=device, rank=0, local_rank=0, world_size=spec.world_size,
        precision=spec.precision, activation_checkpointing=spec.activation_checkpointing,
        micro_batch_size=spec.micro_batch_size, grad_accum=spec.grad_accum, mesh=mesh,
    )  # fmt: skip


class _PhaseMarks:
    """The tracker's live and peak bytes as each phase begins (`trainer/observe/phases.py` calls
    it)."""

    def __init__(self, tracker: Any, phase_local_peaks: bool, until: str | None):
        self.tracker, self.local, self.until = tracker, phase_local_peaks, until
        self.marks: list[tuple[str, int, int]] = []  # (label, live bytes, peak so far)
        self.highest: Any = None  # with phase-local peaks: the step's peak snapshot so far
        if phase_local_peaks:
            _global_peak_only(tracker)

    def __call__(self, label: str) -> None:
        current = self.tracker.get_tracker_snapshot("current")
        peak = self.tracker.get_tracker_snapshot("peak")
        self.marks.append((label, _total(current), _total(peak)))
        if self.local:
            if self.highest is None or _total(peak) > _total(self.highest):
                self.highest = peak
            _restart_peak(self.tracker, current)
        if label == self.until:
            raise _Stop


def _step(model: nn.Module, backend: Any, batches: list[dict], tracker: Any, mark: Any) -> None:
    """One training step through the engine's functions (trainer/step.py): the micro-batches
    in the backend's accumulation context, forward under its compute context, its backward;
    then clipping, the optimizer step and zero_grad as the replica rungs' backends run them
    (stream: on the host, once its gradients have landed there)."""
    tokens = batches[0]["input_ids"].numel()
    streams = backend.name == "stream"
    mark(STEP)
    for i, batch in enumerate(batches):
        tracker.reset_mod_stats()  # its per-module stats allow one call per module
        with accumulation_context(backend, last=i == len(batches) - 1):
            loss_sum = micro_batch_loss(model, backend, batch)
            backend.backward(loss_sum / tokens)
            del loss_sum
        if streams:
            land_gradients(backend)
    mark(OPTIMIZER)
    if streams:
        return
    clip_and_step(model.parameters(), backend.optimizer, None, backend.grad_clip)


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


def autocast_for(precision: str):
    dtype = COMPUTE_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast("cpu", dtype=dtype)


def packed_batch(vocab_size: int, micro: int, seq: int) -> dict[str, torch.Tensor]:
    """A packed window as the data pipeline makes it: position ids restart per document (two
    documents here; a real step's transformers reads them and builds the block-causal mask)."""
    ids = torch.zeros(micro, seq, dtype=torch.long)
    return {
        "input_ids": ids,
        "labels": ids.clone(),
        "position_ids": (torch.arange(seq) % max(1, seq // 2)).repeat(micro, 1),
    }


def _tracker(strategy: str, model: nn.Module, optimizer: Any, batch) -> Any:
    if strategy == "fsdp":
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker = FSDPMemTracker(model, optimizer)
        _skip_frozen(tracker, model)
        tracker.track_inputs(tuple(batch.values()))
        return tracker
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    _skip_frozen(tracker, model)
    optimizers = [optimizer] if optimizer is not None else []
    tracker.track_external(model, *optimizers, *batch.values())
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
    """What `finetune.method` trains, built by the engine's own trainer/model/finetune.py."""
    from trainer.core.config import FinetuneConfig, LoraConfig
    from trainer.model.finetune import apply_finetune as engine_apply

    targets = ft.target_modules if isinstance(ft.target_modules, str) else list(ft.target_modules)
    lora = LoraConfig(r=ft.r, dropout=ft.dropout, target_modules=targets)
    return engine_apply(model, FinetuneConfig(method=ft.method, lora=lora), precision, seed=0)


def _optimizer(model: nn.Module, spec: StepSpec) -> torch.optim.Optimizer:
    """The engine's optimizer over what trains: fused AdamW, bitsandbytes' AdamW8bit, or under
    bf16_pure torchao's bf16 AdamW."""
    from dataclasses import replace

    from trainer.optim import build_optimizer

    kind = {"name": spec.finetune.optimizer}
    if spec.precision == "bf16_pure":
        kind["bf16_pure"] = True
    return build_optimizer(list(model.parameters()), replace(_SPEC, **kind))


@contextlib.contextmanager
def fake_process_group(world_size: int):
    """A process group of `world_size` ranks that exists in this process only (rank 0)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    exchange = dist.all_to_all_single

    def uneven_exchange(output, input, *args, **kwargs):
        # the fake group fills what a rank receives from what it sends, so it refuses an empty
        # send with a receive (a rank of the k/v heads' rounds, trainer/memory/
        # sequence_parallel.py, that receives gradients and sends none): the receive buffer is
        # allocated already, all the trace counts
        if input.numel() == 0 and output.numel() > 0:
            return None
        return exchange(output, input, *args, **kwargs)

    dist.all_to_all_single = uneven_exchange
    try:
        yield
    finally:
        dist.all_to_all_single = exchange
        dist.destroy_process_group()
