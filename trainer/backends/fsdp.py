"""`fsdp` and `fsdp_offload`: FSDP2 `fully_shard` per decoder layer, then the root.

torchtitan's order: build on the meta device, apply activation checkpointing, shard each decoder
layer and then the root, materialise only this rank's shards (`to_empty`), then load the initial
weights: pretrained safetensors are read by each rank, its own rows only
(`trainer.model.pretrained`); random init (and weights in other formats) with
`set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`: rank 0 alone builds the
full weights and sends every rank its shard, so no other rank ever holds the full model.
Mixed precision is `MixedPrecisionPolicy(param_dtype=bf16|fp16, reduce_dtype=fp32)` over fp32
sharded parameters (no autocast); `precision: bf16_pure` shards bf16 parameters and gathers and
reduces them in bf16. `train.optimizer_in_backward` steps each shard from its post-accumulate-grad
hook, which FSDP2 calls right after that parameter's reduce-scatter.
`fsdp_offload` keeps parameters, gradients and the AdamW step on the host (`CPUOffloadPolicy`;
pinned memory only with an accelerator). `fsdp.hybrid: true` shards within a node and
replicates across nodes (HSDP on a 2-D device mesh).

The canonical state is the sharded DTensors themselves, keyed by parameter name: DCP writes each
rank's shard and reshards on load, for any strategy and world size.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)

from trainer.backends import BackendContext, ModelFactory, OptimizerSpec, common
from trainer.core import strategies
from trainer.core.parallel_dims import ParallelDims
from trainer.model.build import decoder_layers
from trainer.model.materialise import materialise, rebuild_buffers
from trainer.model.pretrained import canonical_name, report_load
from trainer.model.qlora_load import TensorSource, fill_4bit_shards, tensor_source
from trainer.optim import load_sharded_8bit_state, sharded_8bit_state
from trainer.parallel.expert import shard_experts
from trainer.parallel.mesh import ParallelMesh, hybrid_shard_mesh
from trainer.parallel.parallelize import parallelize

log = logging.getLogger(__name__)


class FsdpBackend:
    def __init__(self, strategy: str, ctx: BackendContext):
        self.name = strategy
        self.ctx = ctx
        self.offload = strategies.row(strategy).offloads
        self.scaler = _sharded_scaler(ctx)

    def setup(self, factory: ModelFactory, optim: OptimizerSpec) -> nn.Module:
        ctx = self.ctx
        home = torch.device("cpu") if self.offload else ctx.device
        quantized = getattr(factory, "quantizes", False)
        built: dict[str, TensorSource | None] = {"source": None}

        def build() -> nn.Module:
            if not quantized:
                return factory.build("meta")
            model, built["source"] = _build_qlora(factory, home, ctx.rank)
            return model

        def wrap(model: nn.Module) -> nn.Module:
            apply_fsdp(
                model,
                precision=ctx.precision,
                reshard_after_forward=ctx.cfg.fsdp.reshard_after_forward,
                offload=self.offload,
                pin_memory=ctx.device.type == "cuda",
                mesh=_hybrid_mesh(ctx) if ctx.cfg.fsdp.hybrid else _token_mesh(ctx),
                experts=ctx.mesh if ctx.mesh is not None and ctx.mesh.expert > 1 else None,
            )
            return model

        model = parallelize(build, factory.hf_config, common.model_changes(ctx), wrap)
        source = built["source"]
        if source is not None:
            self._quantise_into_shards(model, factory, source, home)
        elif not quantized:
            materialise(model, factory, ctx, home, "FSDP shards")
        self.model = model
        # on the shards' device
        self.optimizer = common.build_adamw(model.parameters(), optim, ctx.grad_accum)
        self.grad_clip = optim.grad_clip
        return model

    def _quantise_into_shards(
        self, model: nn.Module, factory: ModelFactory, source: TensorSource, home: torch.device
    ) -> None:
        """This rank's shards of a 4-bit skeleton, quantised one tensor at a time."""
        ctx = self.ctx
        model.to_empty(device=home)
        rebuild_buffers(model, home)
        stats = fill_4bit_shards(model, source, ctx.device, ctx.cfg.train.seed)
        if factory.inner.model_cfg.name_or_path is not None:
            report_load(stats, ctx.rank, Path(ctx.cfg.run.dir), "4-bit shard")
        elif ctx.rank == 0:
            log.info(
                "random init: each rank quantised its 4-bit shard (rank 0: %.1f MiB in %.1f s)",
                stats.held_bytes / 2**20,
                stats.seconds,
            )

    def compute_context(self) -> AbstractContextManager:
        return contextlib.nullcontext()  # the mixed-precision policy casts

    def no_sync(self) -> AbstractContextManager:
        sharded_accumulation = self.ctx.cfg.fsdp.reduce_every_micro_batch is True
        return gradient_sync(self.model, enabled=sharded_accumulation)

    def backward(self, loss: torch.Tensor) -> None:
        loss = loss * _token_ranks(self.ctx)  # FSDP averages gradients over the ranks it shards
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self) -> float:
        norm = common.clip_and_step(
            self.model.parameters(), self.optimizer, self.scaler, self.grad_clip
        )
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def set_lr(self, lr: float) -> None:
        common.set_lr(self.optimizer, lr)

    def set_micro_batch(self, micro_batch_size: int, grad_accum: int) -> None:
        # reduce-scatter averages over ranks only; the cut of the rank's batch is free
        common.refuse_accumulation(self.optimizer, grad_accum)

    def drop_grads(self) -> None:
        common.drop_grads(self.optimizer)
        self.model.set_requires_gradient_sync(True)

    def _named_params(self) -> dict[str, nn.Parameter]:
        """The sharded parameters, which the optimizer holds. The root and the head keep their
        parameters unsharded after a forward (reshard_after_forward=False); after an eval
        forward, which no backward follows, they would be other tensors than the optimizer's."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return common.trained_params(self.model)

    def state_dict(self) -> dict[str, Any]:
        """Sharded: DTensor parameters and AdamW moments (fp32; bf16 under bf16_pure; under
        adamw_8bit the form every rung shares, trainer/optim.py); DCP writes each rank's shard."""
        params = self._named_params()
        optim: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in params.items():
            eight = sharded_8bit_state(self.optimizer, p)
            if eight is not None:
                optim[name] = eight
                continue
            state = self.optimizer.state.get(p)
            if state:
                optim[name] = {
                    "exp_avg": state["exp_avg"],
                    "exp_avg_sq": state["exp_avg_sq"],
                    "step": torch.as_tensor(float(state["step"]), dtype=torch.float32),
                }
        return {
            "model": {n: p.detach() for n, p in params.items()},
            "optim": optim,
            "scaler": self.scaler.state_dict() if self.scaler else {},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        params = self._named_params()
        with torch.no_grad():
            for name, p in params.items():
                src = state["model"][name]
                if src is not p.detach():
                    p.copy_(src)
        optim = dict(state["optim"])
        for name, p in params.items():
            if name in optim and sharded_8bit_state(self.optimizer, p) is not None:
                load_sharded_8bit_state(self.optimizer, p, optim.pop(name))
        common.load_canonical_optim_state(self.optimizer, params, optim)
        if state.get("scaler") and self.scaler:
            self.scaler.load_state_dict(state["scaler"])

    def full_model_state_dict(self) -> dict[str, torch.Tensor] | None:
        full = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.ctx.rank != 0:
            return None
        return {canonical_name(k): v for k, v in full.items()}

    def memory_stats(self) -> dict[str, int]:
        return common.device_memory_stats(self.ctx.device)

    def reset_peak(self) -> None:
        common.reset_device_peak(self.ctx.device)


def apply_fsdp(
    model: nn.Module,
    *,
    precision: str,
    reshard_after_forward: bool,
    offload: bool = False,
    pin_memory: bool = False,
    mesh: Any = None,
    experts: ParallelMesh | None = None,
) -> None:
    """FSDP2 on a (meta-device) model, in place: `fully_shard` each decoder layer, then the root
    (under an expert split, each layer's experts first, over their copies: `experts`);
    16-bit parameters for compute and fp32 gradient reduction under mixed precision (bf16 both
    under bf16_pure, whose parameters are bf16); with
    `offload`, parameters, gradients and AdamW on the host (CPUOffloadPolicy). The backend and
    the estimator's trace (launcher/estimate/trace.py) both call this, so they cannot drift
    apart."""
    options: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    dtype = common.COMPUTE_DTYPES.get(precision)
    if dtype is not None:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    elif precision == "bf16_pure":  # the parameters are bf16: gathered and reduced as they are
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16
        )
    if offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=pin_memory)
    if mesh is not None:
        options["mesh"] = mesh
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    untied = embedding is not None and head is not None and head.weight is not embedding.weight
    if untied:  # the embedding is resharded after its forward and gathered again for its backward
        fully_shard(embedding, **options)
    if experts is not None:
        shard_experts(model, experts.expert_data_mesh, experts.dims.token_ranks, options)
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    # The head (and the root's norm; a tied embedding too) is needed again as soon as backward
    # starts: kept unsharded from its forward into backward, as the estimate counts it. The head
    # is a group of its own, gathered when it computes and resharded after its backward
    # (torchtitan's layout); resharding it after forward would cost one more all-gather.
    if untied:
        fully_shard(head, **{**options, "reshard_after_forward": False})
    fully_shard(model, **{**options, "reshard_after_forward": False})


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """FSDP2's no-sync: with `enabled` False, backward accumulates unsharded gradients and
    reduce-scatters nothing until a backward outside this context."""
    if enabled:
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _hybrid_mesh(ctx: BackendContext) -> Any:
    """HSDP: shard within a node, replicate across nodes (trainer/parallel/mesh.py)."""
    dims = ctx.mesh.dims if ctx.mesh is not None else ParallelDims(ctx.world_size)
    return hybrid_shard_mesh(dims, ctx.cfg.hardware.devices_per_node or 1, ctx.device.type)


def _token_mesh(ctx: BackendContext) -> Any:
    """Beside a tensor split, FSDP shards over the ranks holding other tokens (None: the
    world)."""
    return ctx.mesh.token_mesh if ctx.mesh is not None else None


def _token_ranks(ctx: BackendContext) -> int:
    return ctx.mesh.dims.token_ranks if ctx.mesh is not None else ctx.world_size


def _sharded_scaler(ctx: BackendContext) -> Any:
    """fp16 needs a loss scaler that works on sharded (DTensor) gradients."""
    if ctx.precision != "fp16":
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(ctx.device.type)


def _build_qlora(
    factory: ModelFactory, home: torch.device, rank: int
) -> tuple[nn.Module, TensorSource | None]:
    """QLoRA's model before sharding, and where its rank's rows come from: the 4-bit layout on
    the meta device (the packed weights in bf16 storage, which FSDP2 shards like any bf16
    tensor), each rank later quantising into its own rows (trainer/model/qlora_load.py); a
    checkpoint not read that way is built and quantised whole by every rank (no source), then
    sharded."""
    skeleton = factory.build_4bit_skeleton()
    source = tensor_source(skeleton, factory)
    if source is not None:
        return skeleton, source
    if rank == 0:
        log.info(
            "model.name_or_path: %s has no safetensors tensor for every weight: each rank "
            "quantises the whole base, then keeps its shard",
            factory.inner.model_cfg.name_or_path,
        )
    return factory.build(home), None
