"""Tokens/s of oomless `single` vs a plain hand-written PyTorch loop and the transformers Trainer.

Same model, same batches, same precision, same AdamW hyper-parameters and clipping, same global
batch (micro-batch x accumulation); each contender runs in a process of its own
(bench/contenders.py), they alternate in an order shuffled every round, several rounds, and the
medians are compared.

- `oomless`: what `run_training` runs per step: set_lr, `train_step` through the `single` backend
  (token-weighted accumulation, OOM agreement points), memory stats and the metrics line.
- `plain`: the loop a person writes by hand (mean loss per micro-batch / accumulation, clip, step),
  with the engine's AdamW (`build_adamw`: fused), so the optimizer kernel is not what differs.
- `hf_trainer`: `transformers.Trainer` with equivalent TrainingArguments and no eval, saving or
  logging; it runs in a thread, held at the end of every optimizer step by a callback, so a timed
  call covers exactly N of its steps including its data loading and bookkeeping.

- with `--compile`, two more: `oomless_compiled` (`train.compile: true`: each decoder layer
  compiled) and `hf_trainer_compiled` (`TrainingArguments(torch_compile=True)`); compiling happens
  in the untimed warm-up step. In processes of their own, the compiled Trainer cannot switch the
  eager one's accelerate state to inductor (that state is one per process).

    python -m bench.engine_vs_plain [--model llama-20m] [--rounds 10] [--steps 2] \
        [--precision bf16] [--no-trainer] [--compile] [--device auto] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import (
    add_step_args,
    build_hf_model,
    count_parameters,
    job_config,
    machine,
    make_batches,
    medians,
    mfu,
    resolve_device,
)
from bench.contenders import Contender, add_sessions_arg, time_in_processes
from trainer.backends import BackendContext, OptimizerSpec, build_backend
from trainer.backends.common import autocast_context, build_adamw
from trainer.model.build import HFModelFactory
from trainer.observe.metrics import MetricsLog
from trainer.step import train_step

OPTIM = OptimizerSpec(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0)


class OomlessSingle:
    """The engine's per-step path on the `single` backend."""

    def __init__(
        self, tmp: Path, args: argparse.Namespace, device: torch.device, compile: bool = False
    ):
        cfg = job_config(
            tmp, args.model, "single", args.precision, args.micro, args.accum, args.seq, device,
            compile=compile,
        )  # fmt: skip
        ctx = BackendContext(cfg, device, 0, 0, 1, args.precision, "none", args.micro, args.accum)
        self.backend = build_backend("single", ctx)
        self.model = self.backend.setup(HFModelFactory(cfg.model, seed=0), OPTIM)
        self.metrics = MetricsLog(tmp, total_steps=10**9, enabled=True, log_every=10**9)
        self.device = device
        self.step = 0

    def run(self, batches: list[dict[str, torch.Tensor]], num_steps: int) -> None:
        for _ in range(num_steps):
            self.step += 1
            self.backend.reset_peak()
            self.backend.set_lr(OPTIM.lr)
            r = train_step(self.model, self.backend, batches, self.device)
            peak = self.backend.memory_stats()["peak_device_bytes"]
            self.metrics.write(
                {
                    "step": self.step,
                    "loss": r.loss,
                    "lr": OPTIM.lr,
                    "grad_norm": r.grad_norm,
                    "tokens": r.num_tokens,
                    "tokens_per_s": r.num_tokens / r.step_time_s,
                    "peak_device_bytes": peak,
                }
            )


class PlainLoop:
    """The loop a person writes by hand: mean loss per micro-batch / accumulation."""

    def __init__(self, args: argparse.Namespace, device: torch.device):
        self.model = build_hf_model(args.model).to(device)
        self.opt = build_adamw(self.model.parameters(), OPTIM)  # the engine's AdamW
        self.device = device
        self.precision = args.precision

    def run(self, batches: list[dict[str, torch.Tensor]], num_steps: int) -> None:
        for _ in range(num_steps):
            for b in batches:
                ids = b["input_ids"].to(self.device)
                positions = b["position_ids"].to(self.device)
                with autocast_context(self.device, self.precision):
                    logits = self.model(input_ids=ids, position_ids=positions).logits
                loss = F.cross_entropy(
                    logits[:, :-1].float().reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1)
                )
                (loss / len(batches)).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), OPTIM.grad_clip, foreach=True)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            float(loss.detach())  # the hand-written loop logs its loss too


class HFTrainerStepper:
    """transformers.Trainer run N optimizer steps at a time.

    `Trainer.train()` runs in a thread; a callback parks it at the end of every step until the
    next `run(n)`, so only one side computes at any moment and the timed span holds whole steps.
    The model and the Trainer are built in that thread too, as every other contender is built in
    the thread it runs in (its weights in that thread's malloc arena, not the main thread's).
    """

    def __init__(
        self,
        args: argparse.Namespace,
        device: torch.device,
        out_dir: Path,
        compile: bool = False,
        build_model: Any = None,  # () -> model; default: the plain HF model (bench.lora_vs_trainer)
        build_trainer: Any = None,  # (TrainingArguments' kwargs, callback) -> another Trainer
    ):  # (bench.dpo_vs_trl: TRL's DPOTrainer on its own data)
        from transformers import Trainer, TrainerCallback, TrainingArguments

        stepper = self

        class Park(TrainerCallback):
            def on_step_end(self, targs, state, control, **kwargs):
                stepper._remaining -= 1
                if stepper._remaining == 0:
                    stepper.on_park()
                    stepper._done.release()
                    stepper._go.acquire()
                    stepper.on_resume()
                    if stepper._stop:
                        control.should_training_stop = True
                return control

        max_steps = 1 + args.rounds * args.steps + 1  # warm-up, rounds, the stop
        targs_kwargs = dict(
            output_dir=str(out_dir),
            per_device_train_batch_size=args.micro,
            gradient_accumulation_steps=args.accum,
            max_steps=max_steps,
            learning_rate=OPTIM.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=OPTIM.weight_decay,
            adam_beta1=OPTIM.betas[0],
            adam_beta2=OPTIM.betas[1],
            adam_epsilon=OPTIM.eps,
            max_grad_norm=OPTIM.grad_clip,
            bf16=args.precision == "bf16",
            fp16=args.precision == "fp16",
            use_cpu=device.type == "cpu",
            logging_strategy="no",
            save_strategy="no",
            eval_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
            dataloader_pin_memory=device.type == "cuda",
            remove_unused_columns=False,
            seed=0,
            torch_compile=compile,
        )
        self._go, self._done = threading.Semaphore(0), threading.Semaphore(0)
        self._remaining = 0
        self._stop = False
        self._error: BaseException | None = None
        # run in the Trainer's thread when it parks and resumes (bench.profile_vs_trainer)
        self.on_park: Any = lambda: None
        self.on_resume: Any = lambda: None

        def build() -> Any:
            if build_trainer is not None:
                return build_trainer(targs_kwargs, Park())
            batches = make_batches(args.model, args.accum, args.micro, args.seq)
            rows = [
                {k: b[k][i] for k in ("input_ids", "labels", "position_ids")}
                for b in batches
                for i in range(args.micro)
            ]
            model = build_model() if build_model is not None else build_hf_model(args.model)
            targs = TrainingArguments(**targs_kwargs)
            return Trainer(
                model=model, args=targs, train_dataset=rows * max_steps, callbacks=[Park()]
            )

        self._thread = threading.Thread(target=self._build_then_train, args=(build,), daemon=True)
        self._thread.start()
        self._wait()  # built

    def _build_then_train(self, build: Any) -> None:
        try:
            self.trainer = build()
            self.optimizer_name = str(self.trainer.args.optim)
            self._done.release()
            self._go.acquire()  # the first run()
            self.trainer.train()
        except BaseException as err:  # surfaced in the main thread by run()
            self._error = err
            self._done.release()

    def _wait(self) -> None:
        self._done.acquire()
        if self._error is not None:
            raise self._error

    def run(self, num_steps: int) -> None:
        self._remaining = num_steps
        self._go.release()
        self._wait()

    def close(self) -> None:
        self._stop = True
        self._remaining = 10**9
        self._go.release()
        self._thread.join(timeout=600)


def build_oomless(args: argparse.Namespace, device: torch.device, compile: bool) -> Contender:
    tmp = tempfile.TemporaryDirectory()
    side = OomlessSingle(Path(tmp.name), args, device, compile)
    batches = make_batches(args.model, args.accum, args.micro, args.seq)
    return Contender(run=lambda n: side.run(batches, n), close=tmp.cleanup)


def build_plain(args: argparse.Namespace, device: torch.device) -> Contender:
    side = PlainLoop(args, device)
    batches = make_batches(args.model, args.accum, args.micro, args.seq)
    return Contender(
        run=lambda n: side.run(batches, n), info={"num_params": count_parameters(side.model)}
    )


def build_hf_trainer(
    args: argparse.Namespace, device: torch.device, compile: bool, build_model: Any = None
) -> Contender:
    tmp = tempfile.TemporaryDirectory()
    stepper = HFTrainerStepper(args, device, Path(tmp.name), compile, build_model)

    def close() -> None:
        stepper.close()
        tmp.cleanup()

    return Contender(run=stepper.run, info={"optimizer": stepper.optimizer_name}, close=close)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-20m")
    add_step_args(p, rounds=10, precisions=("bf16", "fp16", "fp32"))
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per contender per round")
    p.add_argument("--no-trainer", action="store_true", help="leave the HF Trainer out")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also oomless with train.compile and the Trainer with torch_compile",
    )
    add_sessions_arg(p)
    args = p.parse_args()
    device = resolve_device(args.device)
    builds: dict[str, Any] = {
        "oomless": (build_oomless, (args, device, False)),
        "plain": (build_plain, (args, device)),
    }
    if args.compile:
        builds["oomless_compiled"] = (build_oomless, (args, device, True))
    if not args.no_trainer:
        builds["hf_trainer"] = (build_hf_trainer, (args, device, False))
        if args.compile:
            builds["hf_trainer_compiled"] = (build_hf_trainer, (args, device, True))
    timings = time_in_processes(builds, args.rounds, args.steps, device, args.sessions)
    times, info = timings.round_s, timings.info
    result = report(args, device, info["plain"]["num_params"], times)
    result |= {"sessions": args.sessions, "session_of_round": timings.session_of_round}
    if "hf_trainer" in info:
        result["hf_trainer_optim"] = info["hf_trainer"]["optimizer"]
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def report(
    args: argparse.Namespace, device: torch.device, num_params: int, times: dict[str, list[float]]
) -> dict[str, Any]:
    """Per-step medians, tokens/s, MFU on a known GPU, ratios against oomless; prints a line."""
    tokens = args.micro * args.accum * args.seq
    med = {name: s / args.steps for name, s in medians(times).items()}
    result: dict[str, Any] = {
        "machine": machine(),
        "model": args.model,
        "num_params": num_params,
        "precision": args.precision,
        "device": device.type,
        "micro_batch_size": args.micro,
        "grad_accum": args.accum,
        "seq_len": args.seq,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "round_s": times,
        "median_step_s": med,
        "tokens_per_s": {name: tokens / s for name, s in med.items()},
        "oomless_over": {name: med["oomless"] / s for name, s in med.items() if name != "oomless"},
    }
    if "oomless_compiled" in med:
        result["oomless_compiled_over"] = {
            name: med["oomless_compiled"] / s
            for name, s in med.items()
            if name != "oomless_compiled"
        }
    result |= mfu(args.model, num_params, args.seq, device, result["tokens_per_s"])
    print(
        f"single, {num_params / 1e6:.1f}M params, {args.precision}, micro {args.micro} x accum "
        f"{args.accum}, seq {args.seq}: "
        + ", ".join(f"{n} {t:,.0f} tok/s" for n, t in result["tokens_per_s"].items())
        + "; oomless step time / "
        + ", ".join(f"{n} {r:.3f}" for n, r in result["oomless_over"].items())
        + "".join(
            f"; oomless_compiled / {n} {r:.3f}"
            for n, r in result.get("oomless_compiled_over", {}).items()
        )
    )
    return result


if __name__ == "__main__":
    main()
