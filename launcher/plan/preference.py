"""What a plan says of a preference objective (docs/preference.md): micro-batches count pairs
(two sequences each: the estimate and the cost model size them so, trainer/core/step_spec.py
`num_sequences`), and where DPO's reference log-probs come from (`reference` in the plan)."""

from __future__ import annotations

from dataclasses import replace

from launcher.plan.planner import Plan
from trainer.core.config import JobConfig
from trainer.core.methods import REFERENCES, reference_source

# A training step is a forward and a backward (about twice the forward): a no-grad forward of
# the same tokens is about a third of it
_FORWARD_SHARE = 1 / 3


def with_reference(cfg: JobConfig, plan: Plan) -> Plan:
    """The plan with its `reference` and the reasons of a preference objective (as is for sft)."""
    if not cfg.objective.preference:
        return plan
    objective = cfg.objective.type
    source = reference_source(objective, cfg.finetune.method)
    pairs = (
        f"micro-batches count pairs: {plan.micro_batch_size} pair(s) = "
        f"{2 * plan.micro_batch_size} sequences of {cfg.data.seq_len} tokens per forward"
    )
    return replace(
        plan,
        reference=source or "none",
        reasons=[*plan.reasons, pairs, _reference_reason(cfg, plan, source)],
    )


def _reference_reason(cfg: JobConfig, plan: Plan, source: str | None) -> str:
    objective = cfg.objective.type
    if source is None:
        return f"reference: none ({objective} needs no reference model)"
    if source == "adapters_off":
        return (
            f"reference ({objective}): {REFERENCES[source]}, one no-grad forward per micro-batch "
            "before the policy's (no copy of the weights; its activations are freed before the "
            "policy's forward, so the peak is the training step's); counted in the step time"
        )
    per_thousand_s = plan.step_time_s * _FORWARD_SHARE * 1000 / cfg.train.global_batch_size
    return (
        f"reference ({objective}): precomputed, one no-grad forward of every pair with the "
        f"initial weights before step 1 (about {per_thousand_s:.3g} s per 1,000 pairs at the "
        "predicted rate), cached beside the tokenised data and read by pair index (16 bytes a "
        "pair per device); the base with adapters off needs lora/qlora, and a frozen copy "
        "placed like the policy is not built"
    )
