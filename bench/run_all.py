"""`make bench`: every CPU comparison, one after the other; bench/results.json and a markdown table.

    python -m bench.run_all [--quick] [--out bench/results.json]

Each comparison runs in its own process (torchrun with 2 CPU processes and one OMP thread each
for the sharded rungs), alternates its contenders inside that process and writes its raw numbers;
this script collects them and prints the table that docs/benchmarks.md holds. `--quick` runs the
same code with few rounds (a smoke test, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import machine, paired_ratio, ratio_interval
from bench.expert_parallel import words as expert_words

TARGET = 1.05  # oomless step time at most 5% above its peer's


def _run(argv: list[str], env: dict[str, str]) -> None:
    print("$ " + " ".join(argv), flush=True)
    subprocess.run(argv, env=dict(os.environ, **env), check=True)


def run_benchmarks(quick: bool, precision: str, work: Path) -> dict[str, Any]:
    rounds = (
        {"single": 2, "lora": 2, "fsdp": 2, "zero3": 2, "plan": 1, "expert": 1} if quick else {}
    )
    # Fresh processes for every contender in each session: one process's speed is a draw of
    # its own (+-1.5% here), so a median over one process per side carries that draw.
    sessions = {"single": 6, "lora": 8} if not quick else {}
    quiet = {"PYTHONWARNINGS": "ignore"}
    two_ranks = quiet | {"OMP_NUM_THREADS": "1"}
    py = [sys.executable, "-m"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc_per_node", "2", "-m"]
    same = ["--device", "cpu", "--precision", precision]
    # One optimizer step per contender per round, twice the rounds: the same minutes, twice the
    # independent samples of a machine whose speed drifts by +-20% over minutes.
    one_step = ["--steps", "1"]
    steps = {
        "single": py
        + ["bench.engine_vs_plain", "--rounds", str(rounds.get("single", 72)), *one_step]
        + ["--sessions", str(sessions.get("single", 1)), "--compile", *same],
        "lora": py
        + ["bench.lora_vs_trainer", "--rounds", str(rounds.get("lora", 48)), *one_step]
        + ["--sessions", str(sessions.get("lora", 1)), *same],
        "fsdp": torchrun + ["bench.fsdp_vs_plain", "--rounds", str(rounds.get("fsdp", 24)), *same],
        "zero3_offload": torchrun
        + ["bench.zero3_vs_deepspeed", "--rounds", str(rounds.get("zero3", 12)), *same],
        "plan": py + ["bench.plan_time", "--repeats", str(rounds.get("plan", 5))],
        # it launches its 2 CPU ranks itself, through `oomless train`
        "expert": py
        + ["bench.expert_parallel", "--cpu-smoke", "--rounds", str(rounds.get("expert", 3))],
    }
    results: dict[str, Any] = {}
    for name, argv in steps.items():
        out = work / f"{name}.json"
        start = time.perf_counter()
        one_process = name in ("single", "lora", "plan", "expert")
        _run(argv + ["--json", str(out)], quiet if one_process else two_ranks)
        results[name] = json.loads(out.read_text())
        results[name]["wall_s"] = round(time.perf_counter() - start, 1)
    return results


def markdown(results: dict[str, Any]) -> str:
    """The comparison table: tokens/s medians, oomless/peer step-time ratio, target."""
    rows = [
        "| comparison | oomless tokens/s | peer tokens/s | oomless / peer step time "
        "(medians) | 90% bootstrap interval | per round: median [quartiles] | target |",
        "|---|---|---|---|---|---|---|",
    ]
    single = results["single"]
    for peer, label, target in (
        ("plain", "`single` vs plain PyTorch loop", f"<= {TARGET:.2f}"),
        ("hf_trainer", "`single` vs transformers `Trainer`", "<= 1.00"),
    ):
        rows.append(_row(label, single, peer, target))
    if "oomless_compiled_over" in single:  # train.compile against the Trainer as is and compiled
        for peer, label in (
            ("hf_trainer", "`single` + `train.compile` vs transformers `Trainer`"),
            ("hf_trainer_compiled", "`single` + `train.compile` vs `Trainer` + `torch_compile`"),
        ):
            rows.append(_row(label, single, peer, "<= 1.00", ours="oomless_compiled"))
    if "lora" in results:  # LoRA (r=16, all-linear) against peft + the Trainer on the same job
        lora = results["lora"]
        rows.append(_row("`single` LoRA vs peft + `Trainer`", lora, "peft_trainer", "<= 1.00"))
        if "oomless_control" in lora["tokens_per_s"]:  # A/A: the same contender twice
            rows.append(
                _row("`single` LoRA vs itself (A/A control)", lora, "oomless_control", "control")
            )
    rows.append(_row("`fsdp` x2 vs hand-written FSDP2", results["fsdp"], "plain", f"<= {TARGET}"))
    rows.append(
        _row(
            "`zero3_offload` x2 vs DeepSpeed by hand",
            results["zero3_offload"],
            "deepspeed",
            f"<= {TARGET}",
        )
    )
    plan = results["plan"]
    lines = rows + [
        "",
        f"Planner, Llama-3.1-70B on 8 x 80 GiB (2 TiB host): `oomless plan ... --json` "
        f"{plan['cli_median_s']:.2f} s wall (median of {len(plan['cli_s'])}), `make_plan` "
        f"in-process {plan['make_plan_median_s'] * 1e3:.1f} ms (median of "
        f"{plan['make_plan_calls']}); "
        + (
            f"plan: {plan['strategy']}, micro-batch {plan['micro_batch_size']}, "
            f"checkpointing {plan['activation_checkpointing']}"
            if plan.get("strategy")
            else f"answer: {plan.get('no_fit')}"
        )
        + ".",
    ]
    if "expert" in results:  # bench/expert_parallel.py: no peer, the split against no split
        lines.append(
            "Expert parallel, a Qwen3-MoE of 8 experts (top-2) on `fsdp` x2: "
            + expert_words(results["expert"])
            + "."
        )
    if "traced_cold_cli_median_s" in plan:  # bench/plan_time.py's cold starts (empty caches)
        lines.append(
            f"Planner cold start: a 70B-like config never seen {plan['cold_cli_median_s']:.2f} s; "
            f"a 1.0B gpt_neox whose activations are traced {plan['traced_cold_cli_median_s']:.1f} "
            "s wall."
        )
    return "\n".join(lines)


def _row(label: str, result: dict[str, Any], peer: str, target: str, ours: str = "oomless") -> str:
    tps = result["tokens_per_s"]
    ratio = result[f"{ours}_over"][peer]
    rounds = result["rounds"]
    times = result.get("round_s") or result["step_s"]
    median, q1, q3 = paired_ratio(times[ours], times[peer])
    sessions = result.get("session_of_round")
    low, high = ratio_interval(times[ours], times[peer], groups=sessions)
    spread = f"{rounds} rounds" + (f", {len(set(sessions))} sessions" if sessions else "")
    return (
        f"| {label} | {tps[ours]:,.0f} | {tps[peer]:,.0f} | {ratio:.3f} "
        f"({spread}) | [{low:.3f}, {high:.3f}] | {median:.3f} [{q1:.3f}, {q3:.3f}] "
        f"| {target} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few rounds: a smoke test")
    p.add_argument("--out", type=Path, default=Path("bench/results.json"))
    p.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "bf16"],
        help="of every contender; fp32 by default: CPUs without AVX512-BF16/AMX run bf16 "
        "matmuls an order of magnitude slower than fp32",
    )
    p.add_argument("--table", type=Path, help="only print the table of this results file")
    args = p.parse_args()
    if args.table:
        print(markdown(json.loads(args.table.read_text())))
        return
    before = machine()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        results = run_benchmarks(args.quick, args.precision, Path(tmp))
    results["machine_before"] = before
    results["machine_after"] = machine()
    results["total_wall_s"] = round(time.perf_counter() - start, 1)
    results["quick"] = args.quick
    results["precision"] = args.precision
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    m = results["machine_after"]
    print()
    print(
        f"{m['cpu']}, {m['cores']} cores, load average before {before['load_avg_1_5_15']}, "
        f"after {m['load_avg_1_5_15']}; torch {m['torch']}, transformers {m['transformers']}, "
        f"deepspeed {m['deepspeed']}; {args.precision}; {m['date_utc']} UTC; "
        f"{results['total_wall_s']:.0f} s"
    )
    print(markdown(results))
    print(f"\nraw numbers: {args.out}")


if __name__ == "__main__":
    main()
