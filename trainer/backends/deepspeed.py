"""`zero1`, `zero2`, `zero3`, `zero3_offload`, `zero3_offload_params`, `zero3_nvme`: DeepSpeed ZeRO.

DeepSpeed is imported here only, when a DeepSpeed rung runs. ZeRO-3 builds the model inside
`deepspeed.zero.Init`, so parameters are partitioned as they are created and no rank holds the
full model; the initial weights then come from rank 0, one parameter at a time
(`GatheredParameters(modifier_rank=0)`). Offload rungs use DeepSpeed's CPU Adam (AdamW mode);
the others torch AdamW with the same hyper-parameters as every other rung.

DeepSpeed averages gradients over ranks and divides the loss by its accumulation steps, so
backward scales the engine's loss share by world size x accumulation; DeepSpeed wants
`engine.step()` after every backward and steps the optimizer only at its accumulation boundary.
Mixed precision: fp32 parameters (a frozen LoRA base in the compute dtype, as on every rung),
fp32 gradients and fp32 AdamW state; bf16 compute by the
`torch_autocast` section of the DeepSpeed config, i.e. autocast inside the engine's forward (an
outer torch.autocast on CUDA would be switched off by the engine when that section is absent).
fp16 is not offered on these rungs.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import time
import warnings
from collections.abc import Collection, Iterator
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.backends import BackendContext, ModelFactory, OptimizerSpec
from trainer.backends.common import (
    device_memory_stats,
    model_changes,
    reset_device_peak,
    trained_params,
)
from trainer.backends.deepspeed_config import build_deepspeed_config
from trainer.core import strategies
from trainer.core.config import ConfigError
from trainer.model.pretrained import load_per_rank, load_zero3_partitions
from trainer.parallel.parallelize import parallelize
from trainer.runtime.dist import after_rank0, all_reduce_max, all_reduce_sum

log = logging.getLogger(__name__)


class DeepSpeedBackend:
    def __init__(self, strategy: str, ctx: BackendContext):
        if ctx.precision == "fp16":
            raise ConfigError(
                "precision", f"fp16 is not supported on {strategy}", "use precision=bf16"
            )
        self.name = strategy
        self.ctx = ctx
        self.rung = strategies.row(strategy)
        self.stage = self.rung.zero_stage
        self.offload_optimizer = self.rung.optimizer_at != "device"
        self._accumulating = False

    def setup(self, factory: ModelFactory, optim: OptimizerSpec) -> nn.Module:
        import deepspeed

        ctx = self.ctx
        # async_io is built last and only zero3_nvme loads it: no other rung waits for its build
        wait_for_build_locks(skip=() if self.rung.needs_nvme else ("async_io",))
        if self.rung.needs_nvme:
            _require_async_io()
        if ctx.cfg.train.compile and ctx.rank == 0:
            # ZeRO-3 gathers each layer's parameters in module hooks, which dynamo cannot trace
            log.warning("train.compile is not applied under %s: its layers run eagerly", self.name)
        # Adopt the process group the engine created (gloo on CPU, NCCL on CUDA). DeepSpeed
        # prints "... built successfully" for its shared-memory op here, and calls collectives
        # torch has deprecated (a FutureWarning per call site): neither is the user's to act on.
        with contextlib.redirect_stdout(io.StringIO()):
            deepspeed.init_distributed(dist_backend="nccl" if ctx.device.type == "cuda" else "gloo")
        warnings.filterwarnings(
            "ignore",
            message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is",
            category=FutureWarning,
        )
        ds_config = build_deepspeed_config(
            ctx.cfg, ctx.world_size, ctx.micro_batch_size, ctx.grad_accum
        )
        if ctx.cfg.deepspeed.overrides:
            log.info("deepspeed.overrides merged: %s", json.dumps(ctx.cfg.deepspeed.overrides))
        if self.stage == 3:
            build = partial(self._build_partitioned, factory, ds_config)
        else:
            build = partial(factory.build, ctx.device)

        def wrap(model: nn.Module) -> nn.Module:
            self.module = model
            self.engine, self.optimizer, _, _ = deepspeed.initialize(
                model=model, optimizer=self._optimizer(model, optim), config=ds_config
            )
            return self.engine

        parallelize(build, factory.hf_config, model_changes(ctx, compile=False), wrap)
        self._init_optimizer_state()
        return self.engine

    def _init_optimizer_state(self) -> None:
        """Create AdamW's zero moments now rather than at the first step (the same values), so
        a checkpoint can be loaded into them before any step has run."""
        base = self.optimizer.optimizer
        tensor_step = not hasattr(base, "ds_opt_adam")  # torch AdamW; CPU Adam counts in ints
        # ZeRO-3 hands its flat fp32 partitions to the base optimizer only during step().
        flat = getattr(self.optimizer, "fp32_partitioned_groups_flat", None)
        targets = flat if flat is not None else [p for g in base.param_groups for p in g["params"]]
        for i, p in enumerate(targets):
            if base.state.get(p):
                continue
            # ZeRO-Infinity keeps a sub-group's partition and moments on NVMe: read the partition
            # in, add the moments, and write both back (the swapper then tracks the moments).
            swapped = flat is not None and self.optimizer._swappable_optimizer_subgroup(i)
            if swapped:
                self.optimizer._optimizer_states_and_gradient_swap_in(i)
            base.state[p] = {
                "step": torch.zeros((), dtype=torch.float32) if tensor_step else 0,
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }
            if swapped:
                self.optimizer._optimizer_states_and_gradient_swap_out(i)
        link = getattr(self.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:  # ZeRO-1/2: point each parameter's fragment at the new moments
            link()

    def _build_partitioned(self, factory: ModelFactory, ds_config: dict[str, Any]) -> nn.Module:
        import deepspeed
        from transformers import AutoModelForCausalLM

        remote = "cpu" if self.rung.params_at == "cpu" else None
        if getattr(factory, "quantizes", False):
            return self._build_4bit_partitioned(factory, ds_config, remote)
        adapt = getattr(factory, "adapt", None)  # LoRA: adapters (not partitioned yet) on top
        init = deepspeed.zero.Init(config_dict_or_path=ds_config, remote_device=remote)
        dtype = torch.float32
        if adapt is not None and not self.rung.needs_nvme:
            # a LoRA base is frozen: its partitions are kept (and gathered) in the compute dtype,
            # as on every other rung; what trains stays fp32 (DeepSpeed gathers each dtype
            # apart). Set on the object: Init's own `dtype` argument is lost on a CPU process
            # (its _set_dtype reads `dtype or fp16 if ... else bf16 ...` as `(dtype or fp16) if`)
            # and the NVMe swapper's buffers are sized in the config's dtype before it.
            dtype = init.dtype = factory.base_dtype
        with init, torch.random.fork_rng(devices=[]):
            model = AutoModelForCausalLM.from_config(factory.hf_config, dtype=dtype)
        if adapt is not None:
            model = adapt(model)
        model.config.use_cache = False
        if not self.rung.needs_nvme and load_per_rank(
            model, factory, load_zero3_partitions, self.ctx, "ZeRO-3 partitions"
        ):
            return model
        full = after_rank0(
            "building the initial weights",
            factory.initial_state_dict,
            clock_s=self.ctx.cfg.dist.timeout_s,
        )
        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if self.ctx.rank == 0:
                    with torch.no_grad():
                        param.copy_(full[name])
        return model

    def _optimizer(self, model: nn.Module, optim: OptimizerSpec) -> torch.optim.Optimizer:
        kwargs = dict(
            lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay
        )
        trainable = [p for p in model.parameters() if p.requires_grad]  # a LoRA base is frozen
        if self.offload_optimizer:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(trainable, adamw_mode=True, **kwargs)
        return torch.optim.AdamW(trainable, **kwargs)

    def _build_4bit_partitioned(
        self, factory: ModelFactory, ds_config: dict[str, Any], remote: str | None
    ) -> nn.Module:
        """QLoRA on ZeRO-3, as PEFT's docs run it: every rank builds the quantised model on the
        host (the same seed or files give every rank the same NF4 codes and adapters), then
        ZeRO-3 partitions what it holds, the packed NF4 weights in their bf16 storage like any
        bf16 weight. Each `Linear4bit` keeps its weight's quantisation state (absmax, code
        tables: about 1/64 of the codes), whole on every rank, moved to the device its matmuls
        run on; bitsandbytes hands it to the gathered weight, as under FSDP2."""
        import deepspeed

        model = factory.build("cpu")
        model.config.use_cache = False
        deepspeed.zero.Init(module=model, config_dict_or_path=ds_config, remote_device=remote)
        device = self.ctx.device
        for module in model.modules():
            states = (getattr(module, "quant_state", None),
                      getattr(getattr(module, "weight", None), "quant_state", None))  # fmt: skip
            for state in {id(s): s for s in states if s is not None}.values():
                state.to(device)  # in place
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device))
        return model

    def compute_context(self) -> AbstractContextManager:
        return contextlib.nullcontext()  # the engine's forward autocasts (torch_autocast section)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-steps inside are not DeepSpeed's accumulation boundary (set explicitly, so an
        abandoned step or a re-cut batch never leaves its micro-step counter out of phase)."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def backward(self, loss: torch.Tensor) -> None:
        boundary = not self._accumulating
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(
            loss * (self.ctx.world_size * self.engine.gradient_accumulation_steps())
        )
        if not boundary:
            self.engine.step()  # counts the micro-step; no optimizer step before the boundary

    def step(self) -> float:
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def set_micro_batch(self, micro_batch_size: int, grad_accum: int) -> None:
        self.engine.set_train_micro_batch_size(micro_batch_size)
        self.engine.set_train_batch_size(micro_batch_size * grad_accum * self.ctx.world_size)

    def drop_grads(self) -> None:
        """Forget an abandoned step: parameter grads and ZeRO's accumulated partitions."""
        self.engine.zero_grad()
        self.optimizer.zero_grad(set_to_none=True)
        if self.stage < 3:  # (ZeRO-3's zero_grad resets its own counter)
            self.optimizer.micro_step_id = -1  # the next backward starts a fresh accumulation

    def _named_params(self) -> dict[str, nn.Parameter]:
        return trained_params(self.module)

    def _owners(self, params: dict[str, nn.Parameter]) -> list[int]:
        """The rank that keeps each parameter's full tensors in the canonical state.

        Gathering a full tensor is a collective every rank joins, but only its owner keeps it:
        each rank then holds about 1/world of the model's weights and moments (greedy by size)
        instead of all of them, which for a large model would not fit in host memory.
        """
        sizes = [int(getattr(p, "ds_numel", p.numel())) for p in params.values()]
        load = [0] * self.ctx.world_size
        owners = [0] * len(sizes)
        for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
            owners[i] = min(range(len(load)), key=load.__getitem__)
            load[owners[i]] += sizes[i]
        return owners

    def state_dict(self) -> dict[str, Any]:
        """Full fp32 weights and AdamW moments of the parameters this rank owns (`_owners`):
        DCP writes each key once, from its owner."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        model: dict[str, torch.Tensor] = {}
        optim: dict[str, dict[str, torch.Tensor]] = {}
        step = torch.tensor(float(self.engine.global_steps))
        params = self._named_params()
        for (name, p), owner in zip(params.items(), self._owners(params), strict=True):
            weight = safe_get_full_fp32_param(p)  # collectives: every rank joins ...
            moments = {
                key: safe_get_full_optimizer_state(p, key) for key in ("exp_avg", "exp_avg_sq")
            }
            if owner != self.ctx.rank:
                continue  # ... and the owner keeps the result
            model[name] = weight.detach().to("cpu", torch.float32)
            if all(v is not None for v in moments.values()):
                optim[name] = {k: v.detach().to("cpu", torch.float32) for k, v in moments.items()}
                optim[name]["step"] = step
        return {"model": model, "optim": optim, "scaler": {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """`state` holds this rank's owned parameters (`state_dict`'s template); each full
        tensor goes from its owner to every rank, one parameter at a time, and every rank keeps
        its partition."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        ctx = self.ctx
        params = self._named_params()
        owners = self._owners(params)
        # which parameters have moments in the checkpoint (a never-stepped one keeps fresh ones)
        kept = [o == ctx.rank and n in state["optim"] for n, o in zip(params, owners, strict=True)]
        has_moments = all_reduce_sum([float(k) for k in kept], torch.device("cpu"))
        steps = [int(m["step"]) for m in state["optim"].values()]
        num_steps = int(all_reduce_max(max(steps, default=0), torch.device("cpu")))
        for (name, p), owner, moments in zip(params.items(), owners, has_moments, strict=True):
            shape = tuple(getattr(p, "ds_shape", p.shape))
            value = self._from_owner(state["model"].get(name), shape, owner)
            safe_set_full_fp32_param(p, value)  # the optimizer's fp32 master partition
            # ... and the weights forward uses, which DeepSpeed refreshes only at the next step
            gathered = (
                deepspeed.zero.GatheredParameters([p], modifier_rank=owner)
                if self.stage == 3
                else contextlib.nullcontext()
            )
            with gathered, torch.no_grad():
                if self.stage < 3 or ctx.rank == owner:
                    p.data.copy_(value)
            del value
            if moments:
                for key in ("exp_avg", "exp_avg_sq"):
                    mine = state["optim"][name][key] if ctx.rank == owner else None
                    safe_set_full_optimizer_state(p, self._from_owner(mine, shape, owner), key)
        if num_steps:
            self.engine.global_steps = num_steps
            for param_state in self.optimizer.state.values():
                if "step" in param_state:  # a tensor for torch AdamW, an int for CPU Adam
                    old = param_state["step"]
                    param_state["step"] = (
                        torch.full_like(old, num_steps) if torch.is_tensor(old) else num_steps
                    )
            _replay_cpu_adam_steps(self.optimizer.optimizer, num_steps)  # the base optimizer

    def _from_owner(
        self, value: torch.Tensor | None, shape: tuple[int, ...], owner: int
    ) -> torch.Tensor:
        """The owner's full fp32 tensor, on every rank's device (a broadcast)."""
        ctx = self.ctx
        if ctx.rank == owner:
            assert value is not None
            out = value.to(ctx.device, torch.float32).contiguous()
        else:
            out = torch.empty(shape, dtype=torch.float32, device=ctx.device)
        if ctx.world_size > 1:
            torch.distributed.broadcast(out, src=owner)
        return out

    def full_model_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full fp32 weights on rank 0 only (every rank joins each gather, one at a time)."""
        from deepspeed.utils import safe_get_full_fp32_param

        full = {}
        for name, p in self._named_params().items():
            weight = safe_get_full_fp32_param(p)
            if self.ctx.rank == 0:
                full[name] = weight.detach().to("cpu", torch.float32)
        return full if self.ctx.rank == 0 else None

    def memory_stats(self) -> dict[str, int]:
        return device_memory_stats(self.ctx.device)

    def reset_peak(self) -> None:
        reset_device_peak(self.ctx.device)


def _replay_cpu_adam_steps(optimizer: Any, num_steps: int) -> None:
    """Make a resumed CPU Adam bit-identical to one that never stopped.

    DeepSpeed's C++ CPU Adam keeps beta1^t and beta2^t as running float products (one
    multiplication per step) but computes them with pow() when a step does not follow the one
    before, as the first step after a resume does: the bias correction then differs in its last
    bits and the run drifts from the uninterrupted one (~1e-8). Walking the counter through steps
    1..N on empty tensors (nothing is updated) rebuilds the same products.
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if not isinstance(optimizer, DeepSpeedCPUAdam) or not optimizer.param_groups:
        return
    group = optimizer.param_groups[0]  # one C++ optimizer, one counter, for every group
    beta1, beta2 = group["betas"]
    empty = torch.empty(0)
    for step in range(1, num_steps + 1):
        optimizer.ds_opt_adam.adam_update(
            optimizer.opt_id, step, group["lr"], beta1, beta2, group["eps"],
            group["weight_decay"], group["bias_correction"], empty, empty, empty, empty,
        )  # fmt: skip


def _require_async_io() -> None:
    """ZeRO-Infinity swaps through DeepSpeed's async_io op, which builds against libaio: say so in
    one line before DeepSpeed fails on it deep inside its engine."""
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().create_op_builder("AsyncIOBuilder").is_compatible(verbose=False):
        raise ConfigError(
            "strategy",
            "zero3_nvme needs DeepSpeed's async_io op, and libaio (library and headers) is not "
            "installed here",
            "install it (Debian/Ubuntu: apt-get install libaio-dev; RHEL: yum install "
            "libaio-devel), or choose a strategy that offloads to host memory",
        )


STALE_BUILD_LOCK_S = 900  # far longer than DeepSpeed's op builds take (1-5 minutes)
BUILD_LOCK_PROGRESS_S = 30


def _build_locks(root: Path, skip: Collection[str] = ()) -> list[Path]:
    """Each op's build lock, `root/<op>/lock` (or `root/py311_cpu/<op>/lock`), but `skip`'s."""
    locks = [*root.glob("*/lock"), *root.glob("*/*/lock")]
    return [lock for lock in locks if lock.parent.name not in skip]


def _age_s(path: Path) -> float | None:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return None  # gone


def extensions_root() -> Path:
    """Where torch builds DeepSpeed's ops: TORCH_EXTENSIONS_DIR when set (as the op builders
    read it), else torch's default cache dir."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def clear_stale_build_locks(
    root: Path | None = None, max_age_s: float = STALE_BUILD_LOCK_S
) -> None:
    """Remove build locks that a killed process left in torch's extensions dir.

    DeepSpeed JIT-compiles its ops (CPU Adam, shared-memory collectives, async I/O) on first use
    under a lock file that only a finishing build removes: a build interrupted by a signal or a
    timeout leaves it, and every later start waits on it forever, silently
    (`torch.utils.file_baton` has no timeout).
    """
    root = Path(root or extensions_root())
    for lock in _build_locks(root):
        age = _age_s(lock)
        if age is not None and age > max_age_s:
            try:
                lock.unlink()
                log.warning("removed a stale build lock left by a killed build: %s", lock)
            except OSError:
                continue  # gone already, or another process's


def wait_for_build_locks(
    root: Path | None = None,
    max_age_s: float = STALE_BUILD_LOCK_S,
    progress_s: float = BUILD_LOCK_PROGRESS_S,
    skip: Collection[str] = (),
) -> None:
    """Wait, saying so, while a younger build lock exists; remove it once it is `max_age_s` old.
    `skip` names ops (their build dirs) not waited on: ones this process will not load.

    A young lock is a build running in another process, or one a Ctrl-C cut off a moment ago:
    which one cannot be told from the file. So wait with a progress line that names the lock and
    how to clear it, and with a bound: a lock that reaches `max_age_s` is stale and removed.
    """
    root = Path(root or extensions_root())
    clear_stale_build_locks(root, max_age_s)
    start = time.monotonic()
    next_note_s = min(5.0, progress_s)  # a build that is about to end needs no line
    while locks := [lock for lock in _build_locks(root, skip) if lock.exists()]:
        waited_s = time.monotonic() - start
        if waited_s >= next_note_s:
            ages = [a for a in map(_age_s, locks) if a is not None]
            log.warning(
                "waiting for DeepSpeed's op build lock %s (%.0f s old; another process is "
                "building the op, or a killed build left the lock): if no build is running, "
                "remove it (rm %s); it is removed as stale when %.0f s old",
                locks[0],
                max(ages, default=0.0),
                " ".join(map(str, locks)),
                max_age_s,
            )
            next_note_s = waited_s + progress_s
        time.sleep(0.2)
        clear_stale_build_locks(root, max_age_s)
