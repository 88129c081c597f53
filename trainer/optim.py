"""The optimizer of a run: AdamW in the form the config asks for (docs/finetune.md).

- `train.optimizer: adamw`: torch's fused AdamW over fp32 master weights (fp32 moments).
- `train.optimizer: adamw_8bit`: bitsandbytes' AdamW8bit (8-bit moments in blocks of 256 with an
  fp32 scale each; tensors under 4096 elements keep fp32 moments, bitsandbytes' rule).
- `train.optimizer: paged_adamw_8bit`: the same, its states paged (CUDA managed memory, moved to
  the host when the device runs short); on CPU processes it runs as adamw_8bit.
- `precision: bf16_pure`: torchao's `_AdamW(bf16_stochastic_round=True)` over bf16 weights: the
  moments are bf16 like the weights, the update is computed in fp32 and rounded into the bf16
  weight stochastically (rounded up with the probability of the dropped low bits), so small
  updates are not all lost to bf16's 8-bit mantissa as they would be by round-to-nearest.
- `train.optimizer_in_backward: true`: `OptimizerInBackward` steps each parameter from its
  post-accumulate-grad hook, as soon as its gradient is final, and frees the gradient: no full
  set of gradients ever exists. With one micro-batch per step and no global norm clipping (the
  config refuses the rest) it is the ordinary step, parameter by parameter.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from trainer.core.config import ConfigError
from trainer.core.methods import EIGHT_BIT_OPTIMIZERS
from trainer.core.step_spec import OptimizerSpec
from trainer.model.finetune import require
from trainer.runtime.dist import all_reduce_sum
from trainer.runtime.oom import OutOfMemoryInStep

log = logging.getLogger(__name__)


def build_optimizer(params: list[nn.Parameter], spec: OptimizerSpec, grad_accum: int = 1) -> Any:
    """The optimizer over the parameters that train (`requires_grad`; a LoRA base is frozen).
    The 8-bit state is created here, before any step, so a checkpoint can be loaded into it."""
    trainable = [p for p in params if p.requires_grad]
    if spec.in_backward:
        if grad_accum > 1:  # the config refuses what it can see; the plan may add accumulation
            raise ConfigError(
                "train.optimizer_in_backward",
                f"needs one micro-batch per step, but this run accumulates {grad_accum}",
                "set train.micro_batch_size to the per-rank batch, or "
                "train.optimizer_in_backward=false",
            )
        return OptimizerInBackward(trainable, lambda group: _build_adamw(group, spec))
    return _build_adamw(trainable, spec)


def _build_adamw(params: list[nn.Parameter], spec: OptimizerSpec) -> torch.optim.Optimizer:
    kwargs = dict(lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
    if spec.name in EIGHT_BIT_OPTIMIZERS:
        kwargs["is_paged"] = paged(spec.name, params)
    if spec.name in EIGHT_BIT_OPTIMIZERS and any(hasattr(p, "placements") for p in params):
        return ShardedAdamW8bit(params, kwargs, spec.bf16_pure)
    if spec.name in EIGHT_BIT_OPTIMIZERS:
        bnb = require("bitsandbytes", "train.optimizer", spec.name)
        optimizer = bnb.optim.AdamW8bit(params, **kwargs)
        _prepare_8bit(optimizer, spec.bf16_pure)
        return optimizer
    if spec.bf16_pure:
        return import_torchao_optim()._AdamW(params, bf16_stochastic_round=True, **kwargs)
    return torch.optim.AdamW(_one_group_per_mesh(params), fused=True, **kwargs)


def _one_group_per_mesh(params: list[nn.Parameter]) -> list[dict[str, Any]]:
    """One parameter group per mesh (plain tensors, a tensor split's DTensors, FSDP's over
    them): the fused kernel takes one kind at a time; the math is the same per element."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
    return [{"params": group} for group in groups.values()]


def paged(name: str, params: list[nn.Parameter]) -> bool:
    """`paged_adamw_8bit` on CUDA: bitsandbytes keeps the states in managed memory, which the
    driver moves to the host when the device runs short. CPU processes have nothing to page
    from: there it runs as adamw_8bit (the same math; the start line says so)."""
    return name == "paged_adamw_8bit" and any(p.is_cuda for p in params)


def _prepare_8bit(optimizer: Any, bf16_pure: bool) -> None:
    """Create a bitsandbytes optimizer's state now (so a checkpoint can be loaded into it);
    under bf16_pure, step its bf16 weights with stochastic rounding (`stochastic_update_step`)."""
    for gindex, group in enumerate(optimizer.param_groups):
        for pindex, p in enumerate(group["params"]):
            optimizer.init_state(group, p, gindex, pindex)
    if bf16_pure:
        optimizer.update_step = functools.partial(stochastic_update_step, optimizer)


# values of one tensor stepped at a time in fp32 under bf16_pure: a whole number of 8-bit blocks,
# 12 MiB of temporaries (weight, gradient, random bits)
SR_CHUNK = 1 << 20


@torch.no_grad()
def stochastic_update_step(optimizer: Any, group: dict, p: torch.Tensor, gindex: int,
                           pindex: int) -> None:  # fmt: skip
    """bitsandbytes' AdamW step of one bf16 weight (precision: bf16_pure), in place of its own
    `update_step`: the same kernel on an fp32 copy of a chunk of the weight and its gradient, the
    result rounded into bf16 stochastically (up with the probability of the dropped low bits),
    as torchao's AdamW does under bf16_pure. bitsandbytes would round to nearest, so an update
    under half a bf16 step of the weight would be lost every time."""
    F = require("bitsandbytes", "train.optimizer", "adamw_8bit").functional
    state = optimizer.state[p]
    config = optimizer.get_config(gindex, pindex, group)
    state["step"] += 1
    beta1, beta2 = config["betas"][0], config["betas"][1]
    weights, grads = p.data.view(-1), p.grad.reshape(-1)
    moment1, moment2 = state["state1"].view(-1), state["state2"].view(-1)
    eight = state["state1"].dtype == torch.uint8
    for start in range(0, weights.numel(), SR_CHUNK):
        end = min(start + SR_CHUNK, weights.numel())
        p32, g32 = weights[start:end].float(), grads[start:end].float()
        if eight:
            blocks = slice(start // BLOCK, -(-end // BLOCK))
            F.optimizer_update_8bit_blockwise(
                optimizer.optimizer_name, g32, p32, moment1[start:end], moment2[start:end],
                beta1, beta2, 0.0, 0.0, config["eps"], state["step"], config["lr"],
                state["qmap1"], state["qmap2"], state["absmax1"][blocks],
                state["absmax2"][blocks], config["weight_decay"],
            )  # fmt: skip
        else:
            F.optimizer_update_32bit(
                optimizer.optimizer_name, g32, p32, moment1[start:end], beta1, config["eps"],
                state["step"], config["lr"], moment2[start:end], beta2,
                weight_decay=config["weight_decay"],
            )  # fmt: skip
        weights[start:end].copy_(stochastic_round_bf16(p32))


def stochastic_round_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, rounded away from zero with the probability of the 16 dropped bits."""
    bits = x.view(torch.int32)
    toward_zero = bits & -65536  # 0xFFFF0000: the bf16 bits of the fp32 pattern
    dropped = bits & 0xFFFF
    draw = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=x.device)
    rounded = torch.where(draw < dropped, toward_zero + 0x10000, toward_zero)
    return rounded.view(torch.float32).to(torch.bfloat16)


def import_torchao_optim() -> Any:
    """torchao.optim (its import-time log lines are quieted in trainer.model.finetune)."""
    require("torchao", "precision", "bf16_pure")
    return require("torchao.optim", "precision", "bf16_pure")


def set_lr(optimizer: Any, lr: float) -> None:
    """Set every group's learning rate (torchao keeps it as a tensor, filled in place)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


class OptimizerInBackward:
    """One optimizer per parameter, stepped from the parameter's post-accumulate-grad hook; the
    gradient is freed right after. Under FSDP2 the hook runs on the reduce-scattered shard.

    Looks like one optimizer to the rest of the engine: `param_groups` (the learning rate),
    `state` (the checkpoint) and `zero_grad`; `step()` does nothing, `finish_step()` returns the
    step's gradient norm, summed from the squares each hook saw.
    """

    def __init__(self, params: list[nn.Parameter], build: Callable[[list], Any]):
        self.optimizers = {p: build([p]) for p in params}
        self.param_groups = [g for o in self.optimizers.values() for g in o.param_groups]
        self.state = _StateView(self.optimizers)
        self._squares: list[torch.Tensor] = []
        self._sharded = False
        for p in params:
            p.register_post_accumulate_grad_hook(self._step_param)

    @torch.no_grad()
    def _step_param(self, p: nn.Parameter) -> None:
        grad = p.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        square = local.float().square().sum()
        if hasattr(grad, "placements"):  # a shard: replicated dims would count it twice
            self._sharded = True
            for dim, placement in enumerate(grad.placements):
                if placement.is_replicate():
                    square /= grad.device_mesh.size(dim)
        self._squares.append(square)
        self.optimizers[p].step()
        p.grad = None

    @property
    def num_stepped(self) -> int:
        """Parameters stepped since the last `finish_step`."""
        return len(self._squares)

    def finish_step(self) -> float:
        """The step's gradient norm (over all ranks for shards); starts the next step."""
        total = float(torch.stack(self._squares).sum()) if self._squares else 0.0
        if self._sharded:
            (total,) = all_reduce_sum([total], torch.device("cpu"))
        self._squares = []
        return total**0.5

    def step(self) -> None:
        pass  # each parameter was stepped in backward

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.optimizers:
            p.grad = None

    def abandon_step(self, why: str) -> None:
        """An out-of-memory the engine would retry in process: exact only before any parameter
        was stepped and with one micro-batch; else exit 75 and resume from the checkpoint on
        the next rung."""
        if self.num_stepped:
            raise OutOfMemoryInStep(
                torch.OutOfMemoryError(f"{why}; {self.num_stepped} parameters already stepped")
            )
        self._squares = []


class _StateView(MutableMapping):
    """`optimizer.state` over the per-parameter optimizers, keyed by parameter."""

    def __init__(self, optimizers: dict[nn.Parameter, Any]):
        self.optimizers = optimizers

    def __getitem__(self, p: nn.Parameter) -> Any:
        if p not in self.optimizers or p not in self.optimizers[p].state:
            raise KeyError(p)
        return self.optimizers[p].state[p]

    def __setitem__(self, p: nn.Parameter, value: Any) -> None:
        self.optimizers[p].state[p] = value

    def __delitem__(self, p: nn.Parameter) -> None:
        del self.optimizers[p].state[p]

    def __iter__(self) -> Iterator[nn.Parameter]:
        return (p for p, o in self.optimizers.items() if p in o.state)

    def __len__(self) -> int:
        return sum(1 for _ in self)


# bitsandbytes' rule: tensors under 4096 elements keep fp32 moments; 8-bit ones are quantised in
# blocks of 256 consecutive elements, each with an fp32 absmax
MIN_8BIT_NUMEL = 4096
BLOCK = 256


def shards_in_8bit(p: torch.Tensor) -> bool:
    """Whether a sharded (FSDP2, dim-0) parameter gets 8-bit moments: 4096+ elements in all, and
    rows that hold whole blocks of 256, so each rank's blocks are the blocks of the whole tensor
    (the same numbers as on one replica, and a checkpoint reshards block by block)."""
    return p.numel() >= MIN_8BIT_NUMEL and p.dim() == 2 and p.shape[1] % BLOCK == 0


# How a checkpoint holds bitsandbytes' AdamW state: what each moment means, in one of two forms,
# and any rung and world size loads either (trainer/checkpoint/checkpointer.py converts):
# - 8-bit codes `state1`/`state2` with their fp32 block scales `absmax1`/`absmax2`, blocks of 256
#   over the flattened tensor ([blocks]); for a matrix whose rows hold whole blocks those are its
#   rows' blocks, kept by rows ([rows, cols / 256]) so FSDP2 shards them. A replica writes codes;
#   so does an FSDP shard of such a matrix. A loader that keeps the same blocks copies them, bit
#   for bit;
# - fp32 moments `exp_avg`/`exp_avg_sq`, as torch's AdamW names them: tensors under 4096 values,
#   and what an FSDP shard keeps of a matrix whose rows do not hold whole blocks. A loader that
#   keeps codes quantises them into its blocks; a shard that keeps fp32 moments is given a
#   replica's codes dequantised.
FP32_MOMENTS = ("exp_avg", "exp_avg_sq")
CODES = ("state1", "state2")
SCALES = ("absmax1", "absmax2")
# per moment: its fp32 name, bitsandbytes' codes, block scales and quantisation map (signed for
# the first moment, unsigned for the second)
MOMENTS = (("exp_avg", "state1", "absmax1", "qmap1"), ("exp_avg_sq", "state2", "absmax2", "qmap2"))


def canonical_8bit_moments(p: torch.Tensor, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The moments of `p` from its bitsandbytes `state` (one replica's, whole tensors) in the
    checkpoint's form (above)."""
    if state["state1"].dtype != torch.uint8:  # under 4096 values: bitsandbytes' fp32 moments
        return {moment: state[code] for moment, code, _, _ in MOMENTS}
    out = {key: state[key] for key in CODES}
    if shards_in_8bit(p):  # block scales by rows, where the rows hold whole blocks
        return out | {key: state[key].view(p.shape[0], -1) for key in SCALES}
    return out | {key: state[key] for key in SCALES}


def fp32_moments(shape: torch.Size, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fp32 moments of a tensor of `shape` from whole saved codes and block scales (also
    from a checkpoint written before the form above, whose small tensors kept fp32 moments as
    `state1`/`state2`)."""
    if saved["state1"].dtype != torch.uint8:
        return {moment: saved[code].view(shape) for moment, code, _, _ in MOMENTS}
    F = require("bitsandbytes", "train.optimizer", "adamw_8bit").functional
    signed, unsigned = F.create_dynamic_map(signed=True), F.create_dynamic_map(signed=False)
    qmaps = {"qmap1": signed, "qmap2": unsigned}
    return {
        moment: F.dequantize_blockwise(
            saved[code].flatten(), absmax=saved[scale].flatten(), code=qmaps[qmap], blocksize=BLOCK
        ).view(shape)
        for moment, code, scale, qmap in MOMENTS
    }


@torch.no_grad()
def load_8bit_moments(live: dict[str, Any], saved: dict[str, torch.Tensor]) -> None:
    """Fill bitsandbytes' `live` state (created at setup, on a replica or a shard's rows) from
    canonical moments: codes are copied, fp32 moments copied or quantised into the blocks the
    live state keeps."""
    if "state1" in saved:  # a block-aligned matrix: the same blocks on every rung
        for key in (*CODES, *SCALES):
            live[key].copy_(saved[key].reshape(live[key].shape))
        return
    F = require("bitsandbytes", "train.optimizer", "adamw_8bit").functional
    for moment, code, scale, qmap in MOMENTS:
        values = saved[moment].reshape(-1).to(live[code].device, torch.float32)
        if live[code].dtype != torch.uint8:  # fp32 moments on this rung
            live[code].copy_(values.view(live[code].shape))
            continue
        codes, quant = F.quantize_blockwise(values, code=live[qmap], blocksize=BLOCK)
        live[code].copy_(codes.view(live[code].shape))
        live[scale].copy_(quant.absmax.view(live[scale].shape))


class ShardedAdamW8bit:
    """bitsandbytes' AdamW8bit on FSDP2's DTensor shards: its step runs on each rank's local
    rows (a plain tensor sharing the shard's storage), the moments and block scales live with
    the shard. As on a replica, tensors under 4096 elements keep fp32 moments (bitsandbytes'
    32-bit AdamW); so do tensors whose rows do not hold whole blocks of 256.

    The moments are per shard: `sharded_state` gives them to the checkpoint in its canonical
    form (above) as DTensors laid out like the parameter (codes, fp32 moments) and like its rows
    (block scales, [rows, cols / 256]), the form a replica writes too: DCP writes each rank's
    part and reshards it for another rung or world size.
    """

    def __init__(self, params: list[nn.Parameter], kwargs: dict[str, Any], bf16_pure: bool):
        bnb = require("bitsandbytes", "train.optimizer", "adamw_8bit")
        paged = kwargs.pop("is_paged", False)
        self.proxies = {}
        for p in params:
            local = p.to_local()
            if local.numel():  # a rank with no rows of a short tensor has nothing to step
                assert local.is_contiguous(), "FSDP2 dim-0 shards are contiguous"
                self.proxies[p] = nn.Parameter(local, requires_grad=False)
        eight = [proxy for p, proxy in self.proxies.items() if shards_in_8bit(p)]
        rest = [proxy for p, proxy in self.proxies.items() if not shards_in_8bit(p)]
        self.optimizers = [
            bnb.optim.AdamW8bit(eight or [_empty()], min_8bit_size=0, is_paged=paged, **kwargs),
            bnb.optim.AdamW(rest or [_empty()], optim_bits=32, is_paged=paged, **kwargs),
        ]
        for optimizer in self.optimizers:
            _prepare_8bit(optimizer, bf16_pure)
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]
        self.state = _ShardedState(self)

    @torch.no_grad()
    def step(self) -> None:
        for p, proxy in self.proxies.items():
            proxy.grad = None if p.grad is None else p.grad.to_local()
        for optimizer in self.optimizers:
            optimizer.step()
        for proxy in self.proxies.values():
            proxy.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.proxies:
            p.grad = None

    def sharded_state(self, p: nn.Parameter) -> dict[str, Any]:
        """The state of `p` as DTensors sharing the live tensors (DCP fills them in place on
        load)."""
        live = self.state[p] if p in self.proxies else _empty_state(p)
        out: dict[str, Any] = {"step": torch.as_tensor(float(live["step"]))}
        names = CODES if shards_in_8bit(p) else FP32_MOMENTS  # the checkpoint's form (above)
        for name, key in zip(names, CODES, strict=True):
            local = live[key].view(p.to_local().shape)
            out[name] = DTensor.from_local(
                local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
        if shards_in_8bit(p):
            rows, cols = p.shape
            for key in SCALES:
                out[key] = DTensor.from_local(
                    live[key].view(-1, cols // BLOCK),
                    p.device_mesh,
                    p.placements,
                    shape=(rows, cols // BLOCK),
                    stride=(cols // BLOCK, 1),
                )
        return out


def _empty() -> nn.Parameter:
    return nn.Parameter(torch.zeros(0), requires_grad=False)  # bitsandbytes wants one


def _empty_state(p: nn.Parameter) -> dict[str, Any]:
    """The state of a rank that holds no rows of `p`: empty local tensors."""
    dtype = torch.uint8 if shards_in_8bit(p) else torch.float32
    local = torch.zeros(p.to_local().shape, dtype=dtype, device=p.device)
    absmax = torch.zeros(0, dtype=torch.float32, device=p.device)
    return {"step": 0, "state1": local, "state2": local.clone(), "absmax1": absmax,
            "absmax2": absmax.clone()}  # fmt: skip


class _ShardedState(MutableMapping):
    """`optimizer.state` of `ShardedAdamW8bit`, keyed by the DTensor parameter."""

    def __init__(self, opt: ShardedAdamW8bit):
        self.opt = opt

    def _where(self, p: nn.Parameter) -> tuple[dict, nn.Parameter]:
        proxy = self.opt.proxies[p]
        return next(o.state for o in self.opt.optimizers if proxy in o.state), proxy

    def __getitem__(self, p: nn.Parameter) -> Any:
        if p not in self.opt.proxies:
            raise KeyError(p)
        state, proxy = self._where(p)
        return state[proxy]

    def __setitem__(self, p: nn.Parameter, value: Any) -> None:
        state, proxy = self._where(p)
        state[proxy] = value

    def __delitem__(self, p: nn.Parameter) -> None:
        state, proxy = self._where(p)
        del state[proxy]

    def __iter__(self) -> Iterator[nn.Parameter]:
        return iter(self.opt.proxies)

    def __len__(self) -> int:
        return len(self.opt.proxies)


def sharded_8bit_state(optimizer: Any, p: nn.Parameter) -> dict[str, Any] | None:
    """`ShardedAdamW8bit.sharded_state` of `p` (also inside `OptimizerInBackward`); None where
    `p` has no 8-bit shard state."""
    if isinstance(optimizer, OptimizerInBackward):
        optimizer = optimizer.optimizers.get(p)
    if not isinstance(optimizer, ShardedAdamW8bit):
        return None
    return optimizer.sharded_state(p)


def load_sharded_8bit_state(optimizer: Any, p: nn.Parameter, saved: dict[str, Any]) -> None:
    """Load `p`'s shard state from a checkpoint's (DCP usually filled it in place already)."""
    live = sharded_8bit_state(optimizer, p)
    assert live is not None
    with torch.no_grad():
        for key, dst in live.items():
            if key == "step":
                continue
            src = saved[key]
            if not hasattr(src, "to_local"):  # a whole tensor (a legacy checkpoint's, converted)
                src = distribute_tensor(src, dst.device_mesh, dst.placements, src_data_rank=None)
            src = src.to_local()
            dst = dst.to_local()
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src.reshape(dst.shape))
    inner = optimizer.optimizers[p] if isinstance(optimizer, OptimizerInBackward) else optimizer
    if p in inner.proxies:
        inner.state[p]["step"] = int(saved["step"])
