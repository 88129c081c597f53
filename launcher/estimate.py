"""Peak memory per device and per host for one training step, for every strategy. Pure arithmetic.

The model describes what oomless's engine and backends allocate (docs/memory.md has the formulas
and their sources). Notation: N parameters, W ranks, b micro-batch, s sequence length, h hidden,
i MLP width, V vocabulary, L layers, c bytes of the compute dtype (2 for bf16/fp16, 4 for fp32).

- Model states (mixed precision keeps fp32 master weights, fp32 grads, two fp32 AdamW moments):
  4N + 4N + 8N on `single`/`ddp`; divided by W as each ZeRO/FSDP stage shards them; offload
  rungs move them to host memory.
- Activations: what autograd saves per decoder layer for the micro-batch (RMSNorm inputs kept in
  fp32, the 16-bit inputs autocast makes for every projection, rotary q/k, the attention output
  and log-sum-exp of a fused kernel, the SwiGLU intermediates), times the layers not checkpointed;
  a checkpointed layer keeps only its input, and one layer's activations are rebuilt at a time.
  Then the loss: 16-bit logits, their fp32 upcast, and cross-entropy's fp32 log-probabilities.
  Under FSDP's mixed precision the stream is 16-bit and not saved; under ZeRO-3 DeepSpeed's own
  linear function saves its fp32 input and no 16-bit weight copy.
- Transients: the autocast weight-cast cache (a 16-bit copy of every weight used in forward),
  FSDP all-gathers of the current and prefetched layer plus the root and reduce-scatter buffers,
  DeepSpeed buckets and the live/prefetched ZeRO-3 parameters (AdamW is fused: no temporaries).
- Runtime overhead: a constant for the CUDA context and the allocator's fragmentation as a ratio.

The breakdown lists the size of each part; the peak is the largest of the step's phases (end of
forward, the loss, the backward of every layer, the embedding's, the optimizer step), since
activations and gradients, or the autocast cache and the optimizer's temporaries, are never all
alive at once. Single and fsdp are calibrated against `launcher/trace.py` (tests/launcher/
test_estimate_trace.py); the DeepSpeed rungs follow the ZeRO paper and DeepSpeed's source.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from launcher.estimate_finetune import (
    FULL,
    Finetune,
    adapter_grad_per_token,
    adapter_saved_per_token,
    first_adapter_stage,
    method_sizes,
)
from launcher.estimate_levers import chunked_head_backward_extra_bytes, logit_tokens
from launcher.estimate_levers import loss_chunk_tokens as loss_chunk_tokens_for
from launcher.hardware import Hardware
from launcher.model_shape import ModelShape
from trainer.core import strategies
from trainer.core.config import ConfigError
from trainer.core.strategies import DEEPSPEED_BUCKET_ELEMENTS, Strategy, checkpointed_layers
from trainer.core.units import GIB

CUDA_CONTEXT_BYTES = int(0.75 * GIB)  # CUDA context + cuBLAS/cuDNN workspaces, measured typical
FRAGMENTATION_RATIO = 0.08  # caching-allocator slack over peak tensor bytes
CPU_PROCESS_BYTES = int(1.0 * GIB)  # python + torch + transformers in a CPU process (RSS)
HOST_PROCESS_BYTES = int(2.0 * GIB)  # per rank on the host: libraries, dataloader, pinned staging
ZERO_OFFLOAD_PINNED_RATIO = 1.0  # pinned host gradient buffer per offloaded fp32 partition

# Decoder blocks the activation model describes (RMSNorm, rotary, SDPA, gated MLP), checked
# against traced steps in tests/launcher/test_estimate_trace.py
MODELLED_TYPES = ("llama", "mistral", "qwen2", "phi3", "gemma")
DEVICE_PARTS = ("params", "grads", "optimizer", "activations", "temporary", "runtime_overhead")


@dataclass(frozen=True)
class Estimate:
    strategy: str
    world_size: int
    micro_batch_size: int
    activation_checkpointing: str
    device_breakdown: dict[str, int]
    peak_tensor_bytes: int  # predicted torch.cuda.max_memory_allocated
    device_total_bytes: int  # + runtime overhead: what must fit in device memory
    host_breakdown: dict[str, int] = field(default_factory=dict)
    host_total_bytes: int = 0  # per node
    phases: dict[str, int] = field(default_factory=dict)  # live bytes at each point of the step
    offloaded_bytes: int = 0  # per rank and micro-batch, with activation offload (PCIe each way)
    chunked_loss: bool = False
    offload_activations: bool = False

    def fits(self, hw: Hardware, headroom: float) -> bool:
        device_ok = self.device_total_bytes <= hw.device_memory_bytes * (1 - headroom)
        host_ok = self.host_total_bytes <= hw.host_memory_bytes * (1 - headroom)
        return device_ok and host_ok

    def why_not(self, hw: Hardware, headroom: float) -> str | None:
        if self.device_total_bytes > hw.device_memory_bytes * (1 - headroom):
            return (
                f"needs {self.device_total_bytes / GIB:.1f} GiB per device, has "
                f"{hw.device_memory_bytes / GIB:.1f} GiB less {headroom:.0%} headroom"
            )
        if self.host_total_bytes > hw.host_memory_bytes * (1 - headroom):
            return (
                f"needs {self.host_total_bytes / GIB:.1f} GiB host memory per node, has "
                f"{hw.host_memory_bytes / GIB:.1f} GiB less {headroom:.0%} headroom"
            )
        return None

    def to_json(self, hw: Hardware, headroom: float) -> dict[str, Any]:
        """The `strategies[]` entry of docs/interface.md."""
        return {
            "name": self.strategy,
            "world_size": self.world_size,
            "micro_batch_size": self.micro_batch_size,
            "activation_checkpointing": self.activation_checkpointing,
            "chunked_loss": self.chunked_loss,
            "offload_activations": self.offload_activations,
            "fits": self.fits(hw, headroom),
            "device": {
                "peak_tensor_bytes": self.peak_tensor_bytes,
                "total_bytes": self.device_total_bytes,
                "breakdown": dict(self.device_breakdown),
            },
            "host": {"total_bytes": self.host_total_bytes, "breakdown": dict(self.host_breakdown)},
        }


def zero_model_state_bytes(
    num_params: int,
    *,
    stage: int,
    world_size: int,
    param_bytes: int,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    largest_layer_params: int = 0,
) -> tuple[dict[str, int], dict[str, int]]:
    """(device, host per rank) model-state bytes of DeepSpeed ZeRO `stage` for one rank.

    The ZeRO paper's accounting (Rajbhandari et al. 2020, sec. 3 and 5: 2Ψ + 2Ψ + KΨ/Nd for
    stage 1, 2Ψ + (2 + K)Ψ/Nd for stage 2, (2 + 2 + K)Ψ/Nd for stage 3) with DeepSpeed's own
    refinements, so that with 16-bit parameters (`param_bytes=2`) it equals DeepSpeed's
    `estimate_zero2/3_model_states_mem_needs`: the optimizer keeps an fp32 master partition (4),
    two fp32 moments (8) and an fp32 gradient partition (4) besides the working parameters and
    their gradients, and stage 3 gathers the largest layer's parameters and gradients (2 x
    param_bytes per element). Our backend trains fp32 parameters under autocast
    (`param_bytes=4`): stage 3 then uses the parameter partition itself as the master copy
    (no clone), stages 1 and 2 still clone it.
    """
    n, w, p = num_params, max(1, world_size), param_bytes
    master = 0 if stage == 3 and p == 4 and not offload_optimizer else 4
    optimizer = (master + 8) * n // w
    fp32_grads = 4 * n // w
    if stage == 1:
        device = {"params": p * n, "grads": p * n + fp32_grads, "optimizer": optimizer}
    elif stage == 2:
        device = {"params": p * n, "grads": p * n // w + fp32_grads, "optimizer": optimizer}
    elif stage == 3:
        device = {"params": p * n // w, "grads": fp32_grads, "optimizer": optimizer}
    else:
        raise ValueError(f"ZeRO stage {stage}")
    host: dict[str, int] = {}
    if offload_optimizer:
        host = {"optimizer": (4 + 8) * n // w, "grads": fp32_grads}
        device["optimizer"] = 0
        device["grads"] = 0 if stage >= 2 else p * n
    if offload_params:
        host["params"] = device["params"]
        device["params"] = 0
    if stage == 3:
        device["gathered"] = 2 * p * largest_layer_params
    return device, host


@dataclass(frozen=True)
class _Micro:
    """One micro-batch on one device: tokens and the bytes of what the engine computes in."""

    b: int
    s: int
    c: int  # compute dtype bytes
    r: int  # residual stream bytes (fp32 under autocast, the parameter dtype under FSDP)
    autocast: bool  # 16-bit compute by autocast over fp32 weights (single, ddp, DeepSpeed)
    masked: bool  # packed windows: a block-causal mask, GQA's k/v repeated for SDPA
    # ZeRO-3 builds the model in deepspeed.zero.Init, which swaps F.linear for its own autograd
    # function: it saves the linear's input as given (fp32 under autocast) and the parameter
    # itself (re-gathered in backward), so no 16-bit weight copy is saved or cached
    zero3_linear: bool = False
    chunk_tokens: int | None = None  # chunked loss: tokens per chunk (estimate_levers.py)
    offload: bool = False  # activation offload: the layers' saved tensors wait on the host
    adapter: int = 0  # LoRA: bytes per token a block's adapters add/drop (estimate_finetune.py)
    first_adapter_stage: int = -1  # LoRA: where in the first block the first adapter is
    adapter_grad: int = 0  # LoRA: bytes per token of fp32 input gradients in a block's backward
    dequant: int = 0  # QLoRA: one 4-bit weight dequantised for a matmul

    @property
    def tokens(self) -> int:
        return self.b * self.s

    @property
    def frozen_base(self) -> bool:  # LoRA / QLoRA: only adapters train
        return self.first_adapter_stage >= 0

    @property
    def loss_rows(self) -> int:  # the loss reads every position's logits (the last is ignored)
        return self.b * self.s


def layer_activation_bytes(shape: ModelShape, m: _Micro) -> int:
    """What autograd keeps for one decoder layer that is not checkpointed, its input included:
    the analytic block where it describes the model, else what `launcher/activations.py`
    measured from the model's own code (or bounded)."""
    if shape.activations is not None:
        return shape.activations.layer_bytes(_mode(m), m.b, m.s)
    return analytic_layer_bytes(shape, m)


def _layer_backward_bytes(shape: ModelShape, m: _Micro) -> int:
    """What a layer's backward allocates beyond its saved tensors and its parameters'
    gradients: the gradients of its activations (measured for blocks the analytic model does
    not know, against the traced step: launcher/activations.py)."""
    if shape.activations is not None:
        return shape.activations.backward_bytes(_mode(m), m.b, m.s)
    return 2 * m.c * m.tokens * shape.intermediate_size + 4 * m.tokens * shape.hidden_size


def _mode(m: _Micro) -> str:
    """The compute mode a measured activation model is keyed by (launcher/activations.py)."""
    return "fp32" if m.c == 4 else "autocast" if m.autocast else "lowp"


def _shared_bytes(shape: ModelShape, m: _Micro) -> int:
    """What every layer reads and the layers save once for all: rotary cos and sin."""
    if shape.activations is not None:
        return shape.activations.shared_bytes(_mode(m), m.b, m.s)
    return 2 * m.r * m.b * m.s * shape.head_dim


def analytic_layer_bytes(shape: ModelShape, m: _Micro) -> int:
    """Llama-style block as transformers runs it (llama, mistral, qwen2): two RMSNorms, rotary
    q/k, SDPA, SwiGLU MLP, two residual adds. Traced per op under FakeTensorMode (trace.py).
    """
    return sum(_layer_parts(shape, m).values()) + m.adapter * m.tokens


def _layer_parts(shape: ModelShape, m: _Micro) -> dict[str, int]:
    """`layer_activation_bytes` by where in the block it is saved (before the adapters' terms)."""
    t, h, i = m.tokens, shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    c = m.c
    # an fp32 stream is saved by each norm (its fp32 cast is a no-op); a 16-bit one is not
    residual = 2 * 4 * t * h if m.r == 4 else 0
    if m.autocast and m.zero3_linear:  # each norm keeps its normalised input and its output
        norms, weights = 2 * (4 + 4) * t * h, 0
    elif m.autocast:  # each norm keeps its normalised input; 16-bit copies feed 5 matmuls
        norms = 2 * 4 * t * h + 5 * c * t * h
        weights = c * _matmul_params(shape)  # autocast's 16-bit weight copies, saved by matmuls
    elif c == 4:  # fp32 throughout: each norm keeps its normalised input and its output
        norms, weights = 2 * (4 + 4) * t * h, 0
    else:  # FSDP mixed precision: 16-bit stream, each norm upcasts to fp32 and casts back
        norms, weights = 2 * (4 + 2 * c) * t * h, 0
    repeated = m.masked and kv < q  # transformers repeats k/v for SDPA when a mask is given
    sdpa_inputs = 3 * c * t * q if repeated else c * t * (q + 2 * kv)
    attention = sdpa_inputs + c * t * q + 4 * m.b * shape.num_heads * m.s  # + out, log-sum-exp
    mask = c * m.b * m.s * m.s if m.masked else 0  # SDPA turns the boolean mask into a bias
    mlp = 4 * c * t * i  # gate, silu(gate), up, their product
    return {"stream": residual + norms + weights, "attention": attention + mask, "mlp": mlp}


def _first_layer_unsaved(shape: ModelShape, m: _Micro) -> int:
    """LoRA: the first block's input needs no gradient, so nothing before its first adapter is
    saved: the first norm's fp32 input, then (adapters from o_proj on) the attention's tensors,
    (from gate/up on) the second norm's, (down_proj only) the MLP's."""
    if m.first_adapter_stage < 0:
        return 0
    t, h = m.tokens, shape.hidden_size
    parts = _layer_parts(shape, m)
    stage = m.first_adapter_stage
    unsaved = 4 * t * h
    if stage >= 1:
        unsaved += parts["attention"]
    if stage >= 2:
        unsaved += 4 * t * h
    if stage >= 3:
        unsaved += 3 * m.c * t * shape.intermediate_size
    return unsaved


def _matmul_params(shape: ModelShape) -> int:
    return shape.num_layer_params - 2 * shape.hidden_size  # all but the two norm weights


def _head_params(shape: ModelShape) -> int:
    """lm_head's weight (the embedding's when tied)."""
    return shape.vocab_size * shape.hidden_size


def _final_bytes(shape: ModelShape, m: _Micro) -> int:
    """The last hidden state, the final norm's saved tensors and lm_head's 16-bit input/weight."""
    if shape.activations is not None:
        return shape.activations.final_bytes(_mode(m), m.b, m.s)
    t, h = m.tokens, shape.hidden_size
    if m.adapter:  # a frozen 16-bit final norm and output layer: the norm's fp32 input
        return 4 * t * h
    if m.autocast and m.zero3_linear:
        return m.r * t * h + 2 * 4 * t * h
    if m.autocast:
        return m.r * t * h + 4 * t * h + m.c * t * h + m.c * _head_params(shape)
    if m.c == 4:
        return 3 * 4 * t * h
    return (4 + 2 * m.c) * t * h


def loss_bytes(shape: ModelShape, micro: int, seq: int, c: int) -> int:
    """End of forward: 16-bit logits, their fp32 copy and log-softmax's fp32 output."""
    rows = micro * (seq - 1)
    copy = 4 * rows * shape.vocab_size if c < 4 else 0
    return c * micro * seq * shape.vocab_size + copy + 4 * rows * shape.vocab_size


def _offloaded_saved(
    shape: ModelShape, m: _Micro, ckpt: frozenset[int], rotary: int, cache: int
) -> tuple[int, int]:
    """(saved, autocast cache) on the device with activation offload, from the end of forward
    on: the layers' saved tensors are on the host (a checkpointed layer's keyword inputs, the
    mask and the rotary tables, stay: the checkpoint holds them itself); autocast's 16-bit
    weight copies, which the non-checkpointed layers saved, stay cached until forward ends."""
    num_plain = shape.num_layers - len(ckpt)
    cached = m.autocast and not m.zero3_linear
    return rotary, cache + (num_plain * m.c * _matmul_params(shape) if cached else 0)


def offloaded_activation_bytes(shape: ModelShape, m: _Micro, ckpt: frozenset[int]) -> int:
    """Host bytes activation offload holds per rank: every layer's saved tensors."""
    num_ckpt = len(ckpt)
    plain = layer_activation_bytes(shape, m)
    return (shape.num_layers - num_ckpt) * plain + num_ckpt * m.r * m.tokens * shape.hidden_size


@dataclass(frozen=True)
class _GradFlow:
    """How gradients come and go on one device during one micro-batch's backward."""

    held: int = 0  # gradients alive when the micro-batch starts (accumulation)
    per_layer: int = 0  # gradient bytes each layer's backward adds
    head: int = 0  # ... lm_head's and the final norm's
    root_at_embedding: int = 0  # the root's gradients alive during the embedding's backward
    in_layer: int = 0  # gradients of the layer being back-propagated, at its peak
    released_per_layer: int = 0  # held gradients a layer's reduce-scatter frees
    reduce_root: int = 0  # ... of the root's, after the embedding's backward
    pending_reduce: int = 0  # the previous reduce-scatter's input, freed at the next one


def _forward_backward_peaks(
    shape: ModelShape,
    m: _Micro,
    *,
    ckpt: frozenset[int],
    base: int,
    grads: _GradFlow,
    gather_layer: int,
    gather_root: int,
    root_kept: int = 0,
) -> dict[str, int]:
    """Live bytes at the points where one micro-batch's forward and backward peak.

    `ckpt`: the checkpointed layers; `base`: what lives through the whole step (parameters,
    optimizer state); `gather_*`: parameters a sharded strategy holds unsharded while a layer or
    the root computes; `root_kept`: the part of it held from forward's end into backward
    (FSDP2 does not reshard the root after forward).

    One function on purpose: the phases share most of their terms (what is saved, what is
    gathered, which gradients are alive), so they are written side by side."""
    num_layers, num_ckpt = shape.num_layers, len(ckpt)
    t, h, v = m.tokens, shape.hidden_size, shape.vocab_size
    per_layer = layer_activation_bytes(shape, m)
    kept_ckpt = m.r * t * h  # a checkpointed layer keeps its input
    mask_bool = m.b * m.s * m.s if m.masked else 0
    rotary = _shared_bytes(shape, m)  # cos and sin, shared by every layer
    saved = (num_layers - num_ckpt) * per_layer + num_ckpt * kept_ckpt + rotary
    if 0 not in ckpt:
        saved -= _first_layer_unsaved(shape, m)
    mask_kept = mask_bool if num_ckpt else 0  # checkpoints keep the mask for their recompute
    cached = m.autocast and not m.zero3_linear
    cache = num_ckpt * m.c * _matmul_params(shape) if cached else 0  # autocast's weight cache
    if m.offload:
        saved, cache = _offloaded_saved(shape, m, ckpt, rotary, cache)
    final = _final_bytes(shape, m)
    lt = logit_tokens(t, m.chunk_tokens)
    logits = m.c * lt * v
    rows_v = (m.loss_rows if m.chunk_tokens is None else lt) * v
    copy = 4 * rows_v if m.c < 4 else 0
    head_bwd = 2 * m.c * lt * v
    in_forward = 0 if m.chunk_tokens is None else copy + 4 * rows_v
    if m.chunk_tokens is not None:  # each chunk recomputed: its logits, copy and loss again
        head_bwd += (
            logits
            + copy
            + 4 * rows_v
            + chunked_head_backward_extra_bytes(
                t,
                h,
                0 if m.frozen_base else _head_params(shape),
                m.c,
                m.r,
                m.autocast and not m.zero3_linear,
            )  # fmt: skip (a frozen output layer has no weight gradient)
        )
    start = base + grads.held
    layer_bwd = _layer_backward_bytes(shape, m)  # grads of activations
    released = (num_layers - 1) * grads.released_per_layer  # by the first layer's backward
    head = start + mask_kept + gather_root + grads.head

    # Layer k's backward: what the layers below it saved, its own activations (rebuilt if
    # checkpointed), the gradients of the layers above it.
    backward_layers, below = 0, 0
    for k in range(num_layers):
        above = num_layers - 1 - k
        live = (
            head
            - above * grads.released_per_layer
            + below
            + rotary
            + per_layer
            + above * grads.per_layer
            + layer_bwd
            + gather_layer
            + grads.in_layer
            + m.dequant
            + m.adapter_grad * t
            + (grads.pending_reduce if above else 0)
        )
        backward_layers = max(backward_layers, live)
        below += kept_ckpt if k in ckpt else per_layer
        if m.offload:  # the layers below wait on the host; the next one is brought back
            below = kept_ckpt if k in ckpt else per_layer

    measured = {}
    if shape.activations is not None:  # a layer's own transients in forward (eager attention)
        fwd = shape.activations.forward_bytes(_mode(m), m.b, m.s)
        measured["forward_layers"] = start + saved + mask_bool + cache + gather_root + fwd
        measured["forward_layers"] += gather_layer
    return measured | {
        # (with chunked loss the loss runs inside the model's forward, one chunk at a time)
        # (LoRA under autocast: the last block's largest fp32 cast of an adapter's input)
        "forward": start
        + saved
        + mask_bool
        + cache
        + final
        + gather_root
        + logits
        + in_forward
        + m.adapter_grad * t,
        "layer_gather": start + saved + mask_bool + cache + gather_root + gather_layer,
        "loss": start + saved + mask_kept + cache + final + logits + copy + 4 * rows_v + root_kept,
        "backward_start": start + saved + mask_kept + final + 12 * rows_v + root_kept,
        "backward_head": head + saved + final + head_bwd,
        "backward_layers": backward_layers,
        # the embedding's backward, with the last layer's reduce-scatter still in flight
        "backward_embedding": start
        - released
        - grads.released_per_layer
        + mask_kept
        + num_layers * grads.per_layer
        + 4 * t * h
        + gather_root
        + grads.root_at_embedding
        + grads.pending_reduce,
        # a sharded root is resharded, then its gradients are reduced
        "backward_end": start
        - num_layers * grads.released_per_layer
        + num_layers * grads.per_layer
        + grads.reduce_root,
    }


@dataclass(frozen=True)
class _ModelStates:
    """One rank's model states for a rung, and how its gradients come and go in the first and in
    a later micro-batch of a step (accumulation)."""

    on_device: dict[str, int]  # params, grads, optimizer
    on_host: dict[str, int]  # per rank
    base: int  # device bytes alive through the whole step
    grads_at_step: int  # gradient bytes alive at the optimizer step
    first: _GradFlow
    later: _GradFlow
    gather_layer: int = 0  # unsharded parameters while a layer computes
    gather_root: int = 0  # ... while the root (embeddings, norm, head) computes
    root_kept: int = 0  # part of gather_root held from forward's end into backward


@dataclass(frozen=True)
class _Sizes:
    """Parameter counts and per-rank factors every model-state function uses."""

    n: int  # all parameters
    w: int  # ranks
    c: int  # compute dtype bytes
    layer_n: int
    root_n: int
    head_n: int  # lm_head (or the tied embedding) + final norm
    embed_n: int
    tied_embed: int  # the embedding's parameters when tied to the head, else 0
    accumulating: bool
    bucket: int  # DeepSpeed's fp32 reduce bucket

    @classmethod
    def of(cls, shape: ModelShape, w: int, c: int, grad_accum: int) -> _Sizes:
        embed_n = shape.num_embedding_params
        return cls(
            n=shape.num_params,
            w=w,
            c=c,
            layer_n=shape.num_layer_params,
            root_n=shape.num_root_params,
            head_n=_head_params(shape) + shape.hidden_size,
            embed_n=embed_n,
            tied_embed=embed_n if shape.tied_embeddings else 0,
            accumulating=grad_accum > 1,
            bucket=4 * min(DEEPSPEED_BUCKET_ELEMENTS, shape.num_params),
        )


def _replicated_states(row: Strategy, z: _Sizes, shape: ModelShape, fsdp_every: bool):
    """single, ddp and ZeRO-1: full fp32 parameters and gradients on every rank."""
    n, w = z.n, z.w
    if row.zero_stage == 1:
        dev, _ = zero_model_state_bytes(n, stage=1, world_size=w, param_bytes=4)
        on_device = {k: dev[k] for k in ("params", "grads", "optimizer")}
    else:
        on_device = {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n}
    base = on_device["params"] + on_device["optimizer"]
    # AccumulateGrad: the first gradient of a weight becomes its .grad (fp32, from the 16-bit
    # one autocast's backward makes); a tied embedding's is summed out of place.
    untied_embed = z.embed_n - z.tied_embed
    first = _GradFlow(
        held=0,
        per_layer=4 * z.layer_n,
        in_layer=4 * z.layer_n,
        head=4 * z.head_n,
        root_at_embedding=4 * z.head_n + 4 * untied_embed + 8 * z.tied_embed,
    )
    later = _GradFlow(held=4 * n, root_at_embedding=4 * z.embed_n)
    grads_at_step = on_device["grads"]
    if row.engine == "ddp":  # gradient_as_bucket_view: the buckets hold the grads for good
        base += on_device["grads"]
        first = later = _GradFlow(root_at_embedding=4 * z.embed_n)
        grads_at_step = 0
    if row.zero_stage == 1:  # the boundary reduces the full grads through the bucket
        first = replace(first, reduce_root=4 * n + z.bucket)
        later = replace(later, reduce_root=z.bucket)
    return _ModelStates(on_device, {}, base, grads_at_step, first, later)


def _fsdp_states(row: Strategy, z: _Sizes, shape: ModelShape, fsdp_every: bool):
    """FSDP2: everything sharded over the ranks (on the host under CPUOffloadPolicy); 16-bit
    gathers per layer; the root stays gathered from forward into backward."""
    n, w, c, layer_n, root_n = z.n, z.w, z.c, z.layer_n, z.root_n
    shard = {"params": 4 * n // w, "grads": 4 * n // w, "optimizer": 8 * n // w}
    on_device, on_host = dict(shard), {}
    if row.offloads:  # fp32 params, grads and AdamW on the host
        on_device, on_host = {"params": 0, "grads": 0, "optimizer": 0}, dict(shard)
    # the root's 16-bit unsharded grads during the embedding's backward (tied: summed)
    root_unsharded = c * root_n + c * z.tied_embed
    sync = _GradFlow(
        held=4 * n if z.accumulating else 0,  # no_sync kept unsharded fp32 grads till now
        per_layer=on_device["grads"] and 4 * layer_n // w,
        head=c * z.head_n,
        root_at_embedding=root_unsharded,
        in_layer=c * layer_n,  # its 16-bit unsharded grads, before the reduce-scatter
        released_per_layer=4 * layer_n if z.accumulating else 0,
        reduce_root=_reduce_scatter_bytes(root_n, c, w),
        pending_reduce=4 * layer_n,
    )
    no_sync = _GradFlow(  # unsharded fp32 gradient accumulation on every rank
        per_layer=4 * layer_n,
        in_layer=4 * layer_n,
        head=4 * z.head_n,
        root_at_embedding=4 * root_n + root_unsharded,
    )
    if fsdp_every:  # later micro-batches add to the sharded grads
        first = replace(sync, held=0, released_per_layer=0)
        later = replace(first, held=on_device["grads"], per_layer=0)
    else:
        first, later = (no_sync, sync) if z.accumulating else (sync, sync)
    return _ModelStates(
        on_device,
        on_host,
        base=on_device["params"] + on_device["optimizer"],
        grads_at_step=on_device["grads"],
        first=first,
        later=later,
        gather_layer=2 * c * layer_n,  # unsharded params + the all-gather output
        gather_root=c * root_n,  # embeddings, norm, lm_head: unsharded through fwd and bwd
        root_kept=c * root_n,
    )


def _zero_states(row: Strategy, z: _Sizes, shape: ModelShape, fsdp_every: bool):
    """DeepSpeed ZeRO-2/3 and its offload rungs (ZeRO-1 accounts like a replica)."""
    if row.zero_stage == 1:
        return _replicated_states(row, z, shape, fsdp_every)
    dev, host = zero_model_state_bytes(
        z.n,
        stage=row.zero_stage,
        world_size=z.w,
        param_bytes=4,  # fp32 parameters, 16-bit compute by autocast
        offload_optimizer=row.optimizer_at != "device",
        offload_params=row.params_at != "device",
    )
    on_device = {k: dev[k] for k in ("params", "grads", "optimizer")}
    if row.needs_nvme:  # states on NVMe; the host keeps swap buffers
        host = {"nvme_buffers": 2 * 16 * z.layer_n}
    # a layer's fp32 grads live until DeepSpeed's hooks copy them into the bucket
    flow = _GradFlow(in_layer=4 * z.layer_n, root_at_embedding=4 * z.embed_n)
    gather_layer = gather_root = 0
    if row.zero_stage == 3:  # the gathered fp32 layer and the prefetched one; root matrices
        gather_layer = 4 * z.layer_n + min(z.bucket, 4 * z.layer_n)
        gather_root = 4 * _head_params(shape)
    return _ModelStates(
        on_device,
        host,
        base=sum(on_device.values()) + z.bucket,  # grads are reduced through the bucket
        grads_at_step=0,
        first=flow,
        later=flow,
        gather_layer=gather_layer,
        gather_root=gather_root,
    )


# Model-state accounting per engine (the `engine` column of trainer/core/strategies.py)
_MODEL_STATES = {
    "single": _replicated_states,
    "ddp": _replicated_states,
    "fsdp": _fsdp_states,
    "deepspeed": _zero_states,
}


def _micro(
    row: Strategy,
    micro_batch_size: int,
    seq_len: int,
    precision: str,
    packed: bool,
    chunk_tokens: int | None = None,
    offload: bool = False,
    shape: ModelShape | None = None,
    ft: Finetune = FULL,
):
    """With adapters the frozen base computes in the compute dtype: a 16-bit stream and no
    autocast copies of its weights, as under FSDP's mixed precision."""
    c = 4 if precision == "fp32" else 2
    sixteen_bit = row.engine == "fsdp" or ft.adapters
    return _Micro(
        b=micro_batch_size,
        s=seq_len,
        c=c,
        r=c if sixteen_bit else 4,
        autocast=precision != "fp32" and not sixteen_bit,
        masked=packed,
        zero3_linear=row.zero_stage == 3 and not ft.adapters,
        chunk_tokens=chunk_tokens,
        offload=offload,
        adapter=adapter_saved_per_token(shape, ft, c, private=row.engine != "fsdp" and c < 4),
        first_adapter_stage=first_adapter_stage(shape, ft),
        adapter_grad=adapter_grad_per_token(shape, ft, private=row.engine != "fsdp" and c < 4),
        dequant=method_sizes(shape, ft, c).dequant if ft.method == "qlora" else 0,
    )


def _states_for(row: Strategy, z: _Sizes, shape: ModelShape, every: bool, ft: Finetune):
    """The rung's model states; LoRA, QLoRA and 8-bit moments are estimate_finetune_states.py's
    (imported here: it builds on this module's dataclasses)."""
    if ft == FULL:
        return _MODEL_STATES[row.engine](row, z, shape, every)
    from launcher.estimate_finetune_states import finetune_states

    return finetune_states(row, z, shape, every, ft)


def _step_phases(shape: ModelShape, m: _Micro, states: _ModelStates, ckpt, accumulating: bool):
    """Live bytes at each peak point of the step: the first micro-batch, a later one (with the
    accumulated gradients alive), and the optimizer step."""

    def micro_batch(grads: _GradFlow) -> dict[str, int]:
        return _forward_backward_peaks(
            shape, m, ckpt=ckpt, base=states.base, grads=grads,
            gather_layer=states.gather_layer, gather_root=states.gather_root,
            root_kept=states.root_kept,
        )  # fmt: skip

    phases = micro_batch(states.first)
    if accumulating:
        again = micro_batch(states.later)
        phases = {k: max(v, again[k]) for k, v in phases.items()}
    phases["optimizer"] = states.base + states.grads_at_step  # fused AdamW: no temporaries
    return phases


def _activation_bytes(shape: ModelShape, m: _Micro, ckpt: frozenset[int]) -> int:
    """What the breakdown lists as activations on the device: saved tensors of every layer
    (with activation offload: of the layer in flight and the next one, the rest is on the
    host), the final hidden state and the loss's tensors (with chunked loss: one chunk's)."""
    num_ckpt = len(ckpt)
    layers = (shape.num_layers - num_ckpt) * layer_activation_bytes(shape, m)
    if 0 not in ckpt:
        layers -= _first_layer_unsaved(shape, m)
    layers += num_ckpt * m.r * m.tokens * shape.hidden_size
    if m.offload:
        layers = min(layers, 2 * layer_activation_bytes(shape, m))
    if m.chunk_tokens is None:
        loss = loss_bytes(shape, m.b, m.s, m.c)
    else:
        rows = logit_tokens(m.tokens, m.chunk_tokens)
        loss = (m.c + (4 if m.c < 4 else 0) + 4) * rows * shape.vocab_size
    return layers + _final_bytes(shape, m) + loss


def _runtime_overhead(device: str, peak: int, persistent: int) -> int:
    if device != "cuda":
        return CPU_PROCESS_BYTES
    # Model states are allocated once, in large blocks; the allocator's slack grows with what
    # is allocated and freed every step (activations, gathers, buffers).
    return CUDA_CONTEXT_BYTES + int(FRAGMENTATION_RATIO * max(0, peak - persistent))


def loading_host_bytes(
    shape: ModelShape, row: Strategy, ranks_here: int, bytes_per_param: int = 4
) -> int:
    """Host bytes per node that loading the initial (pretrained) weights adds at its peak.

    A replica (single, ddp, ZeRO-1/2) is built whole on the host by each rank: in fp32 (4N per
    rank), or for a frozen LoRA/QLoRA base loaded from pretrained weights in the 16-bit compute
    dtype (`bytes_per_param` 2: 2N; QLoRA quantises it layer by layer afterwards). A sharded
    rung reads its own part from the safetensors files into its parameters
    (`trainer/pretrained.py`): beyond the part itself (counted with the model states) at most
    one tensor in flight per rank, its fp32 copy on the way to the device (4 x the largest
    tensor). zero3_nvme builds the full weights on rank 0 (the model, then its state dict
    cloned: 8N) and sends each rank its part, as random init does on every sharded rung."""
    n = shape.num_params
    if not row.shards_params:
        return bytes_per_param * n * ranks_here
    if row.needs_nvme:
        return 8 * n
    return 4 * _largest_tensor_params(shape) * ranks_here


def _largest_tensor_params(shape: ModelShape) -> int:
    h = shape.hidden_size
    q = shape.num_heads * shape.head_dim
    return max(shape.vocab_size * h, shape.intermediate_size * h, q * h)


def _host_bytes(
    row: Strategy,
    states: _ModelStates,
    shape: ModelShape,
    ranks_here: int,
    device_bytes: int,
    device: str,
    load_bytes_per_param: int,
) -> dict[str, int]:
    """Host memory per node: every rank's offloaded states, loading the initial weights
    (`loading_host_bytes`), process baseline."""
    host = {k: v * ranks_here for k, v in states.on_host.items()}
    host["initial_weights"] = loading_host_bytes(shape, row, ranks_here, load_bytes_per_param)
    host["processes"] = HOST_PROCESS_BYTES * ranks_here
    if device == "cpu":  # the "device" is host memory too
        host["device_memory_of_cpu_ranks"] = device_bytes * ranks_here
    return host


def estimate(
    shape: ModelShape,
    *,
    strategy: str,
    world_size: int,
    devices_per_node: int,
    micro_batch_size: int,
    seq_len: int,
    activation_checkpointing: str,
    precision: str,
    device: str = "cuda",
    grad_accum: int = 2,
    packed: bool = True,
    fsdp_reduce_every_micro_batch: bool = False,
    chunked_loss: bool = False,
    offload_activations: bool = False,
    loss_chunk_tokens: int | None = None,
    finetune: Finetune = FULL,
) -> Estimate:
    """Peak bytes on one device and on one host for a training step of this configuration.

    `grad_accum`: micro-batches per optimizer step on this rank; every value above 1 costs the
    same (later micro-batches run with the earlier ones' gradients alive). `packed`: windows hold
    several documents (data.pack), so attention gets a block-causal mask.
    `fsdp_reduce_every_micro_batch`: FSDP reduce-scatters after every micro-batch and accumulates
    sharded gradients, instead of accumulating unsharded ones under no-sync.
    `chunked_loss`, `offload_activations`, `loss_chunk_tokens`: the exact levers as the engine
    runs them (launcher/estimate_levers.py). `finetune`: the method and optimizer
    (launcher/estimate_finetune.py).
    """
    _check_modelled(shape)
    row = strategies.row(strategy)
    w = max(1, world_size)
    chunk = loss_chunk_tokens_for(shape.vocab_size, loss_chunk_tokens) if chunked_loss else None
    m = _micro(
        row, micro_batch_size, seq_len, precision, packed, chunk, offload_activations, shape,
        finetune,
    )  # fmt: skip
    z = _Sizes.of(shape, w, m.c, grad_accum)
    states = _states_for(row, z, shape, fsdp_reduce_every_micro_batch, finetune)
    ckpt = frozenset(checkpointed_layers(shape.num_layers, activation_checkpointing))
    phases = _step_phases(shape, m, states, ckpt, z.accumulating)
    peak = max(phases.values())

    activations = _activation_bytes(shape, m, ckpt)
    persistent = states.base + states.grads_at_step
    temporary = max(0, peak - persistent - activations)
    overhead = _runtime_overhead(device, peak, persistent)
    breakdown = {
        **states.on_device,
        "activations": activations,
        "temporary": temporary,
        "runtime_overhead": overhead,
    }
    ranks_here = min(devices_per_node, w)
    # a frozen base from pretrained weights loads in its compute dtype (trainer/finetune.py)
    load_bytes = m.c if finetune.adapters and finetune.pretrained else 4
    host = _host_bytes(row, states, shape, ranks_here, peak + overhead, device, load_bytes)
    if offload_activations:
        host["offloaded_activations"] = offloaded_activation_bytes(shape, m, ckpt) * ranks_here
    return Estimate(
        strategy=strategy,
        world_size=w,
        micro_batch_size=micro_batch_size,
        activation_checkpointing=activation_checkpointing,
        device_breakdown={k: int(breakdown.get(k, 0)) for k in DEVICE_PARTS},
        peak_tensor_bytes=int(peak),
        device_total_bytes=int(peak + overhead),
        host_breakdown={k: int(v) for k, v in host.items()},
        host_total_bytes=int(sum(host.values())),
        phases=phases,
        offloaded_bytes=offloaded_activation_bytes(shape, m, ckpt) if offload_activations else 0,
        chunked_loss=chunked_loss,
        offload_activations=offload_activations,
    )


def _check_modelled(shape: ModelShape) -> None:
    if shape.model_type not in MODELLED_TYPES and shape.activations is None:
        raise ConfigError(
            "model.model_type",
            f"the memory estimate models {', '.join(MODELLED_TYPES)} decoder blocks, not "
            f"{shape.model_type} (its activations are not checked against a trace)",
            "plan it with `oomless plan` or `oomless estimate` (they measure other blocks' "
            "activations: launcher/activations.py)",
        )


def _reduce_scatter_bytes(num_params: int, c: int, w: int) -> int:
    """FSDP2 reducing one unit: its 16-bit unsharded grads, the fp32 reduce-scatter input and
    output (the grads are freed while the output is made)."""
    return 4 * num_params + max(c * num_params, c * num_params // 2 + 4 * num_params // w)
