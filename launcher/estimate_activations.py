"""What one micro-batch's activations take on one device: the analytic decoder block. Pure
arithmetic (docs/memory.md has the formulas and their sources).

What autograd saves per decoder layer for the micro-batch (RMSNorm inputs kept in fp32, the
16-bit inputs autocast makes for every projection, rotary q/k, the attention output and
log-sum-exp of a fused kernel, the SwiGLU intermediates), times the layers not checkpointed; a
checkpointed layer keeps only its input. Then the loss: 16-bit logits, their fp32 upcast, and
cross-entropy's fp32 log-probabilities. Under FSDP's mixed precision the stream is 16-bit; under
ZeRO-3 DeepSpeed's own linear function saves its fp32 input and no 16-bit weight copy. Blocks the
analytic model does not know carry measured activations (`launcher/activations.py`), which these
functions read from the shape. Notation: b micro-batch, s sequence, c compute-dtype bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.estimate_finetune import (
    adapter_grad_per_token,
    adapter_saved_per_token,
    first_adapter_stage,
    method_sizes,
)
from launcher.estimate_levers import logit_tokens
from launcher.layer_fits import compute_mode
from launcher.model_shape import ModelShape
from trainer.core.step_spec import StepSpec
from trainer.core.strategies import loss_chunk_tokens

# Decoder blocks the activation model describes (RMSNorm, rotary, SDPA, gated MLP), checked
# against traced steps in tests/launcher/test_estimate_trace.py
MODELLED_TYPES = ("llama", "mistral", "qwen2", "phi3", "gemma")


@dataclass(frozen=True)
class Micro:
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


def layer_activation_bytes(shape: ModelShape, m: Micro) -> int:
    """What autograd keeps for one decoder layer that is not checkpointed, its input included:
    the analytic block where it describes the model, else what `launcher/activations.py`
    measured from the model's own code (or bounded)."""
    if shape.activations is not None:
        return shape.activations.layer_bytes(mode_of(m), m.b, m.s)
    return analytic_layer_bytes(shape, m)


def layer_backward_bytes(shape: ModelShape, m: Micro) -> int:
    """What a layer's backward allocates beyond its saved tensors and its parameters'
    gradients: the gradients of its activations (measured for blocks the analytic model does
    not know, against the traced step: launcher/activations.py)."""
    if shape.activations is not None:
        return shape.activations.backward_bytes(mode_of(m), m.b, m.s)
    return 2 * m.c * m.tokens * shape.intermediate_size + 4 * m.tokens * shape.hidden_size


def mode_of(m: Micro) -> str:
    """The compute mode a measured activation model is keyed by (launcher/layer_fits.py)."""
    return compute_mode(m.c, m.autocast)


def shared_bytes(shape: ModelShape, m: Micro) -> int:
    """What every layer reads and the layers save once for all: rotary cos and sin."""
    if shape.activations is not None:
        return shape.activations.shared_bytes(mode_of(m), m.b, m.s)
    return 2 * m.r * m.b * m.s * shape.head_dim


def analytic_layer_bytes(shape: ModelShape, m: Micro) -> int:
    """Llama-style block as transformers runs it (llama, mistral, qwen2): two RMSNorms, rotary
    q/k, SDPA, SwiGLU MLP, two residual adds. Traced per op under FakeTensorMode (trace.py).
    """
    return sum(_layer_parts(shape, m).values()) + m.adapter * m.tokens


def _layer_parts(shape: ModelShape, m: Micro) -> dict[str, int]:
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
        weights = c * matmul_params(shape)  # autocast's 16-bit weight copies, saved by matmuls
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


def first_layer_unsaved(shape: ModelShape, m: Micro) -> int:
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


def matmul_params(shape: ModelShape) -> int:
    return shape.num_layer_params - 2 * shape.hidden_size  # all but the two norm weights


def head_params(shape: ModelShape) -> int:
    """lm_head's weight (the embedding's when tied)."""
    return shape.vocab_size * shape.hidden_size


def final_bytes(shape: ModelShape, m: Micro) -> int:
    """The last hidden state, the final norm's saved tensors and lm_head's 16-bit input/weight."""
    if shape.activations is not None:
        return shape.activations.final_bytes(mode_of(m), m.b, m.s)
    t, h = m.tokens, shape.hidden_size
    if m.adapter:  # a frozen 16-bit final norm and output layer: the norm's fp32 input
        return 4 * t * h
    if m.autocast and m.zero3_linear:
        return m.r * t * h + 2 * 4 * t * h
    if m.autocast:
        return m.r * t * h + 4 * t * h + m.c * t * h + m.c * head_params(shape)
    if m.c == 4:
        return 3 * 4 * t * h
    return (4 + 2 * m.c) * t * h


def loss_bytes(shape: ModelShape, micro: int, seq: int, c: int) -> int:
    """End of forward: 16-bit logits, their fp32 copy and log-softmax's fp32 output."""
    rows = micro * (seq - 1)
    copy = 4 * rows * shape.vocab_size if c < 4 else 0
    return c * micro * seq * shape.vocab_size + copy + 4 * rows * shape.vocab_size


def offloaded_saved(
    shape: ModelShape, m: Micro, ckpt: frozenset[int], rotary: int, cache: int
) -> tuple[int, int]:
    """(saved, autocast cache) on the device with activation offload, from the end of forward
    on: the layers' saved tensors are on the host (a checkpointed layer's keyword inputs, the
    mask and the rotary tables, stay: the checkpoint holds them itself); autocast's 16-bit
    weight copies, which the non-checkpointed layers saved, stay cached until forward ends."""
    num_plain = shape.num_layers - len(ckpt)
    cached = m.autocast and not m.zero3_linear
    return rotary, cache + (num_plain * m.c * matmul_params(shape) if cached else 0)


def offloaded_activation_bytes(shape: ModelShape, m: Micro, ckpt: frozenset[int]) -> int:
    """Host bytes activation offload holds per rank: every layer's saved tensors."""
    num_ckpt = len(ckpt)
    plain = layer_activation_bytes(shape, m)
    return (shape.num_layers - num_ckpt) * plain + num_ckpt * m.r * m.tokens * shape.hidden_size


def micro_for(spec: StepSpec, shape: ModelShape) -> Micro:
    """One micro-batch of `spec` on one device. With adapters the frozen base computes in the
    compute dtype: a 16-bit stream and no autocast copies of its weights, as under FSDP's mixed
    precision."""
    row, ft, c = spec.row, spec.finetune, spec.compute_bytes
    sixteen_bit = row.engine == "fsdp" or ft.adapters
    private = row.engine != "fsdp" and c < 4  # peft casts an adapter's input under autocast
    chunk = loss_chunk_tokens(shape.vocab_size, spec.loss_chunk_tokens)
    return Micro(
        b=spec.micro_batch_size,
        s=spec.seq_len,
        c=c,
        r=c if sixteen_bit else 4,
        autocast=spec.precision != "fp32" and not sixteen_bit,
        masked=spec.packed,
        zero3_linear=row.zero_stage == 3 and not ft.adapters,
        chunk_tokens=chunk if spec.chunked_loss else None,
        offload=spec.offload_activations,
        adapter=adapter_saved_per_token(shape, ft, c, private=private),
        first_adapter_stage=first_adapter_stage(shape, ft),
        adapter_grad=adapter_grad_per_token(shape, ft, private=private),
        dequant=method_sizes(shape, ft, c).dequant if ft.method == "qlora" else 0,
    )


def activation_bytes(shape: ModelShape, m: Micro, ckpt: frozenset[int]) -> int:
    """What the breakdown lists as activations on the device: saved tensors of every layer
    (with activation offload: of the layer in flight and the next one, the rest is on the
    host), the final hidden state and the loss's tensors (with chunked loss: one chunk's)."""
    num_ckpt = len(ckpt)
    layers = (shape.num_layers - num_ckpt) * layer_activation_bytes(shape, m)
    if 0 not in ckpt:
        layers -= first_layer_unsaved(shape, m)
    layers += num_ckpt * m.r * m.tokens * shape.hidden_size
    if m.offload:
        layers = min(layers, 2 * layer_activation_bytes(shape, m))
    if m.chunk_tokens is None:
        loss = loss_bytes(shape, m.b, m.s, m.c)
    else:
        rows = logit_tokens(m.tokens, m.chunk_tokens)
        loss = (m.c + (4 if m.c < 4 else 0) + 4) * rows * shape.vocab_size
    return layers + final_bytes(shape, m) + loss
