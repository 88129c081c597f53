"""The training loop: one loop for every strategy; it talks only to a `Backend`.

Each optimizer step takes the global batch of that step (chosen by the seed and the step alone),
runs this rank's micro-batches with gradient accumulation, and weights every token equally over
the whole global batch: backward receives sum-of-token-losses / global target tokens, so the
update does not depend on how the batch is split into ranks and micro-batches.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from typing import Any

import torch

from launcher.config import JobConfig
from launcher.logs import setup_logging
from trainer.backends import Backend, BackendContext, OptimizerSpec, build_backend
from trainer.checkpoint import (
    load_checkpoint,
    load_template,
    resolve_resume,
    restore_rng,
    save_checkpoint,
)
from trainer.data import build_data, build_tokenizer
from trainer.dist import (
    all_reduce_max,
    barrier,
    env_rank,
    init_distributed,
    resolve_device,
)
from trainer.evaluate import evaluate
from trainer.export import save_hf_model
from trainer.metrics import MetricsLog
from trainer.model import HFModelFactory, count_parameters
from trainer.schedule import lr_at
from trainer.signals import EXIT_SIGNAL, StopSignals
from trainer.step import train_step

log = logging.getLogger(__name__)


def run_training(cfg: JobConfig) -> int:
    """Train as the resolved config says, on this rank. Returns the process exit code."""
    rank, local_rank, world_size = env_rank()
    setup_logging(rank, world_size)
    device = resolve_device(cfg, local_rank)
    init_distributed(cfg, device)
    _seed_everything(cfg)
    run_dir = Path(cfg.run.dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)

    micro = _concrete_micro_batch(cfg)
    grad_accum = cfg.train.global_batch_size // (micro * world_size)
    ctx = BackendContext(
        cfg=cfg,
        device=device,
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        precision=cfg.precision,
        activation_checkpointing=_concrete_ac(cfg),
        micro_batch_size=micro,
        grad_accum=grad_accum,
    )
    tokenizer = build_tokenizer(cfg.model)
    data = build_data(cfg, tokenizer)
    factory = HFModelFactory(cfg.model, cfg.train.seed)
    backend = build_backend(cfg.strategy, ctx)
    model = backend.setup(factory, _optimizer_spec(cfg))
    log.info(
        "%s: %s params, world %d, micro-batch %d x accumulation %d x %d ranks = global batch %d, "
        "%s, activation checkpointing %s",
        cfg.strategy,
        f"{_num_params(factory):,}",
        world_size,
        micro,
        grad_accum,
        world_size,
        cfg.train.global_batch_size,
        cfg.precision,
        ctx.activation_checkpointing,
    )

    start_step = 0
    resume_from = resolve_resume(cfg)
    if resume_from is not None:
        start_step = _resume(resume_from, backend, cfg, rank)
    metrics = MetricsLog(run_dir, cfg.train.steps, enabled=rank == 0, log_every=cfg.train.log_every)
    if rank == 0:
        metrics.truncate_after(start_step)
    stop = StopSignals()

    for step in range(start_step, cfg.train.steps):
        backend.reset_peak()
        lr = lr_at(cfg.train, step)
        backend.set_lr(lr)
        batches = data.train.micro_batches(
            step, rank, world_size, micro, cfg.train.global_batch_size
        )
        result = train_step(model, backend, batches, device)
        record = {
            "step": step + 1,
            "loss": result.loss,
            "lr": lr,
            "grad_norm": result.grad_norm,
            "tokens": result.num_tokens,
            "tokens_per_s": result.num_tokens / result.step_time_s,
            "step_time_s": result.step_time_s,
            "peak_device_bytes": int(
                all_reduce_max(backend.memory_stats()["peak_device_bytes"], device)
            ),
            "strategy": cfg.strategy,
            "world_size": world_size,
            "micro_batch_size": micro,
            "grad_accum": grad_accum,
        }
        if _due(step + 1, cfg.train.eval_every, cfg.train.steps) and data.eval is not None:
            batches_iter = data.eval.batches(micro, rank, world_size)
            record.update(
                evaluate(
                    model,
                    itertools.islice(batches_iter, cfg.train.eval_batches),
                    backend.compute_context,
                    device,
                )
            )
        metrics.write(record)

        stopping = stop.agreed(device)
        last = step + 1 == cfg.train.steps
        if stopping or (_due(step + 1, cfg.run.checkpoint_every, cfg.train.steps) and not last):
            _checkpoint(run_dir, step + 1, backend, ctx, tokenizer)
        if stopping:
            log.warning("stopped by %s after step %d; checkpoint written", stop.name, step + 1)
            return EXIT_SIGNAL

    if cfg.run.save_final:
        weights = backend.full_model_state_dict()
        if rank == 0:
            assert weights is not None
            out = save_hf_model(
                factory.hf_config,
                weights,
                run_dir / "final",
                tokenizer,
                cfg.model.trust_remote_code,
            )
            log.info("saved the trained model to %s", out)
        barrier()
    return 0


def _resume(path: Path, backend: Backend, cfg: JobConfig, rank: int) -> int:
    """Load a checkpoint of any strategy and world size into this backend; returns its step."""
    state = load_checkpoint(path, load_template(backend.state_dict()), cfg)
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
    run_dir: Path, step: int, backend: Backend, ctx: BackendContext, tokenizer: Any
) -> None:
    cfg = ctx.cfg
    start = time.perf_counter()
    backend_state = backend.state_dict()
    trainer_state = {
        "strategy": cfg.strategy,
        "world_size": ctx.world_size,
        "micro_batch_size": ctx.micro_batch_size,
        "scaler": backend_state.get("scaler") or {},
    }
    path = save_checkpoint(
        run_dir,
        step,
        backend_state,
        trainer_state,
        cfg,
        tokenizer,
        ctx.rank,
        cfg.run.keep_checkpoints,
    )
    log.info("checkpoint %s written in %.1f s", path, time.perf_counter() - start)


def _optimizer_spec(cfg: JobConfig) -> OptimizerSpec:
    t = cfg.train
    return OptimizerSpec(
        lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay, grad_clip=t.grad_clip
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


def _seed_everything(cfg: JobConfig) -> None:
    torch.manual_seed(cfg.train.seed)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def _due(step: int, every: int, total: int) -> bool:
    return every > 0 and (step % every == 0 or step == total)
