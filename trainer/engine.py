"""The training loop: one loop for every strategy; it talks only to a `Backend`.

Each optimizer step takes the global batch of that step (chosen by the seed and the step alone),
runs this rank's micro-batches with gradient accumulation, and weights every token equally over
the whole global batch: backward receives sum-of-token-losses / global target tokens, so the
update does not depend on how the batch is split into ranks and micro-batches.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.backends import Backend, BackendContext, OptimizerSpec, build_backend
from trainer.backoff import (
    OutOfMemoryGaveUp,
    evaluate_with_backoff,
    report_oom,
    report_oom_alone,
    step_with_backoff,
    write_report,
)
from trainer.checkpoint.checkpointer import Checkpointer, load_checkpoint, restore_rng
from trainer.checkpoint.export import save_final_model
from trainer.checkpoint.layout import load_template
from trainer.checkpoint.store import resolve_resume
from trainer.core.config import ConfigError, JobConfig, check_run_time_extras
from trainer.core.contract import EXIT_OOM, EXIT_SIGNAL, FINAL_DIR
from trainer.core.flops import training_flops_per_token
from trainer.core.gpus import peak_flops_for
from trainer.core.logs import setup_logging
from trainer.data import build_data, build_tokenizer
from trainer.memory.levers import MemoryLevers, concrete_lever
from trainer.memory.tiled_mlp import apply_tiled_mlp, tiled_mlp_chunk_tokens
from trainer.model.build import (
    HFModelFactory,
    checkpointing_words,
    count_parameters,
    num_compiled_layers,
)
from trainer.model.finetune import build_factory, describe_method
from trainer.objectives import Objective, build_objective
from trainer.objectives.reference import build_reference
from trainer.observe.metrics import MetricsLog
from trainer.observe.probe import probe_first_step
from trainer.observe.profile import ProfileWindow
from trainer.observe.trackers import Trackers
from trainer.parallel.dims import run_dims
from trainer.parallel.mesh import ParallelMesh, build_mesh
from trainer.parallel.split import BatchSplit
from trainer.runtime.dist import (
    after_rank0,
    env_rank,
    init_distributed,
    resolve_device,
    slow_down,
)
from trainer.runtime.hang import HangWatchdog, inject_hang
from trainer.runtime.oom import (
    FaultInjector,
    OutOfMemoryInStep,
    is_oom,
)
from trainer.runtime.signals import StopSignals
from trainer.runtime.slurm_requeue import after_stop
from trainer.schedule import lr_at

log = logging.getLogger(__name__)


def run_training(cfg: JobConfig) -> int:
    """Train as the resolved config says, on this rank. Returns the process exit code."""
    check_run_time_extras(cfg)  # every node: the libraries of the job's opt-ins
    run = _setup(cfg)
    if isinstance(run, int):  # out of memory while setting up
        return run
    try:
        code = _train(run)
    finally:
        run.watchdog.close()
    if code == 0 and cfg.run.save_final:
        _save_final(run)
    return code


@dataclass
class _Run:
    """What one rank's training holds from setup to the end."""

    cfg: JobConfig
    ctx: BackendContext
    run_dir: Path
    backend: Backend
    model: torch.nn.Module
    factory: HFModelFactory
    tokenizer: Any
    data: Any
    split: BatchSplit
    faults: FaultInjector
    watchdog: HangWatchdog
    start_step: int
    objective: Objective


def _setup(cfg: JobConfig) -> _Run | int:
    """Process group, data, model and backend, and the checkpoint to resume from; EXIT_OOM
    (with a report) when that runs out of memory."""
    rank, local_rank, world_size = env_rank()
    setup_logging(rank, world_size)
    model_factory = HFModelFactory(cfg.model, cfg.train.seed)
    dims = run_dims(cfg, world_size, model_factory.hf_config)  # exit 2 before a process group
    device = resolve_device(cfg, local_rank)
    init_distributed(cfg, device)
    _seed_everything(cfg)
    mesh = build_mesh(dims, rank, device.type)  # the backend's model splits over it
    run_dir = Path(cfg.run.dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)

    ctx = _backend_context(cfg, device, rank, local_rank, mesh)
    micro = ctx.micro_batch_size
    tokenizer = build_tokenizer(cfg.model)
    data = build_data(cfg, tokenizer)
    factory = build_factory(model_factory, cfg)
    backend = build_backend(cfg.strategy, ctx)
    faults = FaultInjector(cfg.debug.inject_oom, cfg.strategy, rank)
    split = BatchSplit(
        mesh.dims,
        rank,
        mesh.sequence_group,
        cfg.train.global_batch_size // mesh.dims.data,
        micro,
        ctx.activation_checkpointing,
        token_group=mesh.token_group,
    )
    resume_from = resolve_resume(cfg)
    start_step = 0
    phase = "setup"
    try:  # sharding, optimizer state, loading a checkpoint: an OOM here climbs a rung too
        faults.at("setup")
        model = backend.setup(factory, _optimizer_spec(cfg))
        phase = "reference"  # before a resume: the model holds the initial weights
        objective = _objective(cfg, model, backend, data, split, device)
        if resume_from is not None:
            phase = "resume"
            start_step = _resume(resume_from, backend, cfg, rank, data.fingerprint)
    except Exception as err:
        if not is_oom(err):
            raise
        # No agreement is possible here (the others may be in a collective of setup or load):
        # this rank reports alone and leaves; torchrun stops the others.
        measured = int(backend.memory_stats()["peak_device_bytes"])
        write_report(run_dir, phase, err, [rank], measured, 0, start_step, split, ctx)
        return EXIT_OOM
    split.levers = _memory_levers(cfg, model, device)
    if concrete_lever(cfg.memory.tiled_mlp):  # auto: off until the planner chooses
        apply_tiled_mlp(model, cfg.memory.mlp_chunk_tokens)
    watchdog = HangWatchdog(cfg, run_dir, rank, world_size)
    return _Run(
        cfg, ctx, run_dir, backend, model, factory, tokenizer, data, split, faults, watchdog,
        start_step, objective,
    )  # fmt: skip


def _backend_context(
    cfg: JobConfig, device: torch.device, rank: int, local_rank: int, mesh: ParallelMesh
) -> BackendContext:
    """What every backend is told: the rank, the device, and the micro-batch x accumulation that
    makes up the global batch on the data ranks running (checked: after an elastic restart on
    fewer ranks the resolved micro-batch may not divide it)."""
    micro, dims = _concrete_micro_batch(cfg), mesh.dims
    if cfg.train.global_batch_size % (micro * dims.data):  # an elastic restart on fewer ranks
        raise ConfigError(
            "train.micro_batch_size",
            f"{micro} x {dims.data} data ranks running does not divide train.global_batch_size="
            f"{cfg.train.global_batch_size}",
            "use a micro-batch that divides it on every world size the job may run on",
        )
    return BackendContext(
        cfg=cfg,
        device=device,
        rank=rank,
        local_rank=local_rank,
        world_size=dims.world_size,
        precision=cfg.precision,
        activation_checkpointing=_concrete_ac(cfg),
        micro_batch_size=micro,
        grad_accum=cfg.train.global_batch_size // (micro * dims.data),
        mesh=mesh,
    )


def _objective(
    cfg: JobConfig,
    model: torch.nn.Module,
    backend: Backend,
    data: Any,
    split: BatchSplit,
    device: torch.device,
) -> Objective:
    """What the loss rewards; DPO's reference (its precomputed pass runs here, while the model
    holds the initial weights)."""
    share = (split.data_rank, split.dims.data, split.micro_batch_size)
    reference = build_reference(cfg, model, backend.compute_context, data, share, device)
    return build_objective(cfg, reference)


def _memory_levers(cfg: JobConfig, model: torch.nn.Module, device: torch.device) -> MemoryLevers:
    """Chunked loss and activation offload as the resolved config says (`auto`: off)."""
    return MemoryLevers(
        model,
        device,
        chunked_loss=concrete_lever(cfg.memory.chunked_loss),
        offload_activations=concrete_lever(cfg.memory.offload_activations),
        loss_chunk_tokens=cfg.memory.loss_chunk_tokens,
    )


def _train(run: _Run) -> int:
    """The loop, from the resumed step to the last: 0, or EXIT_OOM / EXIT_SIGNAL.

    Longer than the others on purpose: what one step does, and every way it can end (an OOM,
    a signal, the last step), reads top to bottom here, as nanoGPT's loop does."""
    cfg, ctx, split, backend = run.cfg, run.ctx, run.split, run.backend
    num_params = _num_params(run.factory)
    _log_start(run, num_params)
    metrics = MetricsLog(
        run.run_dir, cfg.train.steps, enabled=ctx.rank == 0, log_every=cfg.train.log_every
    )
    if ctx.rank == 0:
        metrics.truncate_after(run.start_step)
    stop = StopSignals()
    checkpointer = Checkpointer(run.run_dir, cfg, run.tokenizer, ctx.rank, run.data.fingerprint)
    trackers = Trackers.start(
        cfg.run.trackers, run.run_dir, cfg.run.name, run.start_step, ctx.rank == 0
    )
    optimizer = getattr(backend, "optimizer", None)
    window = ProfileWindow(
        cfg.debug.profile, run.run_dir, ctx.rank, ctx.device, run.model, optimizer
    )
    peak_flops = _device_peak_flops(ctx.device)
    flops_per_token = _flops_per_token(run.factory.hf_config, num_params, cfg.data.seq_len)
    for step in range(run.start_step, cfg.train.steps):
        backend.reset_peak()
        lr = lr_at(cfg.train, step)
        backend.set_lr(lr)
        run.faults.step = step
        run.watchdog.started(step)
        inject_hang(cfg, step, ctx.rank, run.run_dir)
        try:
            window.begin(step)
            result = step_with_backoff(
                run.model, backend, run.data, split, step, ctx, run.faults, run.objective
            )
        except OutOfMemoryGaveUp as err:
            report_oom(run.run_dir, err, step, split, backend, ctx)
            return _ended(EXIT_OOM, trackers, window)
        except OutOfMemoryInStep as err:  # this rank alone; no collective may follow
            report_oom_alone(run.run_dir, err, step, split, backend, ctx)
            return _ended(EXIT_OOM, trackers, window)
        profiled = window.end(step)
        if step == run.start_step and (probed := probe_first_step(run, backend)) is not None:
            return _ended(probed, trackers, window)  # over budget: launcher/run/probe.py
        stopping, peak_bytes = stop.agreed_with(
            backend.memory_stats()["peak_device_bytes"], ctx.device
        )
        record = _step_record(step, lr, result, peak_bytes, split, ctx)
        if profiled:  # its time includes the profiler's overhead: not throughput
            record["profiled"] = True
        if peak_flops:
            mfu = flops_per_token * result.num_tokens / result.step_time_s
            record["mfu"] = mfu / (peak_flops * ctx.world_size)
        if _due(step + 1, cfg.train.eval_every, cfg.train.steps) and run.data.eval is not None:
            try:
                record.update(_evaluate(run))
            except OutOfMemoryGaveUp as err:  # at eval batch 1: climb a rung, like a step
                report_oom(run.run_dir, err, step, split, backend, ctx)
                return _ended(EXIT_OOM, trackers, window)
        metrics.write(record)
        trackers.log(record)
        run.watchdog.finished()

        # the last step is always in a checkpoint (or, with checkpoint_every 0, in final/)
        last = step + 1 == cfg.train.steps and (cfg.run.checkpoint_every or not cfg.run.save_final)
        in_flight = checkpointer.step_in_flight
        if stopping and in_flight is not None and not last:
            # a background write was under way when the signal came: it is the stop's
            return _ended(_stopped(run, checkpointer, stop, in_flight), trackers, window)
        if stopping or last or _due(step + 1, cfg.run.checkpoint_every, cfg.train.steps):
            asynchronous = cfg.run.async_checkpoint and not stopping
            _checkpoint(checkpointer, step + 1, backend, ctx, split, asynchronous)
            # a signal that came during the write: this checkpoint is the stop's, no step more
            stopping = stopping or (not last and stop.agreed(ctx.device))
        if stopping:
            return _ended(_stopped(run, checkpointer, stop, step + 1), trackers, window)
    checkpointer.finish()
    return _ended(0, trackers, window)


def _evaluate(run: _Run) -> dict[str, float]:
    """The held-out metrics; OutOfMemoryGaveUp at eval batch 1 (the caller climbs a rung)."""
    return evaluate_with_backoff(
        run.model, run.backend, run.data.eval, run.split, run.ctx, run.faults, run.objective
    )


def _stopped(run: _Run, checkpointer: Checkpointer, stop: StopSignals, step: int) -> int:
    """A stop signal: the checkpoint of `step` completed; the exit code (back in the Slurm
    queue when preempted with SIGUSR1)."""
    checkpointer.finish()
    log.warning("stopped by %s after step %d; checkpoint written", stop.name, step)
    return after_stop(stop.signum, run.ctx.rank, step, run.run_dir, EXIT_SIGNAL)


def _ended(code: int, trackers: Trackers, window: ProfileWindow) -> int:
    """Close what watches the run (trackers, a profiler window left open); the exit code."""
    window.close()
    trackers.close(code)
    return code


def _log_start(run: _Run, num_params: int) -> None:
    cfg, ctx, dims = run.cfg, run.ctx, run.split.dims
    sp = (
        f", sequence parallel {dims.sequence} (a sequence over {dims.sequence} ranks)"
        if dims.sequence > 1
        else ""
    )
    log.info(
        "%s: %s params%s, world %d, micro-batch %d x accumulation %d x %d ranks = global batch %d, "
        "%s%s, activation checkpointing %s, chunked loss %s, activation offload %s%s%s",
        cfg.strategy,
        f"{num_params:,}",
        describe_method(cfg, run.model),
        ctx.world_size,
        ctx.micro_batch_size,
        ctx.grad_accum,
        dims.data,
        cfg.train.global_batch_size,
        _precision_and_optimizer(cfg, ctx.device),
        sp,
        checkpointing_words(ctx.activation_checkpointing, cfg),
        "on" if run.split.levers.chunked_loss else "off",
        "on" if run.split.levers.offload_activations else "off",
        f", {n} layers compiled" if (n := num_compiled_layers(run.model)) else "",
        f", MLP tiled in chunks of {n} tokens" if (n := tiled_mlp_chunk_tokens(run.model)) else "",
    )


def _precision_and_optimizer(cfg: JobConfig, device: torch.device) -> str:
    """'bf16', or 'bf16_pure, paged_adamw_8bit' (on CPU processes: run as adamw_8bit)."""
    name = cfg.train.optimizer
    if name == "adamw":
        return cfg.precision
    if name == "paged_adamw_8bit" and device.type != "cuda":
        name += " (run as adamw_8bit: no CUDA memory to page here)"
    return f"{cfg.precision}, {name}"


def _step_record(
    step: int, lr: float, result: Any, peak_bytes: float, split: BatchSplit, ctx: BackendContext
) -> dict[str, Any]:
    """One line of metrics.jsonl."""
    return {
        "step": step + 1,
        "loss": result.loss,
        "lr": lr,
        "grad_norm": result.grad_norm,
        "tokens": result.num_tokens,
        "tokens_per_s": result.num_tokens / result.step_time_s,
        "step_time_s": result.step_time_s,
        "peak_device_bytes": int(peak_bytes),
        "strategy": ctx.cfg.strategy,
        "world_size": ctx.world_size,
        "micro_batch_size": split.micro_batch_size,
        "grad_accum": split.grad_accum,
        "activation_checkpointing": split.activation_checkpointing,
        **split.levers.record(),
        **result.stats,
    }


def _save_final(run: _Run) -> None:
    """The trained model as a Hugging Face directory (run.dir/final; a PEFT adapter directory
    for lora/qlora), written by rank 0; the other ranks wait on that work, not on a clock."""
    weights = run.backend.full_model_state_dict()  # a collective: every rank joins

    def save_final() -> None:
        slow_down(run.cfg, "final_save_s")
        assert weights is not None
        out = save_final_model(
            run.cfg, run.factory.hf_config, weights, run.run_dir / FINAL_DIR, run.tokenizer
        )
        log.info("saved the trained model to %s", out)

    after_rank0("saving the final model", save_final, clock_s=run.cfg.dist.timeout_s)


def _resume(path: Path, backend: Backend, cfg: JobConfig, rank: int, data_fingerprint: str) -> int:
    """Load a checkpoint of any strategy and world size into this backend; returns its step."""
    state = load_checkpoint(path, load_template(backend.state_dict()), cfg, data_fingerprint)
    backend_state = state["backend"]
    backend_state["scaler"] = state.get("scaler") or {}
    backend.load_state_dict(backend_state)
    restore_rng(path, rank)
    log.info(
        "resumed from %s (step %d, written by %s on %d ranks)",
        path,
        state["step"],
        state.get("strategy"),
        state.get("world_size"),
    )
    return int(state["step"])


def _checkpoint(
    checkpointer: Checkpointer,
    step: int,
    backend: Backend,
    ctx: BackendContext,
    split: BatchSplit,
    asynchronous: bool,
) -> None:
    start = time.perf_counter()
    backend_state = backend.state_dict()
    trainer_state = {
        "strategy": ctx.cfg.strategy,
        "world_size": ctx.world_size,
        "micro_batch_size": split.micro_batch_size,
        "scaler": backend_state.get("scaler") or {},
    }
    path = checkpointer.save(step, backend_state, trainer_state, asynchronous)
    log.info(
        "checkpoint %s %s in %.2f s",
        path,
        "staged (writing in the background)" if asynchronous else "written",
        time.perf_counter() - start,
    )


def _optimizer_spec(cfg: JobConfig) -> OptimizerSpec:
    t = cfg.train
    return OptimizerSpec(
        lr=t.lr,
        betas=tuple(t.betas),
        eps=t.eps,
        weight_decay=t.weight_decay,
        grad_clip=t.grad_clip,
        name=t.optimizer,
        bf16_pure=cfg.precision == "bf16_pure",
        in_backward=t.optimizer_in_backward,
    )


def _concrete_micro_batch(cfg: JobConfig) -> int:
    micro = cfg.train.micro_batch_size
    if micro == "auto":
        raise ValueError("train.micro_batch_size is 'auto': the engine needs a resolved config")
    return micro


def _concrete_ac(cfg: JobConfig) -> str:
    ac = cfg.memory.activation_checkpointing
    return "none" if ac == "auto" else ac


def _num_params(factory: HFModelFactory) -> int:
    return count_parameters(factory.build("meta"))


def _device_peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of a known GPU (for MFU); None on CPU or an unknown device."""
    if device.type != "cuda":
        return None
    return peak_flops_for(torch.cuda.get_device_name(device))


def _flops_per_token(hf_config: Any, num_params: int, seq_len: int) -> float:
    """Training FLOPs per token of the model (trainer/core/flops.py), for MFU."""
    layers = getattr(hf_config, "num_hidden_layers", 0)
    hidden = getattr(hf_config, "hidden_size", 0)
    return training_flops_per_token(num_params, layers, hidden, seq_len)


def _seed_everything(cfg: JobConfig) -> None:
    torch.manual_seed(cfg.train.seed)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def _due(step: int, every: int, total: int) -> bool:
    return every > 0 and (step % every == 0 or step == total)
