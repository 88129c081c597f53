"""Model states of LoRA, QLoRA and 8-bit AdamW, per rung. Pure arithmetic, torch-free.

What the engine holds (trainer/model/finetune.py runs it through peft and bitsandbytes):

- LoRA: the frozen base in the compute dtype (c bytes per parameter: no fp32 master, no
  gradient, no optimizer state); adapters A (r x in) and B (out x r) on every targeted linear of
  the decoder blocks, in fp32, with fp32 gradients and their optimizer state.
- QLoRA: every linear of the decoder blocks in 4-bit NF4 (bitsandbytes `Linear4bit`, blocksize
  64, double quantisation: half a byte per weight, one 8-bit absmax per 64 weights, one fp32
  absmax per 256 of those, and per tensor an fp32 offset); embeddings, norms, biases and the
  output layer in the compute dtype; the adapters as for LoRA.
- `train.optimizer: adamw_8bit` (bitsandbytes `AdamW8bit`, blockwise): both moments in 8 bits
  with one fp32 absmax per block of 256 elements each (bitsandbytes 0.50's blocksize; older
  releases used 2048), fp32 moments for tensors under 4096 elements (`min_8bit_size`).

Activations (launcher/estimate/peak.py, `_Micro.adapter`): the base computes in the compute dtype,
so the residual stream is 16-bit and no autocast weight copy is saved for the base; each adapter
saves its input (the dropout's output; the very tensor the base linear reads when dropout is 0)
and the output of A (r per token); a 4-bit linear dequantises its weight to the compute dtype
for each matmul (one weight's transient at a time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trainer.core.config import ConfigError
from trainer.core.methods import method_support
from trainer.core.step_spec import Finetune
from trainer.core.strategies import Strategy

METHODS = ("full", "lora", "qlora")
OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit")
NF4_BLOCK = 64  # weights per absmax (bitsandbytes' default 4-bit blocksize)
NF4_NESTED_BLOCK = 256  # absmaxes per fp32 absmax under double quantisation
NF4_TABLES = 4 * (16 + 256)  # per tensor: the NF4 code and the absmaxes' 8-bit map, in fp32
ADAM8_BLOCK = 256  # elements per absmax of an 8-bit moment (bitsandbytes 0.50 blockwise)
ADAM8_MIN_SIZE = 4096  # smaller tensors keep fp32 moments (bitsandbytes' min_8bit_size)
ADAM8_QMAPS = 2 * 256 * 4  # the two 256-entry fp32 quantisation maps, shared by all tensors


def layer_linears(shape: Any) -> dict[str, tuple[int, int]]:
    """The linears of one decoder block, name -> (in_features, out_features), as transformers
    builds the modelled blocks (phi3 fuses qkv and gate/up)."""
    h, i = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    if shape.model_type == "phi3":
        return {
            "qkv_proj": (h, q + 2 * kv),
            "o_proj": (q, h),
            "gate_up_proj": (h, 2 * i),
            "down_proj": (i, h),
        }
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def targeted(shape: Any, ft: Finetune) -> dict[str, tuple[int, int]]:
    """The linears that get adapters: all of a block's (peft's `all-linear` leaves the output
    layer out), or those named; a name that is no linear of the block is a config error."""
    linears = layer_linears(shape)
    if ft.target_modules == "all-linear":
        return linears
    unknown = [n for n in ft.target_modules if n not in linears]
    if unknown:
        raise ConfigError(
            "finetune.lora.target_modules",
            f"{', '.join(unknown)} is not a linear of a {shape.model_type} decoder block",
            f"use all-linear or some of {', '.join(linears)}",
        )
    return {n: linears[n] for n in ft.target_modules}


def adapter_tensors(shape: Any, ft: Finetune) -> list[int]:
    """Element counts of one block's adapter tensors (A: r x in, B: out x r per target)."""
    out = []
    for fan_in, fan_out in targeted(shape, ft).values():
        out += [ft.r * fan_in, fan_out * ft.r]
    return out


def layer_tensors(shape: Any) -> list[int]:
    """Element counts of one block's parameter tensors: its linears, two norms, and the biases
    (qwen2: q, k, v) that make up the rest of the block's count."""
    linears = [a * b for a, b in layer_linears(shape).values()]
    norms = [shape.hidden_size] * 2
    rest = shape.num_layer_params - sum(linears) - sum(norms)
    kv = shape.num_kv_heads * shape.head_dim
    q = shape.num_heads * shape.head_dim
    biases = [q, kv, kv] if rest == q + 2 * kv else ([rest] if rest > 0 else [])
    return linears + norms + biases


def root_tensors(shape: Any) -> list[int]:
    """The embedding, the output layer (unless tied) and the final norm."""
    head = [] if shape.tied_embeddings else [shape.num_embedding_params]
    rest = shape.num_root_params - shape.num_embedding_params * (1 + len(head))
    return [shape.num_embedding_params, *head, *([rest] if rest > 0 else [])]


def nf4_bytes(numel: int) -> int:
    """A bitsandbytes NF4 weight with double quantisation: packed 4-bit values, 8-bit absmax per
    64 weights, an fp32 absmax per 256 of those, an fp32 offset, and the tensor's own copies of
    the two code tables."""
    blocks = math.ceil(numel / NF4_BLOCK)
    nested = 4 * math.ceil(blocks / NF4_NESTED_BLOCK)
    return math.ceil(numel / 2) + blocks + nested + 4 + NF4_TABLES


def packed_nf4_bytes(numel: int) -> int:
    """The packed 4-bit codes alone (two a byte): what a sharded rung splits of an NF4 weight."""
    return math.ceil(numel / 2)


def adam_state_bytes(tensors: list[int], optimizer: str, p: int = 4) -> int:
    """Both AdamW moments of these tensors: in the trained dtype (p bytes: fp32, bf16 under
    bf16_pure), or 8-bit with an fp32 absmax per 256 elements (fp32 for tensors under 4096
    elements) and the shared quantisation maps."""
    if optimizer == "adamw":
        return 2 * p * sum(tensors)
    total = 0
    for n in tensors:
        small = n < ADAM8_MIN_SIZE
        total += 8 * n if small else 2 * n + 2 * 4 * math.ceil(n / ADAM8_BLOCK)
    return total + ADAM8_QMAPS


@dataclass(frozen=True)
class MethodSizes:
    """Per-model byte counts of one method, before sharding: what is frozen, what trains."""

    frozen: int  # frozen base bytes (compute dtype, or NF4 + compute dtype)
    frozen_layer: int  # ... of one block
    trainable: int  # trainable parameters
    trainable_layer: int  # ... of one block
    optimizer: int  # optimizer state bytes of all trainable tensors
    dequant: int  # the largest 4-bit weight dequantised to the compute dtype (QLoRA)
    # of `frozen`, what ZeRO-3 does not partition: QLoRA's quantisation states (absmax, code
    # tables), which stay whole on each parameter of every rank
    unpartitioned: int = 0
    frozen_top: int = 0  # frozen bytes of the largest block (what a sharded rung gathers)


def method_sizes(shape: Any, ft: Finetune, c: int, p: int = 4) -> MethodSizes:
    """Frozen and trainable bytes of the whole model under `ft`, computing in c-byte floats and
    training p-byte ones."""
    layers = shape.num_layers
    if not ft.adapters:
        tensors = layers * layer_tensors(shape) + root_tensors(shape)
        return MethodSizes(0, 0, shape.num_params, shape.num_layer_params,
                           adam_state_bytes(tensors, ft.optimizer, p), 0)  # fmt: skip
    adapters = adapter_tensors(shape, ft)
    optimizer = adam_state_bytes(layers * adapters, ft.optimizer, p)
    frozen_layer, frozen_top = c * shape.num_layer_params, c * shape.gathered_layer_params
    dequant = states = 0
    if ft.method == "qlora":
        linears = [a * b for a, b in layer_linears(shape).values()]
        quantised = sum(nf4_bytes(n) for n in linears) - c * sum(linears)
        frozen_layer, frozen_top = frozen_layer + quantised, frozen_top + quantised
        dequant = c * max(linears)
        states = layers * sum(nf4_bytes(n) - packed_nf4_bytes(n) for n in linears)
    frozen = layers * frozen_layer + c * shape.num_root_params
    return MethodSizes(frozen, frozen_layer, layers * sum(adapters), sum(adapters), optimizer,
                       dequant, states, frozen_top)  # fmt: skip


# Where each linear reads its input: 0 the first norm's output (attention projections), 1 the
# attention's output (saved by SDPA anyway), 2 the second norm's output, 3 the MLP's product.
_STAGE = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "qkv_proj": 0, "o_proj": 1, "gate_proj": 2,
          "up_proj": 2, "gate_up_proj": 2, "down_proj": 3}  # fmt: skip


def adapter_saved_per_token(shape: Any, ft: Finetune, c: int, private: bool) -> int:
    """Bytes per token one block saves under LoRA, relative to the same block with every weight
    training (estimate.py's 16-bit-stream block). Frozen norms and a frozen MLP save neither
    their normalised 16-bit inputs, their outputs, nor the MLP's product; each adapter saves its
    input and A's output (r values). `private`: the adapters are fp32 under autocast (not
    FSDP's 16-bit gathers), so peft casts each adapter's input to fp32 and autocast back to
    16 bits: a copy per adapter instead of one shared tensor per input. With dropout each
    adapter saves the dropped input (16-bit when shared) and its mask."""
    if not ft.adapters:
        return 0
    h, i = shape.hidden_size, shape.intermediate_size
    removed = 2 * 2 * c * h + c * i
    targets = targeted(shape, ft)
    added = c * ft.r * len(targets)
    if private:
        added += sum((c + (1 if ft.dropout > 0 else 0)) * fan_in for fan_in, _ in targets.values())
    elif ft.dropout > 0:
        added += sum((c + 1) * fan_in for fan_in, _ in targets.values())
    else:  # one saved tensor per input read by an adapter (the attention's output is saved)
        inputs = {_STAGE[name]: fan_in for name, (fan_in, _) in targets.items()}
        added += sum(c * fan_in for stage, fan_in in inputs.items() if stage != 1)
    return added - removed


def adapter_grad_per_token(shape: Any, ft: Finetune, private: bool) -> int:
    """Bytes per token of the fp32 input gradients a block's backward holds at once when peft
    casts the adapters' inputs to fp32 (`private`): gate's and up's together (one product's
    backward makes both), any other adapter's alone. Fitted to the traced recompute of a
    checkpointed block (launcher/estimate/trace.py), within 3% of its peak."""
    if not (ft.adapters and private):
        return 0
    targets = targeted(shape, ft)
    together = sum(fan_in for name, (fan_in, _) in targets.items() if _STAGE[name] == 2)
    alone = max(fan_in for fan_in, _ in targets.values())
    return 4 * max(together, alone)


def first_adapter_stage(shape: Any, ft: Finetune) -> int:
    """Where the first block's first adapter reads (`_STAGE`), -1 without adapters."""
    if not ft.adapters:
        return -1
    return min(_STAGE[name] for name in targeted(shape, ft))


# weights a rank quantises at once (trainer/model/qlora_load.py's chunk), and the bytes each costs
# in flight: on an accelerator its 16-bit and fp32 copies and its packed codes and scale (the
# CUDA kernel); on a CPU process also the default kernel's scaled, clamped and code tensors
QUANTISE_CHUNK = {"cpu": 1 << 16, "cuda": 1 << 22}
QUANTISE_BYTES_PER_WEIGHT = {"cpu": 24, "cuda": 7}


def quantising_bytes(shape: Any, device: str) -> int:
    """Device bytes a rank's QLoRA load adds to its shards: one chunk of a weight being
    quantised, and the largest block linear's fp32 block scales (one per 64 weights)."""
    largest = max(fan_in * fan_out for fan_in, fan_out in layer_linears(shape).values())
    kind = "cpu" if device == "cpu" else "cuda"
    chunk = min(QUANTISE_CHUNK[kind], largest)
    return chunk * QUANTISE_BYTES_PER_WEIGHT[kind] + 4 * largest // 64


@dataclass(frozen=True)
class AdapterTerms:
    """What a method adds to one micro-batch's activations
    (launcher/estimate/analytic_activations.py)."""

    saved_per_token: int  # bytes per token a block's adapters add/drop
    first_stage: int  # where in the first block the first adapter is (-1: full fine-tuning)
    grad_per_token: int  # bytes per token of fp32 input gradients in a block's backward
    dequant: int  # QLoRA: one 4-bit weight dequantised for a matmul


def adapter_terms(shape: Any, ft: Finetune, c: int, private: bool) -> AdapterTerms:
    """The activation terms of `ft` for a base computing in c-byte floats; `private`: peft casts
    each adapter's input to fp32 under autocast."""
    return AdapterTerms(
        saved_per_token=adapter_saved_per_token(shape, ft, c, private=private),
        first_stage=first_adapter_stage(shape, ft),
        grad_per_token=adapter_grad_per_token(shape, ft, private=private),
        dequant=method_sizes(shape, ft, c).dequant if ft.method == "qlora" else 0,
    )


@dataclass(frozen=True)
class MethodCost:
    """What the cost model (launcher/plan/planner.py) needs of a method, per token and per pass."""

    flops_per_token: float  # matmul FLOPs of forward + backward, attention aside (6N for full)
    recompute_flops_per_token: float  # one more forward of every matmul (full checkpointing)
    trained: int  # parameters whose gradients are reduced, moved and stepped
    gathered: float  # parameters gathered or moved per use, in compute-dtype equivalents
    dequant_bytes: int  # bytes read and written dequantising the 4-bit weights, once over


def method_cost(shape: Any, ft: Finetune, c: int) -> MethodCost:
    """Full fine-tuning: 2N forward, 4N backward. With adapters the frozen base still passes
    gradients to its input (2N) but computes none for its weights; the adapters add 2A forward
    and 4A backward. QLoRA dequantises every 4-bit weight to the compute dtype for each matmul
    (forward, backward, recompute), a memory-bound pass: half a byte read, c bytes written.
    Compute counts the parameters a token multiplies by (MoE: the experts it is routed to);
    what is reduced, gathered and stepped counts every expert."""
    n = shape.num_compute_params
    if not ft.adapters:
        return MethodCost(6.0 * n, 2.0 * n, shape.num_params, float(shape.num_params), 0)
    sizes = method_sizes(shape, ft, c)
    a = sizes.trainable
    dequant = 0
    if ft.method == "qlora":
        linears = shape.num_layers * sum(x * y for x, y in layer_linears(shape).values())
        dequant = int(linears * (0.5 + c))
    return MethodCost(4.0 * n + 6.0 * a, 2.0 * (n + a), a, sizes.frozen / c + a, dequant)


def why_not_on(row: Strategy, ft: Finetune, precision: str = "bf16") -> str | None:
    """Why this rung cannot run the method, optimizer, precision or step in backward, or None:
    the engine's own table (trainer/core/methods.py), so the planner never picks a rung that the
    config then refuses."""
    return method_support(row.name, ft.method, ft.optimizer, precision, ft.in_backward)
