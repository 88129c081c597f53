"""The estimate against the traced step for nine architectures.

    python -m bench.models_trace [--types gpt2,falcon] [--sizes small,medium] [--json out.json]

gpt_neox, gpt2, falcon, gemma3_text, qwen3, olmo2, mixtral, qwen3_moe and gpt_oss, built from their
own HF config classes at two small sizes (bench/all_models.py's tiny config, resized): for each,
the activations are measured as `oomless plan` measures them (launcher/estimate/activations.py, at
the grid's sequence length), then the analytic `peak_tensor_bytes` is compared with one real step of
the engine traced under fake tensors (launcher/estimate/trace.py) on single and fsdp x4, micro-batch
1 and 4, checkpointing none and full (bf16). Prints every case and the median and largest
absolute error. tests/launcher/test_models_trace.py runs a covering subset in CI.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from dataclasses import replace
from typing import Any

from trainer.core.step_spec import StepSpec

TYPES = ("gpt_neox", "gpt2", "falcon", "gemma3_text", "qwen3", "olmo2", "mixtral", "qwen3_moe",
         "gpt_oss")  # fmt: skip
SIZES = {
    "small": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "vocab_size": 256,
    },  # fmt: skip
    "medium": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "vocab_size": 512,
    },  # fmt: skip
}
SEQ_LEN = 256
CASES = tuple(itertools.product((("single", 1), ("fsdp", 4)), (1, 4), ("none", "full")))


def sized_config(model_type: str, size: str) -> dict[str, Any]:
    """The type's tiny config (bench/all_models.py) at `size`: only the keys it has."""
    from bench.all_models import tiny_config

    config = tiny_config(model_type)
    for key, value in SIZES[size].items():
        if key in config:
            config[key] = value
    if "layer_types" in config:
        layers = config["num_hidden_layers"]
        config["layer_types"] = (config["layer_types"] * layers)[:layers]
    return config


def measured_shape(config: dict[str, Any]):
    """The shape with the activations `oomless plan` would attach (measured at SEQ_LEN)."""
    from launcher.estimate.shape import shape_of
    from launcher.estimate.traced_activations import trace_layer_activations

    shape = shape_of(json.dumps(config, sort_keys=True))
    acts = trace_layer_activations(config, SEQ_LEN, "bf16")  # gpt_oss: eager, as it runs
    return replace(shape, activations=acts)


def relative_error(config: dict[str, Any], shape, case: tuple) -> tuple[float, str, str]:
    """(analytic - traced) / traced peak tensor bytes for one case, and each one's peak phase."""
    from launcher.estimate.peak import estimate
    from launcher.estimate.trace import trace_step

    (strategy, world), micro, ckpt = case
    common = {"strategy": strategy, "world_size": world, "micro_batch_size": micro,
              "seq_len": SEQ_LEN, "activation_checkpointing": ckpt}  # fmt: skip
    traced = trace_step(config, StepSpec(**common))
    est = estimate(
        shape, StepSpec(**common, devices_per_node=world, precision="bf16", grad_accum=1)
    )
    error = (est.peak_tensor_bytes - traced.peak_bytes) / traced.peak_bytes
    est_phase = max(est.phases, key=est.phases.get)
    traced_phase = max(traced.phases, key=lambda p: p[1])[0]
    return error, est_phase, traced_phase


def grid(types, sizes, cases=CASES) -> list[dict[str, Any]]:
    rows = []
    for model_type, size in itertools.product(types, sizes):
        config = sized_config(model_type, size)
        shape = measured_shape(config)
        for case in cases:
            error, est_phase, traced_phase = relative_error(config, shape, case)
            (strategy, world), micro, ckpt = case
            rows.append({"type": model_type, "size": size, "strategy": strategy, "world": world,
                         "micro": micro, "ckpt": ckpt, "error": error, "estimate_phase": est_phase,
                         "traced_phase": traced_phase})  # fmt: skip
            print(f"{model_type:12} {size:7} {strategy:6} x{world} micro {micro} {ckpt:4} "
                  f"{error:+6.1%}  ({est_phase} / {traced_phase})", flush=True)  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = grid(args.types.split(","), args.sizes.split(","))
    errors = [abs(r["error"]) for r in rows]
    print(f"{len(rows)} cases: median |error| {statistics.median(errors):.2%}, "
          f"max {max(errors):.2%}")  # fmt: skip
    for model_type in args.types.split(","):
        mine = [abs(r["error"]) for r in rows if r["type"] == model_type]
        print(f"  {model_type:12} median {statistics.median(mine):.2%}  max {max(mine):.2%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
