"""What `train.compile: true` changes in what a decoder layer saves for its backward.

The engine compiles each decoder layer (`trainer/model/build.py` `apply_compile`); AOTAutograd
splits the compiled layer into a forward and a backward graph with its min-cut partitioner, which
saves the outputs of the matrix products and attention and recomputes cheap elementwise work in
backward instead of keeping its results. For the Llama-style block (llama, mistral, qwen2 as
transformers writes them) that is exactly, per token: one of the SwiGLU's four intermediates
(silu(gate), recomputed from the gate) and the norms' fp32 intermediates; under autocast also
the residual stream's fp32 copy and two 16-bit casts. Checked against torch's own partitioner on
real layers in tests/launcher/test_compiled_layers.py. A checkpointed layer recomputes its
compiled forward in backward, so the layer in flight saves the same less.

Any other block is measured for full fine-tuning (`launcher/estimate/compiled_trace.py`: the
same forwards under fake tensors, eager and compiled, fitted). Where the partition has not been
checked (adapters on other blocks; LoRA's fp32 adapters on a 16-bit base, whose inputs peft
casts once per adapter and compile once per input; adapter dropout, whose masks compile
regenerates; op-level checkpointing, tiled MLP, Ulysses; a block dynamo cannot compile under
fake tensors), the estimate counts the eager layer: at most an over-count.
"""

from __future__ import annotations

from launcher.estimate.layer_fits import compute_mode
from launcher.estimate.shape import ModelShape
from trainer.core.step_spec import StepSpec

# blocks whose compiled partition the estimate counts (checked per op against torch's partitioner)
COMPILED_TYPES = ("llama", "mistral", "qwen2")


def closed_form(shape: ModelShape) -> bool:
    """Whether `recomputed_bytes` knows this block in closed form (else it is measured)."""
    return shape.model_type in COMPILED_TYPES and shape.activations is None


def counts_compiled(spec: StepSpec, shape: ModelShape) -> bool:
    """Whether the estimate counts `spec`'s layers as compiled: the engine compiles them (every
    rung but DeepSpeed's, whose parameter gathering dynamo cannot trace) and the partition of
    this block and setting is a checked one: Llama's in closed form (with adapters in the
    compute dtype too, without dropout, whose masks compile regenerates), any other block's
    measured for full fine-tuning."""
    ft = spec.finetune
    if ft.adapters:
        in_compute_dtype = spec.precision in ("bf16_pure", "fp32")
        known = closed_form(shape) and in_compute_dtype and ft.dropout == 0
    else:
        known = closed_form(shape) or shape.compiled_saving is not None
    checked = (
        known and not spec.checkpoint_ops and not spec.tiled_mlp and spec.sequence_parallel == 1
    )
    return spec.compiled_layers and spec.row.engine != "deepspeed" and checked


def recomputed_bytes(
    shape: ModelShape, b: int, s: int, c: int, autocast: bool, adapters: bool = False
) -> int:
    """What one compiled layer saves less than the eager one (more where negative) for `b`
    sequences of `s` tokens (c: compute dtype bytes). In closed form: silu(gate) and the norms'
    fp32 intermediates (a frozen 16-bit block with LoRA's adapters keeps one [t, h] fp32 tensor
    less, an fp32 one none); under autocast the stream's fp32 copy and two 16-bit casts too.
    Otherwise measured."""
    if not closed_form(shape):
        fit = (shape.compiled_saving or {}).get(compute_mode(c, autocast))
        return fit.bytes(b, s) if fit else 0  # negative where compile saves more (gpt-oss)
    h = shape.hidden_size
    if adapters:
        norms = 4 * h if c < 4 else 0
    else:
        norms = 8 * h + ((4 + 2 * c) * h if autocast else 0)
    return b * s * (c * shape.intermediate_size + norms)


def compiled_reason(spec: StepSpec, shape: ModelShape) -> str:
    """How the plan counts `train.compile`'s layers, in words."""
    if spec.row.engine == "deepspeed":
        return f"train.compile is not applied under {spec.strategy}: its layers run eagerly"
    if counts_compiled(spec, shape):
        how = (
            "silu(gate) and the norms' fp32 intermediates recomputed in backward"
            if closed_form(shape)
            else "measured once under fake tensors, cached"
        )
        return f"train.compile: each layer counts what AOTAutograd's partition saves ({how})"
    return (
        "train.compile: the layers are counted as eager ones (the compiled partition of this "
        "block, method or lever is not checked), at most an over-count"
    )
