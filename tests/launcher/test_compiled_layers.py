"""train.compile in the estimate: what a compiled decoder layer saves less than an eager one,
checked against torch's own partitioner on real transformers layers, and what that does to a
job's estimate."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
import transformers

from launcher.estimate.activations import with_activations
from launcher.estimate.compiled_layers import recomputed_bytes
from launcher.estimate.compiled_trace import measure_compiled_saving
from launcher.estimate.peak import estimate
from launcher.estimate.saved_tensors import saved_point
from launcher.estimate.shape import model_shape
from trainer.core.config import FinetuneConfig, LoraConfig, ModelConfig, build_config
from trainer.core.step_spec import Finetune, StepSpec
from trainer.model.finetune import apply_finetune

HIDDEN, INTERMEDIATE = 256, 640
QV = LoraConfig(r=8, target_modules=["q_proj", "v_proj"])  # where the adapters sit: no matter
MODELS = {
    "llama": transformers.LlamaForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
}


def _llama_1b():
    return model_shape(ModelConfig(name_or_path="meta-llama/Llama-3.2-1B"))


def _saved_bytes(layer, x, rotary, mask, autocast: bool) -> int:
    """Bytes of the tensors one forward of `layer` saves for backward, less its parameters and
    the inputs every layer shares (rotary tables, mask)."""
    shared = [*layer.parameters(), *rotary, *([] if mask is None else [mask])]
    skip = {t.untyped_storage().data_ptr() for t in shared}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    cast = torch.autocast("cpu", torch.bfloat16) if autocast else contextlib.nullcontext()
    with cast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, position_embeddings=rotary, attention_mask=mask)
    return sum(seen.values())


@pytest.mark.parametrize(
    ("model_type", "mode", "method", "masked"),
    [("llama", "bf16", "full", False), ("llama", "autocast", "full", True),
     ("llama", "fp32", "full", False), ("mistral", "bf16", "full", True),
     ("qwen2", "autocast", "full", False), ("llama", "bf16", "lora", True),
     ("qwen2", "fp32", "lora", False), ("mistral", "bf16", "qlora", False)],
)  # fmt: skip
def test_recomputed_bytes_are_what_torchs_partitioner_recomputes(model_type, mode, method, masked):
    """The engine compiles each layer with inductor, which partitions forward and backward with
    AOTAutograd's min-cut partitioner; the `aot_eager_decomp_partition` backend runs the same
    decompositions and partition without generating kernels. Adapters as the engine applies
    them (16-bit ones under bf16_pure; QLoRA's base quantised by bitsandbytes)."""
    torch.manual_seed(0)
    cls = MODELS[model_type]
    config = cls.config_class(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=1, vocab_size=64, attn_implementation="sdpa",
    )  # fmt: skip
    model = cls(config)
    if method == "full":
        model = model.to(torch.bfloat16 if mode == "bf16" else torch.float32)
    else:
        ft = FinetuneConfig(
            method=method, lora=LoraConfig(r=8, target_modules=["q_proj", "v_proj"])
        )
        model = apply_finetune(model, ft, "bf16_pure" if mode == "bf16" else mode, seed=0).model
    dtype = torch.float32 if mode in ("fp32", "autocast") else torch.bfloat16
    b, s = 2, 48
    x = torch.randn(b, s, HIDDEN, dtype=dtype, requires_grad=True)
    rotary = model.model.rotary_emb(x, torch.arange(s).expand(b, s))
    mask = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s) if masked else None
    layer = model.model.layers[0]
    autocast = mode == "autocast"
    eager = _saved_bytes(layer, x, rotary, mask, autocast)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager_decomp_partition")
    saved = _saved_bytes(compiled, x, rotary, mask, autocast)
    c = 4 if mode == "fp32" else 2
    shape = replace(_llama_1b(), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE)
    less = recomputed_bytes(shape, b, s, c, autocast, adapters=method != "full")
    assert eager - saved == less


def test_a_compiled_job_is_estimated_with_the_compiled_layers_saved_set():
    """Without checkpointing every layer saves less, with 16-bit adapters too; DeepSpeed's rungs
    run eagerly, and fp32 adapters on a 16-bit base (peft's casts) and adapter dropout are
    counted as eager layers (an over-count), so none of those changes."""
    shape = _llama_1b()
    spec = StepSpec("single", 1, 2, 1024, "none", precision="bf16_pure")
    eager = estimate(shape, spec)
    compiled = estimate(shape, replace(spec, compiled_layers=True))
    less = recomputed_bytes(shape, 2, 1024, 2, False)
    acts = eager.device_breakdown["activations"] - compiled.device_breakdown["activations"]
    assert acts == shape.num_layers * less
    assert compiled.peak_tensor_bytes < eager.peak_tensor_bytes
    lora = replace(spec, finetune=Finetune(method="lora"))
    as_compiled = estimate(shape, replace(lora, compiled_layers=True))
    assert as_compiled.peak_tensor_bytes < estimate(shape, lora).peak_tensor_bytes
    for other in (
        replace(spec, strategy="zero3", world_size=2, precision="bf16"),
        replace(lora, precision="bf16"),
        replace(lora, finetune=Finetune(method="lora", dropout=0.05)),
    ):
        as_compiled = estimate(shape, replace(other, compiled_layers=True))
        assert as_compiled.peak_tensor_bytes == estimate(shape, other).peak_tensor_bytes


TINY = {
    "vocab_size": 64, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
}  # fmt: skip


def test_the_measured_saving_is_the_closed_form_where_both_exist():
    """The measurement for blocks without a closed form (forwards under fake tensors, eager and
    compiled) gives Llama's closed form exactly, at points it was not fitted at too."""
    fits = measure_compiled_saving({**TINY, "model_type": "llama"}, 48, "fp32")
    shape = replace(_llama_1b(), hidden_size=64, intermediate_size=160)
    for b, s in ((1, 24), (3, 40), (2, 256)):
        assert fits["fp32"].bytes(b, s) == recomputed_bytes(shape, b, s, 4, False)


def test_a_block_without_a_closed_form_is_measured_and_counted(tmp_path):
    """gemma's compiled partition differs from Llama's (its GeLU, its norms' 1 + weight): the
    plan measures it once (cached) and every layer of the estimate saves that much less."""
    gemma = {**TINY, "model_type": "gemma", "head_dim": 16}
    cfg = build_config({
        "model": {"config": gemma}, "data": {"path": "x", "seq_len": 48},
        "train": {"global_batch_size": 2, "compile": True}, "precision": "fp32",
    })  # fmt: skip
    shape = with_activations(model_shape(cfg.model), cfg, cache_dir=tmp_path)
    fit = shape.compiled_saving["fp32"]
    eager = saved_point(gemma, "fp32", "fp32", "sdpa", 3, 40)[0]
    compiled = saved_point(gemma, "fp32", "fp32", "sdpa", 3, 40, compiled=True)[0]
    (kind,) = eager  # its two layers are of one kind
    assert fit.bytes(3, 40) == eager[kind] - compiled[kind]  # a point the fit did not go through
    llama_of_its_sizes = recomputed_bytes(replace(shape, model_type="llama"), 3, 40, 4, False)
    assert fit.bytes(3, 40) > llama_of_its_sizes
    spec = StepSpec("single", 1, 3, 40, "none", precision="fp32")
    acts = estimate(shape, spec).device_breakdown["activations"]
    as_compiled = estimate(shape, replace(spec, compiled_layers=True))
    assert acts - as_compiled.device_breakdown["activations"] == 2 * fit.bytes(3, 40)
    assert list(tmp_path.glob("*.json"))  # measured once: the next plan reads it
