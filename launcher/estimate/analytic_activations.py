"""What one micro-batch's activations take on one device: the analytic decoder block. Pure
arithmetic (docs/memory.md has the formulas and their sources).

What autograd saves per decoder layer for the micro-batch (RMSNorm inputs kept in fp32, the
16-bit inputs autocast makes for every projection, rotary q/k, the attention output and
log-sum-exp of a fused kernel, the SwiGLU intermediates), times the layers not checkpointed; a
checkpointed layer keeps only its input. Then the loss: 16-bit logits, their fp32 upcast, and
cross-entropy's fp32 log-probabilities. Under FSDP's mixed precision the stream is 16-bit; under
ZeRO-3 DeepSpeed's own linear function saves its fp32 input and no 16-bit weight copy. Blocks the
analytic model does not know carry measured activations (`launcher/estimate/activations.py`), which
these functions read from the shape. The exact levers: with chunked loss
(`trainer/memory/chunked_loss.py`) the logits, their fp32 copy and the loss's tensors exist for one
chunk of tokens at a time, in forward and again in backward; with activation offload
(`trainer/memory/offload.py`) what the layers save waits in host memory, and the device keeps the
layer in flight and the next one. Notation: b micro-batch, s sequence, c compute-dtype bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.estimate.attention_kernels import block_mask_bytes, layer_flash_bytes
from launcher.estimate.compiled_layers import counts_compiled, recomputed_bytes
from launcher.estimate.layer_fits import compute_mode
from launcher.estimate.methods import adapter_terms
from launcher.estimate.shape import ModelShape
from trainer.core.errors import ConfigError
from trainer.core.step_spec import StepSpec
from trainer.core.strategies import checkpointed_layers, loss_chunk_tokens

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
    ckpt: frozenset[int] = frozenset()  # the decoder layers activation checkpointing wraps
    # ZeRO-3 builds the model in deepspeed.zero.Init, which swaps F.linear for its own autograd
    # function: it saves the linear's input as given (fp32 under autocast) and the parameter
    # itself (re-gathered in backward), so no 16-bit weight copy is saved or cached
    zero3_linear: bool = False
    chunk_tokens: int | None = None  # chunked loss: tokens per chunk
    offload: bool = False  # activation offload: the layers' saved tensors wait on the host
    adapter: int = 0  # LoRA: bytes per token a block's adapters add/drop (methods.py)
    first_adapter_stage: int = -1  # LoRA: where in the first block the first adapter is
    adapter_grad: int = 0  # LoRA: bytes per token of fp32 input gradients in a block's backward
    dequant: int = 0  # QLoRA: one 4-bit weight dequantised for a matmul
    sp: int = 1  # sequence parallel: `s` is this rank's slice of a sequence of s * sp tokens
    mlp_chunk: int | None = None  # tiled MLP: tokens of each sequence per chunk
    block_mask: bool = False  # flex_attention on packed windows: a sparse block mask
    ops: bool = False  # op-level checkpointing: a checkpointed layer keeps its matmuls' outputs
    flash: bool = False  # FlashAttention-2's backward buffers (attention_kernels.py)
    compiled: bool = False  # train.compile: the partition's saved set (compiled_layers.py)

    @property
    def whole_seq(self) -> int:  # attention's sequence: the whole one under Ulysses
        return self.s * self.sp

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
    the analytic block where it describes the model, else what `launcher/estimate/activations.py`
    measured from the model's own code (or bounded); compiled, less what it recomputes."""
    less = recomputed_bytes(shape, m.b, m.s, m.c, m.autocast, m.frozen_base) if m.compiled else 0
    if shape.activations is not None:
        return shape.activations.layer_bytes(mode_of(m), m.b, m.s, m.masked) - less
    return analytic_layer_bytes(shape, m) - less


def layer_backward_bytes(shape: ModelShape, m: Micro) -> int:
    """What a layer's backward allocates beyond its saved tensors and its parameters'
    gradients: the gradients of its activations (measured for blocks the analytic model does
    not know, against the traced step: launcher/estimate/activations.py)."""
    if shape.activations is not None:
        return shape.activations.backward_bytes(mode_of(m), m.b, m.s)
    if m.mlp_chunk is not None:  # the MLP's gradients one chunk at a time; a recomputed
        # norm's fp32 input (and 16-bit normalised one) again while its backward runs
        # (LoRA's frozen norms: counted as before, neither the savings nor this)
        again = NORM_RECOMPUTED + (m.c if m.r == m.c < 4 else 0) if not m.adapter else 0
        return mlp_chunk_bytes(shape, m) + (4 + again) * m.tokens * shape.hidden_size
    return 2 * m.c * m.tokens * shape.intermediate_size + 4 * m.tokens * shape.hidden_size


def mode_of(m: Micro) -> str:
    """The compute mode a measured activation model is keyed by
    (launcher/estimate/layer_fits.py)."""
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
    if m.mlp_chunk is not None and not m.adapter:  # tiled: both norms recomputed in backward
        norms -= 2 * NORM_RECOMPUTED * t * h
    if m.sp > 1:  # Ulysses: k/v heads fewer than sp are repeated to sp before the exchange
        kv = max(shape.num_kv_heads, m.sp) * shape.head_dim
    repeated = m.masked and kv < q  # transformers repeats k/v for SDPA when a mask is given
    # under Ulysses SDPA holds heads / sp of the whole sequence: the same bytes as all heads of
    # the rank's slice; only the mask is the whole sequence's
    sdpa_inputs = 3 * c * t * q if repeated else c * t * (q + 2 * kv)
    attention = sdpa_inputs + c * t * q + 4 * m.b * shape.num_heads * m.s  # + out, log-sum-exp
    mask = c * m.b * m.whole_seq**2 if m.masked else 0  # SDPA turns the boolean mask into a bias
    mlp = 4 * c * t * i  # gate, silu(gate), up, their product
    if m.mlp_chunk is not None:  # tiled: each chunk keeps its input, recomputes the rest
        kept = m.r if m.autocast else c  # the second norm's output, the chunks' input
        mlp = kept * t * h - (2 * c * t * h if m.autocast else 0)  # gate/up's 16-bit inputs
    return {"stream": residual + norms + weights, "attention": attention + mask, "mlp": mlp}


# what a norm recomputed in backward (trainer/memory/tiled_mlp.py, with the tiled MLP) no longer
# saves, per token and hidden unit: its fp32 normalised input (fp32 stream: its fp32 product),
# less the 16-bit input it keeps where that is a tensor of its own (traced: 4 bytes either way)
NORM_RECOMPUTED = 4


def mlp_chunk_bytes(shape: ModelShape, m: Micro) -> int:
    """Tiled MLP: one chunk's intermediates, alive while it computes or is recomputed in
    backward (with their gradients); 0 without tiling."""
    if m.mlp_chunk is None:
        return 0
    rows = m.b * min(m.s, m.mlp_chunk)
    return 6 * m.c * rows * shape.intermediate_size + 2 * m.c * rows * shape.hidden_size


def all_to_all_bytes(shape: ModelShape, m: Micro) -> int:
    """Ulysses: the all-to-all buffers of one layer's attention, transient: q, k and v sent
    and received (their send copies and receive buffers alive together), or in backward their
    gradients; 0 without sequence parallelism. k/v heads fewer than sp are sent as they are, in
    rounds, to the ranks that share each (trainer/parallel/sequence.py): what is sent is
    kv heads' size, in backward twice that (the summed gradient and one round's part), what
    is received one head of the whole sequence, as many bytes as sp heads of the slice."""
    if m.sp == 1:
        return 0
    kv = shape.num_kv_heads * shape.head_dim
    received = max(shape.num_kv_heads, m.sp) * shape.head_dim
    sent = kv if shape.num_kv_heads >= m.sp else 2 * kv
    return m.c * m.tokens * (2 * shape.num_heads * shape.head_dim + 2 * (sent + received))


def first_layer_unsaved(shape: ModelShape, m: Micro) -> int:
    """LoRA: the first block's input needs no gradient, so nothing before its first adapter is
    saved: the first norm's fp32 input, then (adapters from o_proj on) the attention's tensors,
    (from gate/up on) the second norm's, (down_proj only) the MLP's. Compiled: not checked,
    counted as saved."""
    if m.first_adapter_stage < 0 or m.compiled:
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
        unsaved += min(3 * m.c * t * shape.intermediate_size, parts["mlp"])
    return unsaved


def matmul_params(shape: ModelShape) -> int:
    return shape.num_layer_params - 2 * shape.hidden_size  # all but the two norm weights


def final_bytes(shape: ModelShape, m: Micro) -> int:
    """The last hidden state, the final norm's saved tensors and lm_head's 16-bit input/weight."""
    if shape.activations is not None:
        return shape.activations.final_bytes(mode_of(m), m.b, m.s)
    t, h = m.tokens, shape.hidden_size
    if m.adapter:  # a frozen 16-bit final norm and output layer: the norm's fp32 input
        return 4 * t * h
    recomputed = NORM_RECOMPUTED * t * h if m.mlp_chunk is not None else 0
    return _final_norm_and_head_input(shape, m) - recomputed


def _final_norm_and_head_input(shape: ModelShape, m: Micro) -> int:
    t, h = m.tokens, shape.hidden_size
    if m.autocast and m.zero3_linear:
        return m.r * t * h + 2 * 4 * t * h
    if m.autocast:
        return m.r * t * h + 4 * t * h + m.c * t * h + m.c * shape.num_head_params
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
    return (shape.num_layers - num_ckpt) * plain + num_ckpt * checkpoint_kept(shape, m)[0]


def checkpoint_kept(shape: ModelShape, m: Micro) -> list[int]:
    """The tensors a checkpointed layer keeps between its forward and its backward: its input;
    at op level (`trainer/model/build.py` `save_matmuls_and_attention`) also the outputs of
    every other matrix product (Llama: q, v, gate and down) and of attention (its output and
    log-sum-exp), in the compute dtype. Those stay on the device under activation offload (the
    checkpoint caches them itself, past the saved-tensor hooks): only the input moves."""
    t, h, c = m.tokens, shape.hidden_size, m.c
    kept = [m.r * t * h]
    if m.ops:
        q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        products = [c * t * q, c * t * kv, c * t * shape.intermediate_size, c * t * h]
        kept += [*products, c * t * q, 4 * m.b * shape.num_heads * m.s]
    return kept


def pinned_bytes(num_bytes: int) -> int:
    """The pinned host block torch's caching host allocator gives a copy of `num_bytes`: the
    next power of two (its default rounding; the blocks stay cached for reuse)."""
    return 1 << max(0, num_bytes - 1).bit_length() if num_bytes else 0


def pinned_activation_bytes(shape: ModelShape, m: Micro, ckpt: frozenset[int]) -> int:
    """Pinned host memory activation offload holds per rank on a GPU: each saved tensor of
    `offloaded_activation_bytes` in a block of its own, rounded up as `pinned_bytes` says (a
    checkpointed layer saves only its input). Blocks the analytic model does not know: their
    measured bytes, doubled (each tensor rounds up by less than itself); so compiled ones."""
    num_ckpt = len(ckpt)
    kept = num_ckpt * pinned_bytes(checkpoint_kept(shape, m)[0])
    if shape.num_layers == num_ckpt:
        return kept
    if shape.activations is not None or m.compiled:
        return kept + 2 * (shape.num_layers - num_ckpt) * layer_activation_bytes(shape, m)
    plain = sum(pinned_bytes(n) for n in _layer_tensors(shape, m))
    return kept + (shape.num_layers - num_ckpt) * plain


def _layer_tensors(shape: ModelShape, m: Micro) -> list[int]:
    """The bytes of each tensor an analytic layer saves (`_layer_parts`, one by one): the
    norms', attention's (q, k, v, output, log-sum-exp, a dense mask's bias) and the MLP's."""
    t, h, i, c = m.tokens, shape.hidden_size, shape.intermediate_size, m.c
    parts = _layer_parts(shape, m)
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    if m.sp > 1:
        kv = max(shape.num_kv_heads, m.sp) * shape.head_dim
    if m.masked and kv < q:
        kv = q
    attention = [c * t * q, c * t * kv, c * t * kv, c * t * q, 4 * m.b * shape.num_heads * m.s]
    if m.masked:
        attention.append(c * m.b * m.whole_seq**2)
    mlp = [c * t * i] * 4 if m.mlp_chunk is None else [parts["mlp"]]
    stream = parts["stream"]  # [t, h] tensors of 2 to 4 bytes, and the weights' copies
    hidden = [c * t * h] * (stream // (c * t * h)) + [stream % (c * t * h)]
    return [n for n in [*hidden, *attention, *mlp] if n > 0] + [m.adapter * m.tokens]


def micro_for(spec: StepSpec, shape: ModelShape) -> Micro:
    """One micro-batch of `spec` on one device. With adapters the frozen base computes in the
    compute dtype: a 16-bit stream and no autocast copies of its weights, as under FSDP's mixed
    precision. So does `precision: bf16_pure` (bf16 weights, no autocast)."""
    level = "full" if spec.checkpoint_ops else spec.activation_checkpointing  # ops: every layer
    ckpt = frozenset(checkpointed_layers(shape.num_layers, level, spec.checkpointed_layers))
    chunk = loss_chunk_tokens(shape.vocab_size, spec.loss_chunk_tokens)
    row, ft, c = spec.row, spec.finetune, spec.compute_bytes
    pure = spec.precision == "bf16_pure"
    # FSDP's mixed precision and `stream` compute from 16-bit weights: no autocast copies
    sixteen_bit = row.engine == "fsdp" or row.streams_layers or ft.adapters or pure
    # peft casts an adapter's input under autocast
    private = row.engine != "fsdp" and c < 4 and not pure
    adapters = adapter_terms(shape, ft, c, private)
    tile = (spec.mlp_chunk_tokens or shape.hidden_size) if spec.tiled_mlp else None
    if spec.checkpoint_ops and shape.activations is not None:
        kind = shape.model_type
        why = f"ops: op-level checkpointing is modelled for Llama-style blocks, not {kind}'s"
        raise ConfigError("memory.selective", why, "use memory.selective=layers, or auto")
    return Micro(
        b=spec.num_sequences,
        s=spec.local_seq_len,
        c=c,
        r=c if sixteen_bit else 4,
        autocast=spec.precision != "fp32" and not sixteen_bit,
        masked=spec.packed,
        ckpt=ckpt,
        zero3_linear=row.zero_stage == 3 and not ft.adapters,
        chunk_tokens=chunk if spec.chunked_loss else None,
        offload=spec.offload_activations,
        adapter=adapters.saved_per_token,
        first_adapter_stage=adapters.first_stage,
        adapter_grad=adapters.grad_per_token,
        dequant=adapters.dequant,
        sp=spec.sequence_parallel,
        mlp_chunk=tile,
        block_mask=spec.block_mask,
        ops=spec.checkpoint_ops,
        flash=spec.flash_attention,
        compiled=counts_compiled(spec, shape),
    )


def activation_bytes(shape: ModelShape, m: Micro, ckpt: frozenset[int]) -> int:
    """What the breakdown lists as activations on the device: saved tensors of every layer
    (with activation offload: of the layer in flight and the next one, the rest is on the
    host), the final hidden state and the loss's tensors (with chunked loss: one chunk's)."""
    num_ckpt = len(ckpt)
    layers = (shape.num_layers - num_ckpt) * layer_activation_bytes(shape, m)
    if 0 not in ckpt:
        layers -= first_layer_unsaved(shape, m)
    kept = checkpoint_kept(shape, m)
    layers += num_ckpt * sum(kept)
    if m.offload:  # the op-level outputs stay
        layers = min(layers, 2 * layer_activation_bytes(shape, m)) + num_ckpt * sum(kept[1:])
    if m.chunk_tokens is None:
        loss = loss_bytes(shape, m.b, m.s, m.c)
    else:
        rows = logit_tokens(m.tokens, m.chunk_tokens)
        loss = (m.c + (4 if m.c < 4 else 0) + 4) * rows * shape.vocab_size
    return layers + final_bytes(shape, m) + loss


def logit_tokens(tokens: int, chunk_tokens: int | None) -> int:
    """Tokens whose logits are alive at once: the micro-batch's, or one chunk's."""
    return tokens if chunk_tokens is None else min(tokens, chunk_tokens)


def chunked_head_backward_extra_bytes(
    tokens: int, hidden: int, head_params: int, c: int, r: int, autocast: bool
) -> int:
    """Transients of the chunked head's backward besides one chunk's loss tensors: a chunk's
    weight gradient next to the sum over the chunks so far (under autocast both 16-bit, and the
    recomputed chunk casts the weight again where the unchunked forward had saved its copy),
    and the chunks' hidden-state gradients joined into one tensor."""
    weight = (2 if autocast else 1) * c * head_params
    return weight + r * tokens * hidden


@dataclass(frozen=True)
class Forward:
    """What one micro-batch's forward leaves on the device for backward."""

    saved: int  # the layers' saved tensors (a checkpointed layer: its input), rotary tables
    per_layer: int  # one non-checkpointed layer's saved tensors
    kept_ckpt: int  # what a checkpointed layer keeps: its input (op level: and outputs)
    rotary: int  # cos and sin, shared by every layer
    mask: int  # the boolean block-causal mask of packed windows
    mask_kept: int  # ... kept into backward by the checkpoints, for their recompute
    cache: int  # autocast's 16-bit weight copies, cached until forward ends
    kept_ops: int = 0  # op level: the outputs a checkpointed layer keeps on the device anyway


def _forward_saved(shape: ModelShape, m: Micro, ckpt: frozenset[int]) -> Forward:
    num_ckpt = len(ckpt)
    per_layer = layer_activation_bytes(shape, m)
    kept_ckpt = sum(checkpoint_kept(shape, m))
    mask = m.b * m.whole_seq**2 if m.masked else 0
    if m.block_mask:
        mask = block_mask_bytes(m.b, m.whole_seq)
    rotary = shared_bytes(shape, m)
    saved = (shape.num_layers - num_ckpt) * per_layer + num_ckpt * kept_ckpt + rotary
    if 0 not in ckpt:
        saved -= first_layer_unsaved(shape, m)
    cached = m.autocast and not m.zero3_linear
    cache = num_ckpt * m.c * matmul_params(shape) if cached else 0
    if m.offload:  # the op-level outputs stay on the device
        saved, cache = offloaded_saved(shape, m, ckpt, rotary, cache)
        saved += num_ckpt * sum(checkpoint_kept(shape, m)[1:])
    # checkpoints keep the mask for their recompute; Ulysses caches it for the whole step
    mask_kept = mask if num_ckpt or m.sp > 1 else 0
    kept_ops = sum(checkpoint_kept(shape, m)[1:])
    return Forward(saved, per_layer, kept_ckpt, rotary, mask, mask_kept, cache, kept_ops)


@dataclass(frozen=True)
class Head:
    """The output layer and the loss: logits, their fp32 copy, the log-probabilities."""

    logits: int
    copy: int
    rows_v: int  # logit rows the loss reads, times the vocabulary
    backward: int  # the head's backward
    in_forward: int  # with chunked loss: the loss's tensors of one chunk, inside forward


def _head(shape: ModelShape, m: Micro) -> Head:
    t, v = m.tokens, shape.vocab_size
    lt = logit_tokens(t, m.chunk_tokens)
    logits = m.c * lt * v
    rows_v = (m.loss_rows if m.chunk_tokens is None else lt) * v
    copy = 4 * rows_v if m.c < 4 else 0
    backward = 2 * m.c * lt * v
    # with chunked loss each chunk is recomputed in backward: its logits, copy and loss again,
    # and the head's weight gradient summed over chunks (a frozen head has none)
    head_grad_params = 0 if m.frozen_base else shape.num_head_params
    cached = m.autocast and not m.zero3_linear
    extra = chunked_head_backward_extra_bytes(
        t, shape.hidden_size, head_grad_params, m.c, m.r, cached
    )
    if m.chunk_tokens is None:
        return Head(logits, copy, rows_v, backward, 0)
    return Head(logits, copy, rows_v, backward + logits + copy + 4 * rows_v + extra,
                copy + 4 * rows_v)  # fmt: skip


@dataclass(frozen=True)
class MicroActivations:
    """Every activation term of one micro-batch that the step's phases combine."""

    forward: Forward
    head: Head
    final: int  # the last hidden state, the final norm's tensors, the head's input
    layer_backward: int  # a layer's backward beyond its saved tensors: activation gradients
    forward_transient: int | None  # measured blocks: a layer's own transients in forward
    layer_transient: int  # Ulysses' all-to-all buffers, or one tiled MLP chunk, in a layer
    on_device: int  # what the breakdown lists as activations
    offloaded: int  # with activation offload: what waits on the host, per rank
    pinned: int  # ... and the pinned host memory it holds there (GPUs)


def micro_activations(shape: ModelShape, m: Micro) -> MicroActivations:
    """All of one micro-batch's activation terms, computed once."""
    measured = shape.activations
    transient = measured.forward_bytes(mode_of(m), m.b, m.s) if measured is not None else None
    return MicroActivations(
        forward=_forward_saved(shape, m, m.ckpt),
        head=_head(shape, m),
        final=final_bytes(shape, m),
        # attention's backward: the all-to-alls (the MLP's gradients freed), flash's buffers
        layer_backward=max(
            layer_backward_bytes(shape, m),
            all_to_all_bytes(shape, m) + 4 * m.tokens * shape.hidden_size,
            layer_flash_bytes(shape, m.b, m.s, m.c, m.r, m.sp) if m.flash else 0,
        ),
        forward_transient=transient,
        layer_transient=max(all_to_all_bytes(shape, m), mlp_chunk_bytes(shape, m)),
        on_device=activation_bytes(shape, m, m.ckpt),
        offloaded=offloaded_activation_bytes(shape, m, m.ckpt) if m.offload else 0,
        pinned=pinned_activation_bytes(shape, m, m.ckpt) if m.offload else 0,
    )
