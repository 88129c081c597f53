"""`parallel.expert=2` against plain `fsdp` (expert 1) on the same job and ranks, side by side.

    python -m bench.expert_parallel [--cpu-smoke] [--rounds N] [--json PATH]

Each degree trains the same Qwen3-MoE job through the real CLI (`oomless train strategy=fsdp
parallel.expert=N`, which launches torchrun itself) in its own process, the degrees alternating
for `--rounds` rounds (the machine's speed drifts over minutes). The table gives the step time
(the median of `step_time_s` over the steps after the first WARMUP_STEPS, pooled over the
rounds), the final loss and the largest difference of a step's loss from expert 1's: the split
is the same math in another order (the experts run on the rows they receive), so in fp32 it
must stay within LOSS_TOLERANCE. On CPU (`--cpu-smoke`): 2 gloo processes, one thread each, a
small Qwen3-MoE (8 experts, top-2) in fp32. On GPUs: one node's GPUs (2 or more), a Qwen3-MoE
of 16 experts, top-4, in bf16 (its losses reported, not bounded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import demo_job_file

REPO = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 2
LOSS_TOLERANCE = 1e-5
DEGREES = (1, 2)
# the demo's character tokenizer (45 ids); 8 experts a layer, top-2: 4 a rank under the split
TINY_MOE = {"model_type": "qwen3_moe", "vocab_size": 45, "hidden_size": 128,
            "intermediate_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 256,
            "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1,
            "eos_token_id": 2}  # fmt: skip
GPU_MOE = {**TINY_MOE, "hidden_size": 1024, "intermediate_size": 2048,
           "moe_intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 16,
           "num_key_value_heads": 4, "head_dim": 64, "num_experts": 16,
           "num_experts_per_tok": 4}  # fmt: skip


def _job(tmp: Path, cpu: bool, num_ranks: int) -> Path:
    """The job: 12 steps of a micro-batch of 8 sequences a rank, no accumulation."""
    train = {"steps": 12, "global_batch_size": 8 * num_ranks, "micro_batch_size": 8, "lr": 1e-3}
    return demo_job_file(tmp, TINY_MOE if cpu else GPU_MOE, 64 if cpu else 512, train,
                         precision="fp32" if cpu else "bf16",
                         memory={"activation_checkpointing": "none"})  # fmt: skip


def num_ranks(cpu: bool) -> int:
    """2 CPU processes, or every GPU of this node (exit 1 in one line with fewer than 2)."""
    if cpu:
        return 2
    import torch

    count = torch.cuda.device_count()
    if count < 2:
        raise SystemExit(f"expert parallel 2 needs 2 or more GPUs, found {count}; "
                         "--cpu-smoke runs it on 2 CPU processes")  # fmt: skip
    return count


def train(job: Path, ep: int, hardware: list[str], run_dir: Path) -> list[dict]:
    """One run of the job at expert degree `ep` through the CLI; its metrics records."""
    argv = [sys.executable, "-m", "launcher.cli", "train", str(job), "strategy=fsdp",
            f"parallel.expert={ep}", *hardware, f"run.dir={run_dir}",
            "run.max_restarts=0"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"expert {ep}: exit {r.returncode}: {r.stderr.strip()[-2000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if isinstance(m.get("step"), int) and "loss" in m]


def summarize(runs: dict[int, list[list[dict]]]) -> list[dict]:
    """Per degree: s/step (median over every round's steps after the warm-up), the last
    round's final loss, and the largest |loss difference| from expert 1 at any step of any
    round (each round starts from the same seed: the same losses are expected every round)."""
    rows = []
    for ep, rounds in runs.items():
        times = [m["step_time_s"] for records in rounds for m in records[WARMUP_STEPS:]]
        diff = max(
            abs(a["loss"] - b["loss"])
            for records, base in zip(rounds, runs[DEGREES[0]], strict=True)
            for a, b in zip(records, base, strict=True)
        )
        rows.append({
            "rung": "fsdp", "expert": ep, "step_time_s": statistics.median(times),
            "final_loss": rounds[-1][-1]["loss"], "max_loss_difference": diff,
            "losses": [m["loss"] for m in rounds[-1]],
        })  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    """The table: one line a degree."""
    lines = [
        f"| rung | expert degree | s/step (median after {WARMUP_STEPS} steps) | final loss | "
        "largest loss difference from expert 1 |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['rung']} | {row['expert']} | {row['step_time_s']:.3f} | "
                     f"{row['final_loss']:.6f} | {row['max_loss_difference']:.1e} |")  # fmt: skip
    return "\n".join(lines)


def words(result: dict) -> str:
    """The result in one line, for bench/run_all.py's and bench/gpu_report.py's tables."""
    base, split = result["rows"][0], result["rows"][-1]
    ratio = split["step_time_s"] / base["step_time_s"]
    return (
        f"expert {split['expert']} {split['step_time_s']:.3f} s/step against expert "
        f"{base['expert']} {base['step_time_s']:.3f} (x{ratio:.2f}), "
        f"largest loss difference {split['max_loss_difference']:.1e} ({result['device']}, "
        f"{result['rounds']} round{'s' * (result['rounds'] > 1)})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    cpu = args.cpu_smoke
    ranks = num_ranks(cpu)
    hardware = [f"hardware.device={'cpu' if cpu else 'cuda'}", f"hardware.devices_per_node={ranks}"]
    runs: dict[int, list[list[dict]]] = {ep: [] for ep in DEGREES}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        job = _job(tmp, cpu, ranks)
        for i in range(args.rounds):
            for ep in DEGREES:
                runs[ep].append(train(job, ep, hardware, tmp / f"ep{ep}_{i}"))
    rows = summarize(runs)
    print(markdown(rows))
    result = {"device": "cpu" if cpu else "cuda", "ranks": ranks, "rounds": args.rounds,
              "rows": rows}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    worst = max(row["max_loss_difference"] for row in rows)
    if cpu and worst > LOSS_TOLERANCE:  # fp32: the same math
        print(f"expert 2's losses differ from expert 1's by {worst:.1e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
