"""The planner and `stream` (layers streamed from host memory, trainer/backends/stream.py): the
full fine-tunes it is for, from defaults (strategy: auto), and its predicted lead over ZeRO-3
with parameters on the host."""

from __future__ import annotations

import pytest

from launcher.plan.hardware import Hardware
from launcher.plan.planner import make_plan
from trainer.core.config import ConfigError, build_config, parse_size

_LLAMA = {"model_type": "llama", "num_attention_heads": 64, "num_key_value_heads": 8,
          "vocab_size": 128256, "tie_word_embeddings": False,
          "max_position_embeddings": 131072}  # fmt: skip
_QWEN = {"model_type": "qwen2", "hidden_size": 5120, "num_attention_heads": 40,
         "num_key_value_heads": 8, "vocab_size": 152064, "tie_word_embeddings": False,
         "max_position_embeddings": 32768}  # fmt: skip
SHAPES = {
    "qwen2.5-32b": {**_QWEN, "intermediate_size": 27648, "num_hidden_layers": 64},
    "qwen2.5-14b": {**_QWEN, "intermediate_size": 13824, "num_hidden_layers": 48},
    "llama-3.1-70b": {**_LLAMA, "hidden_size": 8192, "intermediate_size": 28672,
                      "num_hidden_layers": 80},
    "dense-90b": {**_LLAMA, "hidden_size": 10240, "intermediate_size": 28672,
                  "num_hidden_layers": 80},
}  # fmt: skip


def _plan(model: str, device_memory: str, host: str, peak_flops: float = 989e12, **extra):
    cfg = build_config({
        "model": {"config": SHAPES[model]},
        "data": {"path": "some/dataset", "seq_len": 2048},
        "precision": "bf16",
        **extra,
    })  # fmt: skip
    hw = Hardware(device="cuda", nodes=1, devices_per_node=1,
                  device_memory_bytes=parse_size(device_memory),
                  host_memory_bytes=parse_size(host), device_name="test GPU",
                  peak_flops=peak_flops)  # fmt: skip
    return make_plan(cfg, hw)


# H100-class (989 TFLOP/s) and, for the 80 GiB device, A100-class (312 TFLOP/s) peaks: at the
# planner's 100 TFLOP/s for a GPU it does not know, the 32B step is compute-bound on both
# offload rungs and `fsdp_offload` stays within the ladder's margin (docs/stream.md)
@pytest.mark.parametrize(
    ("model", "device_memory", "host", "peak_flops"),
    [("qwen2.5-32b", "80GiB", "768GiB", 989e12), ("qwen2.5-32b", "80GiB", "768GiB", 312e12),
     ("llama-3.1-70b", "141GiB", "1.5TiB", 989e12), ("dense-90b", "141GiB", "2TiB", 989e12)],
)  # fmt: skip
def test_a_full_fine_tune_past_one_device_streams_its_layers(
    model, device_memory, host, peak_flops
):
    plan = _plan(model, device_memory, host, peak_flops)
    assert plan.strategy == "stream", plan.reasons
    assert any(r.startswith("stream fits") for r in plan.reasons), plan.reasons
    assert any("resident" in r for r in plan.reasons), plan.reasons
    why = [r for r in plan.reasons if r.startswith("stream's step is the slower of compute")]
    assert len(why) == 1 and "host AdamW" in why[0], plan.reasons


def test_stream_is_predicted_half_again_faster_than_zero3_with_parameters_on_the_host():
    plan = _plan("qwen2.5-14b", "80GiB", "1TiB")
    rungs = {a.strategy: a for a in plan.alternatives}
    stream, zero3 = rungs["stream"], rungs["zero3_offload_params"]
    assert plan.strategy == "stream" and stream.fits and zero3.fits, rungs
    assert zero3.relative_step_time / stream.relative_step_time >= 1.5, (stream, zero3)


def test_a_forced_stream_with_checkpointing_other_than_full_is_one_line_naming_the_key():
    with pytest.raises(ConfigError) as err:
        _plan("qwen2.5-14b", "80GiB", "1TiB", strategy="stream",
              memory={"activation_checkpointing": "none"})  # fmt: skip
    line = str(err.value)
    assert "\n" not in line and "memory.activation_checkpointing" in line, line
    assert "stream recomputes every layer" in line and "full or auto" in line, line
