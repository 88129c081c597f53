"""The estimate of architectures the analytic block does not describe, against the traced step.

The bar: within 2% median and 5% max of the traced peak. The full grid (nine types, two
sizes, single and fsdp x4, micro-batch 1 and 4, checkpointing none and full: 144 cases) is
`python -m bench.models_trace` (its numbers are in docs/models.md); CI runs two types that
stand for the rest, sliding and global attention layers (gemma3_text) and a mixture of experts
(qwen3_moe), each in two cases that put the peak in different phases (gpt_neox is planned in
tests/launcher/test_activations.py).
"""

from __future__ import annotations

import json
import statistics

import pytest

from bench.models_trace import measured_shape, relative_error, sized_config
from launcher.estimate.shape import shape_of

COVERING = {
    "gemma3_text": ((("fsdp", 4), 1, "full"), (("single", 1), 4, "none")),
    "qwen3_moe": ((("single", 1), 4, "full"), (("fsdp", 4), 1, "none")),
}


@pytest.fixture(autouse=True)
def _own_caches(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def test_measured_activations_put_the_estimate_within_the_band_of_the_trace():
    errors = {}
    for model_type, cases in COVERING.items():
        config = sized_config(model_type, "small")
        shape = measured_shape(config)
        assert shape.activations.source == "traced"
        for case in cases:
            errors[(model_type, case)] = relative_error(config, shape, case)[0]
    assert max(abs(e) for e in errors.values()) <= 0.05, errors
    assert statistics.median(abs(e) for e in errors.values()) <= 0.02, errors


def test_an_moe_shape_counts_every_expert_for_memory_and_the_routed_ones_for_compute():
    shape = shape_of(json.dumps(sized_config("qwen3_moe", "small"), sort_keys=True))
    assert shape.num_experts == 4 and shape.experts_per_token == 2
    experts = shape.num_params - shape.num_compute_params  # the half a token does not use
    # 2 layers x 4 experts x (gate, up, down) x hidden 64 x moe width 64; 2 of 4 unused
    assert experts == 2 * 4 * 3 * 64 * 64 // 2


@pytest.mark.parametrize("rung,precision", [(("single", 1), "fp32"), (("fsdp", 2), "bf16")])
def test_the_experts_multiply_traces_as_transformers_fallback_allocates(
    monkeypatch, rung, precision
):
    """Fake experts multiply through a stand-in that reads no values: before transformers 5.23
    the fallback's backward loops over the offsets' values, which a fake tensor has none of,
    and every MoE trace failed. A gpt-oss step traced with it peaks, phase by phase, where one
    traced through transformers' own fallback op does (on releases whose op has a fake
    backward, as this one)."""
    from transformers.integrations import moe

    from launcher.estimate import trace
    from trainer.core.step_spec import StepSpec

    if not hasattr(moe, "_grouped_mm_fallback_backward_fake"):
        pytest.skip("transformers' fallback has no fake backward here to compare with")
    config = sized_config("gpt_oss", "small")
    spec = StepSpec(*rung, 2, 64, "none", precision)
    calls = _counted(monkeypatch)
    ours = trace.trace_step(config, spec, attn_implementation="eager")
    assert len(calls) == 4  # 2 layers, each an up and a down projection
    monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda *a, **k: False)
    monkeypatch.setattr(trace, "moe_fake_kernels", trace.contextlib.nullcontext)
    theirs = trace.trace_step(config, spec, attn_implementation="eager")
    assert len(calls) == 4  # the stand-in was left out
    assert (ours.peak_bytes, ours.phases) == (theirs.peak_bytes, theirs.phases)


def test_compiled_experts_save_what_transformers_fallback_saves_without_a_graph_break(monkeypatch):
    """`train.compile`'s saving is measured by compiling layers under fake tensors. Before
    transformers 5.23 its fallback broke the graph at every experts multiply (a page of dynamo
    warnings per plan); the stand-in compiles whole, and opaque as the fallback, the min-cut
    partitioner saves the same bytes per layer (a stand-in it could see through was recomputed
    from, and read 31% less on gpt-oss-20b's shape)."""
    from torch._dynamo.utils import counters
    from transformers.integrations import moe

    from launcher.estimate import trace_patches
    from launcher.estimate.saved_tensors import saved_point

    config = sized_config("gpt_oss", "small")
    calls = _counted(monkeypatch)
    counters.clear()
    ours = saved_point(config, "autocast", "bf16", "sdpa", 2, 64, compiled=True)
    broke = {**counters["graph_break"], **counters["unimplemented"]}  # a failed compile too
    assert calls and not broke, list(broke)
    if not hasattr(moe, "_grouped_mm_fallback_backward_fake"):
        return  # transformers' fallback does not compile here to compare with
    monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda *a, **k: False)
    monkeypatch.setattr(trace_patches, "moe_fake_kernels", trace_patches.contextlib.nullcontext)
    theirs = saved_point(config, "autocast", "bf16", "sdpa", 2, 64, compiled=True)
    eager = saved_point(config, "autocast", "bf16", "sdpa", 2, 64, compiled=False)
    assert ours == theirs != eager


def _counted(monkeypatch) -> list[int]:
    """The calls of the experts' stand-in, from now on."""
    from launcher.estimate import trace_patches

    calls: list[int] = []
    multiply = trace_patches.experts_multiply
    monkeypatch.setattr(trace_patches, "experts_multiply",
                        lambda *a: calls.append(1) or multiply(*a))  # fmt: skip
    return calls
