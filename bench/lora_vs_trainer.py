"""Step time of LoRA on oomless `single` vs peft + the transformers Trainer on the same job.

Same model, same batches, same precision, same LoRA (rank, alpha, the decoder blocks' linear
layers), same AdamW hyper-parameters and clipping, same global batch; both sides hold the frozen
base in the compute dtype (oomless by `finetune.method: lora`; the Trainer side as the usual
recipe loads it: `dtype=bf16`, then `get_peft_model`, whose adapters are fp32). Each contender
runs in a process of its own (bench/contenders.py), they alternate in an order shuffled every
round, and the medians are compared. A second oomless process (`oomless_control`) runs beside
them as an A/A control: the ratio of two identical contenders says how finely this run can tell
two sides apart.

    python -m bench.lora_vs_trainer [--model llama-20m] [--rounds 10] [--steps 2] [--r 16] \
        [--precision bf16] [--device auto] [--no-control] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from bench.common import (
    add_step_args,
    build_hf_model,
    job_config,
    machine,
    make_batches,
    medians,
    paired_ratio,
    resolve_device,
)
from bench.contenders import Contender, add_sessions_arg, time_in_processes
from bench.engine_vs_plain import OPTIM, build_hf_trainer
from trainer.backends import BackendContext, build_backend
from trainer.core.config import FinetuneConfig
from trainer.model.build import HFModelFactory
from trainer.model.finetune import COMPUTE_DTYPES, build_factory, lora_target_modules
from trainer.step import train_step


def _finetune(args: argparse.Namespace) -> FinetuneConfig:
    return FinetuneConfig.model_validate(
        {"method": "lora", "lora": {"r": args.r, "alpha": 2 * args.r, "dropout": 0.0}}
    )


class OomlessLora:
    """The engine's per-step path on the `single` backend with `finetune.method: lora`."""

    def __init__(self, tmp: Path, args: argparse.Namespace, device: torch.device):
        cfg = job_config(
            tmp, args.model, "single", args.precision, args.micro, args.accum, args.seq, device
        )
        cfg = cfg.model_copy(update={"finetune": _finetune(args)})
        ctx = BackendContext(cfg, device, 0, 0, 1, args.precision, "none", args.micro, args.accum)
        self.backend = build_backend("single", ctx)
        factory = build_factory(HFModelFactory(cfg.model, seed=0), cfg)
        self.model = self.backend.setup(factory, OPTIM)
        self.device = device

    def run(self, batches: list[dict[str, torch.Tensor]], num_steps: int) -> None:
        for _ in range(num_steps):
            self.backend.set_lr(OPTIM.lr)
            train_step(self.model, self.backend, batches, self.device)


def peft_model(args: argparse.Namespace) -> torch.nn.Module:
    """What a peft user hands the Trainer: the base in the compute dtype, adapters in fp32."""
    import peft

    base = build_hf_model(args.model).to(COMPUTE_DTYPES[args.precision])
    lora = _finetune(args).lora
    config = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora_target_modules(base, "all-linear"),
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(base, config)


def build_oomless(args: argparse.Namespace, device: torch.device) -> Contender:
    tmp = tempfile.TemporaryDirectory()
    side = OomlessLora(Path(tmp.name), args, device)
    batches = make_batches(args.model, args.accum, args.micro, args.seq)
    return Contender(run=lambda n: side.run(batches, n), close=tmp.cleanup)


def build_peft_trainer(args: argparse.Namespace, device: torch.device) -> Contender:
    return build_hf_trainer(args, device, compile=False, build_model=lambda: peft_model(args))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-20m")
    add_step_args(p, rounds=10)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per contender per round")
    p.add_argument("--r", type=int, default=16, help="LoRA rank (alpha = 2r)")
    p.add_argument(
        "--no-control",
        action="store_true",
        help="leave out the second oomless process (the A/A control: how far two identical "
        "contenders' medians differ in this run)",
    )
    add_sessions_arg(p)
    args = p.parse_args()
    device = resolve_device(args.device)
    builds = {
        "oomless": (build_oomless, (args, device)),
        "peft_trainer": (build_peft_trainer, (args, device)),
    }
    if not args.no_control:
        builds["oomless_control"] = (build_oomless, (args, device))
    timings = time_in_processes(builds, args.rounds, args.steps, device, args.sessions)
    times, info = timings.round_s, timings.info
    tokens = args.micro * args.accum * args.seq
    med = {name: s / args.steps for name, s in medians(times).items()}
    ratio, q1, q3 = paired_ratio(times["oomless"], times["peft_trainer"])
    result = {
        "machine": machine(),
        "model": args.model,
        "lora_r": args.r,
        "precision": args.precision,
        "device": device.type,
        "micro_batch_size": args.micro,
        "grad_accum": args.accum,
        "seq_len": args.seq,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "round_s": times,
        "sessions": args.sessions,
        "session_of_round": timings.session_of_round,
        "median_step_s": med,
        "tokens_per_s": {name: tokens / s for name, s in med.items()},
        "oomless_over": {name: med["oomless"] / t for name, t in med.items() if name != "oomless"},
        "peft_trainer_optim": info["peft_trainer"]["optimizer"],
        "paired_ratio": {"median": ratio, "q1": q1, "q3": q3},
    }
    print(
        f"LoRA r={args.r} on single, {args.model}, {args.precision}, micro {args.micro} x accum "
        f"{args.accum}, seq {args.seq}: "
        + ", ".join(f"{n} {t:,.0f} tok/s" for n, t in result["tokens_per_s"].items())
        + f"; oomless step time / peft + Trainer {result['oomless_over']['peft_trainer']:.3f} "
        f"(paired {ratio:.3f}, quartiles {q1:.3f}-{q3:.3f})"
    )
    if "oomless_control" in med:
        control = result["oomless_over"]["oomless_control"]
        print(f"oomless / oomless in another process (A/A control) {control:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
