"""DPO step time of oomless `single` vs TRL's `DPOTrainer` on the same model and pairs, and the
first step's loss and log-probs of both on the same batch.

Same model (the bench's Llama shape with the demo's 45-token character vocabulary), same pairs
(random letters: a prompt of `--prompt` characters, a chosen and a rejected answer of `--answer`
each; every character one token, so no side pads), same beta (0.1), AdamW hyper-parameters,
clipping, micro-batch (pairs) and accumulation. The references differ as each tool's default for
a full fine-tune: oomless reads log-probs precomputed in one pass before step 1
(docs/preference.md); `DPOTrainer` runs a frozen copy's forward in every step (`trl`), or with
`precompute_ref_log_probs=True` reads its own precomputed pass (`trl_precomputed`). Each
contender runs in a process of its own (bench/contenders.py), alternating, medians compared.

    python -m bench.dpo_vs_trl [--rounds 10] [--steps 2] [--micro 4] [--accum 2] \
        [--prompt 63] [--answer 64] [--precision fp32] [--device auto] [--json out.json]
    python -m bench.dpo_vs_trl --first-step     # step 1's loss and log-probs, both sides
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.common import MODELS, machine, medians, paired_ratio, resolve_device
from bench.contenders import Contender, add_sessions_arg, time_in_processes
from bench.engine_vs_plain import OPTIM, HFTrainerStepper
from trainer.backends import BackendContext, build_backend
from trainer.core.config import build_config
from trainer.data import build_data, build_tokenizer
from trainer.model.build import HFModelFactory
from trainer.model.finetune import build_factory
from trainer.objectives import build_objective
from trainer.objectives.reference import build_reference
from trainer.runtime.oom import NO_FAULTS
from trainer.step import StepResult, train_step

TOKENIZER = Path(__file__).resolve().parents[1] / "configs" / "demo" / "tokenizer"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
BETA = 0.1


def write_pairs(path: Path, num_pairs: int, prompt: int, answer: int) -> Path:
    """{prompt, chosen, rejected} rows of random letters (seeded)."""
    rng = random.Random(0)

    def text(n: int) -> str:
        return "".join(rng.choice(LETTERS) for _ in range(n))

    rows = [
        {"prompt": text(prompt), "chosen": text(answer), "rejected": text(answer)}
        for _ in range(num_pairs)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    return {**MODELS[args.model], "vocab_size": 45, "pad_token_id": 0, "bos_token_id": 1,
            "eos_token_id": 2}  # fmt: skip


class OomlessDpo:
    """The engine's DPO step on `single`: a full fine-tune, the reference precomputed."""

    def __init__(self, tmp: Path, args: argparse.Namespace, device: torch.device, model: Any):
        pairs = write_pairs(tmp / "pairs.jsonl", args.micro * args.accum, args.prompt, args.answer)
        cfg = build_config(
            {
                "model": model,
                "data": {"path": str(pairs), "format": "preference",
                         "seq_len": args.prompt + args.answer + 2, "cache_dir": str(tmp / "c")},
                "objective": {"type": "dpo", "beta": BETA},
                "train": {"global_batch_size": args.micro * args.accum,
                          "micro_batch_size": args.micro},
                "precision": args.precision,
                "memory": {"activation_checkpointing": "none"},
                "strategy": "single",
                "hardware": {"device": device.type, "devices_per_node": 1},
            }
        )  # fmt: skip
        ctx = BackendContext(cfg, device, 0, 0, 1, args.precision, "none", args.micro, args.accum)
        self.backend = build_backend("single", ctx)
        factory = build_factory(HFModelFactory(cfg.model, seed=0), cfg)
        self.model = self.backend.setup(factory, OPTIM)
        data = build_data(cfg, build_tokenizer(cfg.model))
        share = (0, 1, args.micro)
        ref = build_reference(cfg, self.model, self.backend.compute_context, data, share, device)
        self.objective = build_objective(cfg, ref)
        self.batches = data.train.micro_batches(0, 0, 1, args.micro, args.micro * args.accum)
        self.device = device

    def run(self, num_steps: int) -> StepResult:
        for _ in range(num_steps):
            self.backend.set_lr(OPTIM.lr)
            result = train_step(
                self.model, self.backend, self.batches, self.device, NO_FAULTS, self.objective
            )
        return result


def trl_trainer(
    args: argparse.Namespace, pairs: Path, model: Any, precompute: bool, copies: int = 0
):
    """(TrainingArguments' kwargs, callback) -> TRL's DPOTrainer on the same pairs, repeated
    `copies` times (0: once per step; the Trainer samples its batches at random)."""

    def build(targs_kwargs: dict[str, Any], callback: Any) -> Any:
        from datasets import Dataset
        from transformers import AutoTokenizer
        from trl import DPOConfig, DPOTrainer

        rows = [json.loads(line) for line in pairs.read_text().splitlines()]
        config = DPOConfig(
            **targs_kwargs, beta=BETA, max_length=None, precompute_ref_log_probs=precompute
        )
        return DPOTrainer(
            model=model() if callable(model) else model,
            args=config,
            train_dataset=Dataset.from_list(rows * (copies or targs_kwargs["max_steps"])),
            processing_class=AutoTokenizer.from_pretrained(TOKENIZER),
            callbacks=[callback],
        )

    return build


def _inline(args: argparse.Namespace) -> dict[str, Any]:
    return {"config": model_config(args), "tokenizer": str(TOKENIZER)}


def _hf_model(args: argparse.Namespace) -> Any:
    """What a TRL user starts from: the HF model, fp32, seeded as the engine seeds its own."""
    cfg = build_config({"model": _inline(args), "data": {"path": "x/y"}})
    return HFModelFactory(cfg.model, 0).build("cpu")


def build_oomless(args: argparse.Namespace, device: torch.device) -> Contender:
    tmp = tempfile.TemporaryDirectory()
    side = OomlessDpo(Path(tmp.name), args, device, _inline(args))
    return Contender(run=side.run, close=tmp.cleanup)


def build_trl(args: argparse.Namespace, device: torch.device, precompute: bool) -> Contender:
    tmp = tempfile.TemporaryDirectory()
    pairs = write_pairs(Path(tmp.name) / "pairs.jsonl", args.micro * args.accum, args.prompt,
                        args.answer)  # fmt: skip
    base = Path(tmp.name) / "base"  # TRL builds its frozen copy from the model's path
    _hf_model(args).save_pretrained(base)
    build = trl_trainer(args, pairs, lambda: _load(base), precompute)
    stepper = HFTrainerStepper(args, device, Path(tmp.name), build_trainer=build)

    def close() -> None:
        stepper.close()
        tmp.cleanup()

    return Contender(run=stepper.run, close=close)


def first_step(args: argparse.Namespace, work: Path) -> dict[str, dict[str, float]]:
    """Step 1 of both sides on one batch of pairs, from the same saved weights (accumulation
    1): each side's loss and mean chosen and rejected log-probs."""
    from transformers import AutoTokenizer

    base = work / "base"
    _hf_model(args).save_pretrained(base)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(base)
    one = argparse.Namespace(**{**vars(args), "accum": 1, "rounds": 0, "steps": 1})
    ours = OomlessDpo(work, one, torch.device("cpu"), {"name_or_path": str(base)}).run(1)
    pairs = work / "pairs.jsonl"
    stepper = HFTrainerStepper(
        one, torch.device("cpu"), work / "trl", build_trainer=_logging(one, pairs, base)
    )
    stepper.run(1)
    stepper.close()  # the Trainer logs step 1 after the step's callbacks: once resumed
    logged = stepper.trainer.state.log_history[0]
    return {
        "oomless": {"loss": ours.loss, "logps/chosen": ours.stats["chosen_logp"],
                    "logps/rejected": ours.stats["rejected_logp"]},
        "trl": {k: logged[k] for k in ("loss", "logps/chosen", "logps/rejected")},
    }  # fmt: skip


def _logging(args: argparse.Namespace, pairs: Path, base: Path) -> Any:
    """TRL's DPOTrainer on `base`, logging every step (what `first_step` reads)."""
    inner = trl_trainer(args, pairs, lambda: _load(base), precompute=False, copies=1)

    def build(targs_kwargs: dict[str, Any], callback: Any) -> Any:
        return inner({**targs_kwargs, "logging_strategy": "steps", "logging_steps": 1}, callback)

    return build


def _load(base: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-20m")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per contender per round")
    p.add_argument("--micro", type=int, default=4, help="pairs per micro-batch")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--prompt", type=int, default=63, help="prompt characters (tokens)")
    p.add_argument("--answer", type=int, default=63, help="characters of each answer")
    p.add_argument("--precision", default="fp32", choices=["bf16", "fp32"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--first-step", action="store_true", help="only step 1's loss, both sides")
    add_sessions_arg(p)
    p.add_argument("--json", type=Path, help="write the raw numbers here")
    args = p.parse_args()
    if args.first_step:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(first_step(args, Path(tmp)), indent=2))
        return
    device = resolve_device(args.device)
    builds = {
        "oomless": (build_oomless, (args, device)),
        "trl": (build_trl, (args, device, False)),
        "trl_precomputed": (build_trl, (args, device, True)),
    }
    timings = time_in_processes(builds, args.rounds, args.steps, device, args.sessions)
    times = timings.round_s
    tokens = 2 * args.micro * args.accum * (args.prompt + args.answer + 2)
    med = {name: s / args.steps for name, s in medians(times).items()}
    ratios = {n: paired_ratio(times["oomless"], times[n]) for n in ("trl", "trl_precomputed")}
    result = {
        "machine": machine(), "model": args.model, "precision": args.precision,
        "device": device.type, "pairs_per_micro_batch": args.micro, "grad_accum": args.accum,
        "seq_len": args.prompt + args.answer + 2, "rounds": args.rounds,
        "steps_per_round": args.steps, "round_s": times, "median_step_s": med,
        "tokens_per_s": {name: tokens / s for name, s in med.items()},
        "oomless_over": {name: med["oomless"] / med[name] for name in ratios},
        "paired_ratio": {name: dict(zip(("median", "q1", "q3"), r, strict=True))
                         for name, r in ratios.items()},
    }  # fmt: skip
    print(
        f"DPO on single, {args.model} (vocab 45), {args.precision}, {args.micro} pairs x accum "
        f"{args.accum}, seq {result['seq_len']}: "
        + ", ".join(f"{n} {t:,.0f} tok/s" for n, t in result["tokens_per_s"].items())
        + "; oomless step time / "
        + ", ".join(
            f"{n} {result['oomless_over'][n]:.3f} (paired {r[0]:.3f}, quartiles "
            f"{r[1]:.3f}-{r[2]:.3f})"
            for n, r in ratios.items()
        )
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
