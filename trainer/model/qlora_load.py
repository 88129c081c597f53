"""QLoRA on FSDP2, loaded per rank: each rank quantises the base one tensor at a time and keeps
only its own rows (docs/finetune.md, "QLoRA on the sharded rungs").

The FSDP backend builds the QLoRA model on the meta device in its 4-bit layout
(`FinetuneFactory.build_4bit_skeleton`: every linear of the decoder blocks a bitsandbytes
`Linear4bit` whose weight has the shape of its packed NF4 storage), shards it and materialises
only this rank's rows (`to_empty`). `fill_4bit_shards` then walks the tensors in model order:
- a block linear's weight: read in chunks of rows (the 16-bit dtype the replica rungs load it
  in), each chunk quantised on the compute device as bitsandbytes quantises the whole weight
  (NF4 blocks of 64 are independent; the second-level quantisation of their scales runs once
  over all of them, as in `bitsandbytes.functional.quantize_4bit`), and only this rank's rows of
  the packed storage kept; the module keeps the weight's whole quantisation state (about 1/60 of
  the 4-bit bytes);
- any other tensor of the base (embeddings, norms, head, biases): only this rank's rows are read,
  in bf16;
- a LoRA adapter: its seeded initial value (`trainer.model.finetune.initial_adapter`).
So beyond its shard a rank holds one chunk in flight and one weight's block scales; freed memory
is handed back to the OS after each weight (`release_freed_memory`), so the host's resident set
tracks what the rank keeps.

The tensors come from the pretrained safetensors files (`trainer.model.pretrained`), or for random
init from the seeded fp32 model every rank builds, as the replica rungs do (the same numbers they
quantise). A checkpoint that does not map onto the model (.bin files, renamed keys) returns no
source: the backend then builds the whole base on every rank and shards it once quantised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from trainer.model.finetune import QLORA_COMPUTE_DTYPE, initial_adapter
from trainer.model.pretrained import (
    LoadStats,
    SafetensorsCheckpoint,
    canonical_name,
    local_rows,
    measured,
    release_freed_memory,
    state_tensors,
)

_PEFT_PREFIX = "base_model.model."  # what peft puts before the HF model's names


class TensorSource(Protocol):
    """Where the base's initial tensors come from, by their name in the HF model: `out`'s
    elements from flat index `start` on, and the dtype a weight is quantised from."""

    dtype: torch.dtype
    read_bytes: int

    def rows(self, name: str, out: torch.Tensor, start: int) -> None: ...


class _Checkpoint:
    """Pretrained safetensors; weights are quantised from the 16-bit dtype the replica rungs
    load them in."""

    dtype = QLORA_COMPUTE_DTYPE

    def __init__(self, ckpt: SafetensorsCheckpoint, keys: dict[str, str]):
        self.ckpt, self.keys, self.read_bytes = ckpt, keys, 0

    def rows(self, name: str, out: torch.Tensor, start: int) -> None:
        if out.numel():
            self.read_bytes += self.ckpt.read(self.keys[name], out, start)


class _RandomInit:
    """The seeded fp32 init of the whole model (`HFModelFactory.initial_state_dict`), which the
    replica rungs quantise as it is."""

    dtype = torch.float32

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state, self.read_bytes = state, 0

    def rows(self, name: str, out: torch.Tensor, start: int) -> None:
        flat = self.state[name].reshape(-1)[start : start + out.numel()]
        with torch.no_grad():
            out.copy_(flat.view(out.shape))


def base_name(name: str) -> str:
    """A parameter's name in the plain HF model: without wrappers' and peft's prefixes."""
    return canonical_name(name).removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")


@dataclass(frozen=True)
class _Slot:
    name: str  # in the HF model; a LoRA tensor keeps its peft name
    tensor: torch.Tensor  # the (sharded) parameter or persistent buffer
    shape: tuple[int, ...]  # the whole tensor's, unquantised
    linear: nn.Module | None  # the Linear4bit whose weight this is


def _slots(model: nn.Module) -> list[_Slot]:
    linears = {id(m.weight): m for m in model.modules() if type(m).__name__.endswith("Linear4bit")}
    slots = []
    for name, tensor in state_tensors(model):
        linear = linears.get(id(tensor))
        if ".lora_" in name:
            slots.append(_Slot(canonical_name(name), tensor, tuple(tensor.shape), None))
            continue
        shape = (linear.out_features, linear.in_features) if linear else tuple(tensor.shape)
        slots.append(_Slot(base_name(name), tensor, shape, linear))
    return slots


def tensor_source(skeleton: nn.Module, factory: Any) -> TensorSource | None:
    """The source of `skeleton`'s base tensors (`FinetuneFactory.build_4bit_skeleton`): the
    pretrained checkpoint where every tensor maps onto one of the same shape, the random init
    without `model.name_or_path`; None where the checkpoint cannot be read this way."""
    inner = factory.inner
    if any(slot.linear and math.prod(slot.shape) % _CODES for slot in _slots(skeleton)):
        return None  # a packed row would straddle two chunks' codes
    if inner.model_cfg.name_or_path is None:
        return _RandomInit(inner.initial_state_dict())
    ckpt = inner.pretrained_checkpoint()
    if ckpt is None:
        return None
    prefix = getattr(skeleton, "base_model_prefix", "") or "model"
    keys = {}
    for slot in _slots(skeleton):
        if ".lora_" in slot.name:
            continue
        candidates = [slot.name, slot.name.removeprefix(f"{prefix}."), f"{prefix}.{slot.name}"]
        key = next((k for k in candidates if k in ckpt.entries), None)
        if key is None or ckpt.entries[key].shape != slot.shape:
            return None
        keys[slot.name] = key
    return _Checkpoint(ckpt, keys)


def fill_4bit_shards(
    model: nn.Module, source: TensorSource, device: torch.device, seed: int
) -> LoadStats:
    """Fill this rank's shards of a sharded, materialised 4-bit skeleton from `source`, one
    tensor at a time (the module docstring); returns what it read and held."""
    stats = LoadStats()
    slots = _slots(model)
    with measured(stats), torch.no_grad():
        for slot in slots:
            part = local_rows(slot.tensor)
            if part is None:
                raise RuntimeError(f"{slot.name}: not sharded by rows, as fully_shard does")
            local, start = part
            if slot.linear is not None:
                slot.linear.quant_state = _quantize_rows(source, slot, local, start, device)
                stats.held_bytes += _state_bytes(slot.linear.quant_state)
                release_freed_memory()
            elif ".lora_" in slot.name:
                full = initial_adapter(slot.name, torch.Size(slot.shape), seed)
                local.copy_(full.view(-1)[start : start + local.numel()].view(local.shape))
            else:
                source.rows(slot.name, local, start)
            stats.held_bytes += local.numel() * local.element_size()
    stats.read_bytes = source.read_bytes
    stats.largest_tensor_bytes = 4 * max(math.prod(slot.shape) for slot in slots)
    return stats


_CODES = 4  # NF4 codes in one bf16 element of the packed storage
_BLOCK = 64  # weights per NF4 scale (bitsandbytes' default, which Params4bit uses)
_CHUNK = {"cpu": 1 << 16}  # weights quantised at once; 1 << 22 on an accelerator
# (launcher/estimate/methods.py counts the same chunks)


def _quantize_rows(
    source: TensorSource, slot: _Slot, local: torch.Tensor, start: int, device: torch.device
) -> Any:
    """Quantise the weight of `slot` chunk by chunk into `local`, this rank's rows of its packed
    storage (from packed element `start` on); returns the whole weight's quantisation state,
    as `bitsandbytes.functional.quantize_4bit` gives it for the whole weight."""
    import bitsandbytes.functional as F

    n = math.prod(slot.shape)
    first, last = _CODES * start, _CODES * (start + local.numel())  # the weights local covers
    chunk = _CHUNK.get(device.type, 1 << 22)
    buffer, scales, flat = torch.empty(min(chunk, n), dtype=source.dtype), [], local.view(-1)
    for begin in range(0, n, chunk):
        count = min(chunk, n - begin)
        source.rows(slot.name, buffer[:count], begin)
        packed, state = F.quantize_4bit(
            buffer[:count].to(device).float(),
            blocksize=_BLOCK,
            quant_type="nf4",
            quant_storage=QLORA_COMPUTE_DTYPE,
        )
        scales.append(state.absmax)
        lo, hi = max(begin, first), min(begin + count, last)
        if lo < hi:
            mine = packed.view(-1)[(lo - begin) // _CODES : (hi - begin) // _CODES]
            flat[(lo - first) // _CODES : (hi - first) // _CODES].copy_(mine)
    return _double_quantized(torch.cat(scales), slot.shape, device)


def _double_quantized(absmax: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> Any:
    """The quantisation state of a weight whose fp32 block scales are `absmax`, with the scales
    quantised once more (`bnb_4bit_use_double_quant`) as bitsandbytes does."""
    import bitsandbytes.functional as F

    offset = absmax.mean()
    scales, nested = F.quantize_blockwise(absmax - offset, blocksize=256)
    return F.QuantState(
        absmax=scales,
        shape=torch.Size(shape),
        dtype=torch.float32,  # the replica rungs quantise an fp32 weight
        blocksize=_BLOCK,
        code=F.get_4bit_type("nf4", device=device),
        quant_type="nf4",
        offset=offset,
        state2=nested,
    )


def _state_bytes(state: Any) -> int:
    """Bytes of a bitsandbytes quantisation state's tensors (absmax, the nested ones)."""
    tensors = [v for v in state.as_dict(packed=True).values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)
