"""Step time of the oomless engine (single backend) vs a plain hand-written PyTorch loop.

Same model (a ~20M-parameter Llama shape), same batches, same precision, same AdamW and clipping;
the two are alternated in one process, several rounds, and the medians compared. The engine side
runs exactly what `run_training` runs per step: set_lr, `train_step` (token-weighted accumulation
through the Backend), memory stats and the metrics line.

    python bench/engine_vs_plain.py [--rounds 5] [--steps 6] [--precision bf16] [--out docs/..]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.config import build_config  # noqa: E402
from trainer.backends import BackendContext, OptimizerSpec, build_backend  # noqa: E402
from trainer.backends.common import autocast_context  # noqa: E402
from trainer.metrics import MetricsLog  # noqa: E402
from trainer.model import HFModelFactory, count_parameters  # noqa: E402
from trainer.step import train_step  # noqa: E402

MODEL = {
    "model_type": "llama",
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
OPTIM = OptimizerSpec(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0)


def make_batches(num_micro: int, micro: int, seq: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(num_micro):
        ids = torch.randint(0, MODEL["vocab_size"], (micro, seq), generator=g)
        out.append(
            {
                "input_ids": ids,
                "labels": ids.clone(),
                "position_ids": torch.arange(seq).repeat(micro, 1),
                "doc_ids": torch.zeros_like(ids),
            }
        )
    return out


def build_engine(tmp: Path, precision: str, micro: int, accum: int, device: torch.device):
    data = tmp / "d.jsonl"
    data.write_text('{"text": "x"}\n')
    cfg = build_config(
        {
            "model": {"config": MODEL, "tokenizer": str(tmp)},
            "data": {"path": str(data), "seq_len": 128},
            "train": {"global_batch_size": micro * accum, "micro_batch_size": micro},
            "precision": precision,
            "strategy": "single",
        }
    )
    ctx = BackendContext(cfg, device, 0, 0, 1, precision, "none", micro, accum)
    backend = build_backend("single", ctx)
    model = backend.setup(HFModelFactory(cfg.model, seed=0), OPTIM)
    metrics = MetricsLog(tmp, total_steps=10**9, enabled=True, log_every=10**9)
    return model, backend, metrics


def engine_steps(model, backend, metrics, batches, device, num_steps: int) -> float:
    start = time.perf_counter()
    for step in range(num_steps):
        backend.reset_peak()
        backend.set_lr(OPTIM.lr)
        r = train_step(model, backend, batches, device)
        peak = backend.memory_stats()["peak_device_bytes"]
        metrics.write(
            {
                "step": step + 1,
                "loss": r.loss,
                "lr": OPTIM.lr,
                "grad_norm": r.grad_norm,
                "tokens": r.num_tokens,
                "tokens_per_s": r.num_tokens / r.step_time_s,
                "peak_device_bytes": peak,
            }
        )
    _sync(device)
    return (time.perf_counter() - start) / num_steps


def build_plain(precision: str, device: torch.device):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**{k: v for k, v in MODEL.items() if k != "model_type"})
    cfg.use_cache = False  # as the engine's model: no KV cache in training
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(device)
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=OPTIM.lr,
        betas=OPTIM.betas,
        eps=OPTIM.eps,
        weight_decay=OPTIM.weight_decay,
        **fast,
    )
    return model, opt


def plain_steps(model, opt, batches, device, precision: str, num_steps: int) -> float:
    """The loop a person writes by hand: mean loss per micro-batch / accumulation."""
    start = time.perf_counter()
    for _ in range(num_steps):
        for b in batches:
            ids = b["input_ids"].to(device)
            positions = b["position_ids"].to(device)  # packed data needs them; same inputs
            with autocast_context(device, precision):
                logits = model(input_ids=ids, position_ids=positions).logits
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1)
            )
            (loss / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())  # the hand-written loop logs its loss too
    _sync(device)
    return (time.perf_counter() - start) / num_steps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--json", type=Path, help="write the raw numbers here")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batches = make_batches(args.accum, args.micro, args.seq)
    with tempfile.TemporaryDirectory() as tmp:
        model_e, backend, metrics = build_engine(
            Path(tmp), args.precision, args.micro, args.accum, device
        )
        model_p, opt = build_plain(args.precision, device)
        num_params = count_parameters(model_p)
        engine_steps(model_e, backend, metrics, batches, device, 1)  # warm-up both
        plain_steps(model_p, opt, batches, device, args.precision, 1)
        engine_s, plain_s = [], []
        for r in range(args.rounds):
            first, second = (engine_s, plain_s) if r % 2 == 0 else (plain_s, engine_s)
            for times in (first, second):
                if times is engine_s:
                    times.append(
                        engine_steps(model_e, backend, metrics, batches, device, args.steps)
                    )
                else:
                    times.append(
                        plain_steps(model_p, opt, batches, device, args.precision, args.steps)
                    )
    engine_med, plain_med = statistics.median(engine_s), statistics.median(plain_s)
    result = {
        "device": torch.cuda.get_device_name()
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "num_params": num_params,
        "precision": args.precision,
        "micro_batch_size": args.micro,
        "grad_accum": args.accum,
        "seq_len": args.seq,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "engine_step_s": engine_s,
        "plain_step_s": plain_s,
        "engine_median_s": engine_med,
        "plain_median_s": plain_med,
        "ratio_engine_over_plain": engine_med / plain_med,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{num_params / 1e6:.1f}M params, {args.precision}, micro {args.micro} x accum "
        f"{args.accum}, seq {args.seq}: engine {engine_med * 1e3:.1f} ms/step, plain "
        f"{plain_med * 1e3:.1f} ms/step, ratio {engine_med / plain_med:.3f}"
    )


if __name__ == "__main__":
    main()
