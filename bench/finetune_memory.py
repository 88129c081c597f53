"""The estimator's memory for each fine-tune method on the presets, and beside torchtune's table.

Pure arithmetic (launcher/estimate/peak.py, no torch, no GPU): one device, bf16, packed windows. Per
shipped preset and per method (full fine-tuning with fp32 AdamW or 8-bit moments, LoRA
r=16 on every linear, QLoRA), the model states (parameters + gradients + optimizer state) and the
device total of one step (micro-batch 1, sequence 2048, full activation checkpointing; what must
fit, runtime overhead included). Then Llama-3.1-8B as torchtune measured it on one RTX 4090
(batch 2, packed sequence 2048, activation checkpointing on; torchtune's README "Memory and
training speed"). docs/finetune.md shows the output.

    python -m bench.finetune_memory [--json out.json]
"""

from __future__ import annotations

import argparse
import json

from launcher.estimate.peak import estimate
from launcher.estimate.shape import model_shape
from trainer.core.config import ModelConfig
from trainer.core.hf_config import preset_index
from trainer.core.step_spec import Finetune, StepSpec
from trainer.core.units import GIB

METHODS = {
    "full, AdamW": Finetune(),
    "full, adamw_8bit": Finetune(optimizer="adamw_8bit"),
    "LoRA r=16": Finetune(method="lora"),
    "QLoRA r=16": Finetune(method="qlora"),
}
# torchtune's README, Llama-3.1-8B on one RTX 4090 (peak GiB): LoRA and QLoRA at batch 2, packed
# sequence 2048, activation checkpointing on; full fine-tuning with bf16 weights (no fp32
# master), paged 8-bit AdamW and the optimizer step fused into backward.
TORCHTUNE_4090 = {"LoRA r=16": 16.2, "QLoRA r=16": 7.4, "full, adamw_8bit": 18.9}


def one_step(hub_id: str, ft: Finetune, micro: int = 1, seq: int = 2048, **kw) -> dict:
    shape = model_shape(ModelConfig(name_or_path=hub_id))
    est = estimate(
        shape,
        StepSpec(
            strategy="single",
            world_size=1,
            devices_per_node=1,
            micro_batch_size=micro,
            seq_len=seq,
            activation_checkpointing="full",
            precision="bf16",
            grad_accum=1,
            **kw,
            finetune=ft,
        ),
    )
    states = sum(est.device_breakdown[k] for k in ("params", "grads", "optimizer"))
    return {
        "params": shape.num_params,
        "model_states_gib": round(states / GIB, 2),
        "peak_tensor_gib": round(est.peak_tensor_bytes / GIB, 2),
        "device_total_gib": round(est.device_total_bytes / GIB, 2),
    }


def presets() -> dict[str, dict[str, dict]]:
    hubs = {}
    for hub_id, file in preset_index().items():
        hubs.setdefault(file, hub_id)  # one hub id per preset
    return {
        hub_id: {name: one_step(hub_id, ft) for name, ft in METHODS.items()}
        for hub_id in sorted(hubs.values())
    }


def torchtune_comparison() -> dict[str, dict]:
    out = {}
    for name, published in TORCHTUNE_4090.items():
        ours = one_step("meta-llama/Llama-3.1-8B", METHODS[name], micro=2)
        chunked = one_step("meta-llama/Llama-3.1-8B", METHODS[name], micro=2, chunked_loss=True)
        out[name] = {"torchtune_gib": published, "ours": ours, "ours_chunked_loss": chunked}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    args = p.parse_args()
    results = {"presets": presets(), "torchtune_4090": torchtune_comparison()}
    print("| model | " + " | ".join(METHODS) + " |")
    print("|---|" + "---|" * len(METHODS))
    for hub_id, row in results["presets"].items():
        cells = [f"{r['model_states_gib']:.1f} / {r['device_total_gib']:.1f}" for r in row.values()]
        print(f"| {hub_id} | " + " | ".join(cells) + " |")
    print()
    print("| Llama-3.1-8B, 1x RTX 4090, batch 2, seq 2048 | torchtune | oomless | + chunked loss |")
    print("|---|---|---|---|")
    for name, r in results["torchtune_4090"].items():
        ours, chunked = r["ours"], r["ours_chunked_loss"]
        states = ours["model_states_gib"]
        print(f"| {name} | {r['torchtune_gib']} | {ours['device_total_gib']:.1f} "
              f"(states {states:.1f}) | {chunked['device_total_gib']:.1f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
