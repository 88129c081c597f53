"""bench/gpu_validate.sh on its CPU smoke path: the same Python pieces the GPU run calls, with
`--device cpu` and a 0.6M-parameter shape. What a person running it sees: exit 0, the table
printed last with a row per part, and the details written under $OUT."""

from __future__ import annotations

import json
import math
import os
import time

import pytest
import torch

from bench.common import ratio_interval
from bench.contenders import Contender
from tests.conftest import PYTHON, REPO, run_bounded

PARTS = {
    "single": "`single` vs plain loop",
    "fsdp": "`fsdp` (world 1) vs hand-written FSDP2",
    "zero3_offload": "`zero3_offload` vs DeepSpeed by hand",
    "escalation": "real OOM -> escalation",
    "levers": "chunked loss, activation offload vs off",
    "long_context": "long context: 8B layers, peak vs estimate",
}


@pytest.mark.slow  # five parts, each a fresh process importing torch, transformers, deepspeed
def test_gpu_validate_cpu_smoke_prints_the_table_and_writes_out(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, GPU_VALIDATE_CPU_SMOKE="1", OUT=str(out))
    r = run_bounded(["bash", "bench/gpu_validate.sh"], timeout=1500, cwd=REPO, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    lines = r.stdout.rstrip().splitlines()
    table = lines[lines.index("| part | status | s | result |") :]
    assert len(table) == 2 + 1 + len(PARTS), r.stdout[-3000:]  # header, rule, estimate, parts
    assert table == (out / "summary.md").read_text().splitlines()[2:]
    rows = {row.split(" | ")[0].lstrip("| "): row.split(" | ") for row in table[2:]}
    estimate = rows["estimator vs max_memory_allocated"]
    if (REPO / "bench" / "estimate_gpu.py").exists():  # being written beside this script
        assert estimate[1] == "ok" and "bench.estimate_gpu loads (--help)" in estimate[3]
    else:
        assert estimate[1] == "missing" and "not found" in estimate[3]
    for name, label in PARTS.items():
        log = out / f"{name}.log"
        tail = log.read_text()[-3000:] if log.exists() else "(no log)"
        assert rows[label][1] == "ok", f"{name}: {rows[label][1]}; its log ends:\n{tail}"
        assert (out / f"{name}.json").exists() and (out / f"{name}.log").exists()

    single = json.loads((out / "single.json").read_text())
    assert single["device"] == "cpu" and single["model"] == "llama-tiny"
    assert set(single["tokens_per_s"]) == {"oomless", "plain"}
    assert all(tps > 0 for tps in single["tokens_per_s"].values())
    levers = json.loads((out / "levers.json").read_text())
    assert set(levers["step_s"]) == {"off", "chunked_loss", "offload_activations", "both"}
    assert levers["offloaded_bytes_per_step"]["offload_activations"] > 0
    assert levers["offloaded_bytes_per_step"]["chunked_loss"] == 0
    # offloaded checkpoints move exactly what the estimate says: each layer's input
    long = json.loads((out / "long_context.json").read_text())
    offloaded = [row for row in long if row["offload"]]
    assert offloaded and all(
        row["offloaded_bytes"] == row["estimated_offloaded_bytes"] > 0 for row in offloaded
    ), long
    zero3 = json.loads((out / "zero3_offload.json").read_text())
    assert zero3["model"] == "llama-tiny"  # the only candidate, and the planner says it fits
    assert zero3["transfer"]["h2d_bytes_per_s"] > 0 and zero3["transfer"]["floor_step_s"] > 0

    # the escalation: single ran out of memory (injected on CPU), the supervisor climbed, resumed
    escalation = json.loads((out / "escalation.json").read_text())
    assert escalation["completed"] and escalation["exit_code"] == 0
    assert escalation["rungs"][0] == "single" and len(escalation["rungs"]) == 2
    records = (out / "escalation-run" / "escalations.jsonl").read_text().splitlines()
    assert [json.loads(x)["from"] for x in records] == ["single"]
    assert "rungs single -> " in rows[PARTS["escalation"]][3]


def test_gpu_report_names_a_part_that_timed_out(tmp_path):
    (tmp_path / "parts.tsv").write_text("estimate\tmissing\t0\nfsdp\t124\t70\n")
    (tmp_path / "fsdp.log").write_text("loading\nstep 3 of 8 | still running\n\n")
    r = run_bounded([PYTHON, "-m", "bench.gpu_report", str(tmp_path)], timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    rows = r.stdout.splitlines()[-2:]
    assert rows[0].startswith("| estimator vs max_memory_allocated | missing | 0 |")
    assert rows[1] == (
        "| `fsdp` (world 1) vs hand-written FSDP2 | timed out | 70 | step 3 of 8 / still running |"
    )


def test_memory_fraction_out_of_range_is_one_line_naming_the_key(tmp_path):
    r = run_bounded(
        [PYTHON, "-m", "launcher.cli", "config", "configs/demo.yaml",
         "debug.device_memory_fraction=1.5"],
        timeout=120,
        cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "debug.device_memory_fraction" in r.stderr


def test_make_bench_table_gives_medians_and_per_round_ratios(tmp_path):
    def pair(peer: str, ours: list[float], theirs: list[float]) -> dict:
        return {
            "tokens_per_s": {"oomless": 1000 / ours[1], peer: 1000 / theirs[1]},
            "oomless_over": {peer: ours[1] / theirs[1]},
            "rounds": len(ours),
            "step_s": {"oomless": ours, peer: theirs},
        }

    single = pair("plain", [1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    single["tokens_per_s"]["hf_trainer"] = 500.0
    single["oomless_over"]["hf_trainer"] = 0.5
    single["step_s"]["hf_trainer"] = [2.0, 2.0, 2.0]
    single["tokens_per_s"] |= {"oomless_compiled": 1250.0, "hf_trainer_compiled": 1000.0}
    single["step_s"]["oomless_compiled"] = [0.8, 0.8, 0.8]
    single["step_s"]["hf_trainer_compiled"] = [1.0, 0.8, 1.0]
    single["oomless_compiled_over"] = {"hf_trainer": 0.4, "hf_trainer_compiled": 0.8}
    lora = pair("peft_trainer", [1.0, 1.0, 1.0], [1.0, 1.25, 1.0])
    lora["tokens_per_s"]["oomless_control"] = 1000 / 1.1
    lora["oomless_over"]["oomless_control"] = 1 / 1.1
    lora["step_s"]["oomless_control"] = [1.1, 1.1, 1.1]
    results = {
        "single": single,
        "lora": lora,
        "fsdp": pair("plain", [1.1, 2.2, 3.3], [1.0, 2.0, 3.0]),
        "zero3_offload": pair("deepspeed", [1.0, 3.0, 2.0], [1.0, 2.0, 2.0]),
        "plan": {
            "cli_s": [0.3], "cli_median_s": 0.3, "make_plan_median_s": 0.002,
            "make_plan_calls": 50, "strategy": "fsdp_offload", "micro_batch_size": 2,
            "activation_checkpointing": "full",
        },
        "expert": summary_of({1: [0.4, 0.4], 2: [0.3, 0.3]}, last_loss_of_ep2=2.0 + 3e-7),
    }  # fmt: skip
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    r = run_bounded([PYTHON, "-m", "bench.run_all", "--table", str(path)], timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    rows = {line.split(" | ")[0].lstrip("| "): line for line in r.stdout.splitlines()}
    assert (
        "| 0.500 (3 rounds) | [0.500, 0.500] | 0.500 [0.500, 0.500] | <= 1.00 |"
        in rows["`single` vs transformers `Trainer`"]
    )
    assert (
        "| 1,250 | 1,000 | 0.800 (3 rounds) | [0.800, 1.000] | 0.800 [0.800, 1.000] | <= 1.00 |"
        in rows["`single` + `train.compile` vs `Trainer` + `torch_compile`"]
    )
    assert (
        "| 1.100 (3 rounds) | [1.100, 1.100] | 1.100 [1.100, 1.100] | <= 1.05 |"
        in rows["`fsdp` x2 vs hand-written FSDP2"]
    )
    # per round 1.0, 1.5, 1.0: the medians' ratio (1.5, round 2 alone) is not what a round says,
    # and resampling the rounds moves it between 1.0 and 1.5
    assert (
        "| 1.500 (3 rounds) | [1.000, 1.500] | 1.000 [1.000, 1.500] |"
        in rows["`zero3_offload` x2 vs DeepSpeed by hand"]
    )
    assert (
        "| 0.800 (3 rounds) | [0.800, 1.000] | 1.000 [0.800, 1.000] | <= 1.00 |"
        in rows["`single` LoRA vs peft + `Trainer`"]
    )
    assert (
        "| 1,000 | 909 | 0.909 (3 rounds) | [0.909, 0.909] | 0.909 [0.909, 0.909] | control |"
        in rows["`single` LoRA vs itself (A/A control)"]
    )
    assert "plan: fsdp_offload, micro-batch 2, checkpointing full" in r.stdout
    # the median over both rounds' steps after the first 2 (the 1 s warm-ups left out)
    assert (
        "on `fsdp` x2: expert 2 0.300 s/step against expert 1 0.400 (x0.75), largest loss "
        "difference 3.0e-07 (cpu, 2 rounds)." in r.stdout
    )


def summary_of(step_s: dict[int, list[float]], last_loss_of_ep2: float) -> dict:
    """bench/expert_parallel.py's result, as its `--json` writes it, of two rounds of each
    degree: 2 warm-up steps of 1 s, then steps of `step_s` at a loss of 2.0 (expert 2's last
    one `last_loss_of_ep2`)."""
    from bench.expert_parallel import summarize

    def records(ep: int) -> list[dict]:
        times = [1.0, 1.0, *step_s[ep]]
        out = [{"step": i + 1, "loss": 2.0, "step_time_s": t} for i, t in enumerate(times)]
        out[-1]["loss"] = last_loss_of_ep2 if ep == 2 else 2.0
        return out

    return {
        "device": "cpu",
        "rounds": 2,
        "rows": summarize({ep: [records(ep)] * 2 for ep in (1, 2)}),
    }


def test_escalation_cap_lies_between_the_offload_and_the_on_device_rungs(tmp_path):
    """The GPU-only step of bench.escalation, on the real estimator: the cap it sets must stop
    every rung that keeps all state on the device and leave room for the offload rungs."""
    import argparse

    import yaml

    from bench.escalation import OFFLOAD, ON_DEVICE, job_tree, memory_cap

    args = argparse.Namespace(model="llama-1b", steps=4, global_batch=4, seq=1024)
    tree = job_tree(args, torch.device("cuda"), tmp_path / "run")
    tree["hardware"] |= {"device_memory": "80GiB", "host_memory": "128GiB"}  # no GPU here
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(tree))
    cap = memory_cap(config, device_memory_bytes=80 * 2**30)
    peaks = cap["estimated_peak_bytes"]
    assert max(peaks[name] for name in OFFLOAD) * 1.1 < cap["cap_bytes"]
    assert cap["cap_bytes"] * 1.1 < min(peaks[name] for name in ON_DEVICE)
    assert cap["device_memory_fraction"] == round(cap["cap_bytes"] / (80 * 2**30), 4)


def build_sleeper(seconds_per_step: float) -> Contender:
    """A bench contender whose step is a sleep: a known duration, measured in the child."""
    return Contender(run=lambda n: time.sleep(n * seconds_per_step), info={"pid": os.getpid()})


def build_broken(message: str) -> Contender:
    raise ValueError(message)


# Run as a script of its own, as `make bench` runs the benches: spawning starts multiprocessing's
# resource tracker, which lives as long as the process that spawned (here: that script).
CONTENDERS_SCRIPT = """
import json, os, torch
from bench.contenders import time_in_processes
from tests.test_bench import build_broken, build_sleeper
cpu = torch.device("cpu")
timings = time_in_processes(
    {"a": (build_sleeper, (0.02,)), "b": (build_sleeper, (0.06,))}, 5, 2, cpu, num_sessions=2
)
try:
    time_in_processes({"broken": (build_broken, ("no model",))}, 1, 1, cpu)
    failure = None
except RuntimeError as err:
    failure = str(err)
print(json.dumps({"pid": os.getpid(), "timings": timings.__dict__, "failure": failure}))
"""


def test_contenders_run_in_processes_of_their_own_and_a_failure_names_the_contender():
    r = run_bounded([PYTHON, "-c", CONTENDERS_SCRIPT], timeout=180, cwd=REPO)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    timings, info = out["timings"], out["timings"]["info"]
    assert len({info["a"]["pid"], info["b"]["pid"], out["pid"]}) == 3
    assert timings["session_of_round"] == [0, 0, 0, 1, 1]
    times = timings["round_s"]
    assert [len(times["a"]), len(times["b"])] == [5, 5]
    assert all(0.04 <= t < 0.04 + 0.5 for t in times["a"])  # two steps of 20 ms each
    assert all(0.12 <= t < 0.12 + 0.5 for t in times["b"])
    assert out["failure"].startswith("bench contender 'broken' failed:")
    assert "ValueError: no model" in out["failure"]


def test_the_interval_resamples_sessions_when_rounds_share_a_process():
    """Five sessions whose processes ran 0.90-1.10x the peer's time, every round of a session
    alike: resampling rounds alone hides what another draw of processes could give."""
    per_session = [0.9, 0.95, 1.0, 1.05, 1.1]
    ours = [r for r in per_session for _ in range(8)]
    sessions = [s for s in range(5) for _ in range(8)]
    assert ratio_interval(ours, [1.0] * 40) == (0.95, 1.05)
    assert ratio_interval(ours, [1.0] * 40, groups=sessions) == (0.9, 1.1)


# bench.published: the estimate against the published record (docs/memory.md "The published
# record"); pure arithmetic, about 2 s.
PUBLISHED_WITHIN_BAND = 33  # the count docs/memory.md shows; a regression of the estimate fails it


def test_published_bench_prints_its_table_and_holds_the_documented_count(capsys, tmp_path):
    from bench.published import BANDS, main

    assert main(["--json", str(tmp_path / "published.json")]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    out = json.loads((tmp_path / "published.json").read_text())
    rows, summary = out["rows"], out["summary"]

    assert len(rows) >= 20 and summary["repositories"] >= 4
    assert len(printed) == 2 + len(rows) + 2  # header, rule, a line per row, blank, summary
    for row in rows:
        source = row["source"]
        assert source["repo"].count("/") == 1 and source["path"], row["id"]
        assert len(source["commit"]) == 40 and source["measures"], row["id"]
        assert row["kind"] in BANDS and row["published_bytes"] > 0, row["id"]
        if row["cannot"] is not None:
            assert len(row["cannot"]) > 20 and "ratio" not in row, row["id"]
            assert f"cannot: {row['cannot']}" in next(p for p in printed if row["id"] in p)
        else:
            assert row["oomless_bytes"] > 0 and row["ratio"] > 0, row["id"]
            # every expressible row out of band says why, and only those do: a row a change
            # brings into band must drop its reason
            assert (row["out_of_band"] is None) == row["within_band"], row["id"]
            assert row["within_band"] or len(row["out_of_band"]) > 20, row["id"]
    within = [r["id"] for r in rows if r.get("within_band")]
    assert summary["within_band"] == len(within) >= PUBLISHED_WITHIN_BAND
    statuses = [r["status"] for r in rows if r["cannot"] is None]
    assert statuses.count("explained") == summary["explained"]
    assert summary["within_band"] + summary["explained"] + summary["out"] == summary["expressible"]
    for row in rows:  # an explanation that fails the rule says which part
        if row.get("explained") and row["status"] == "out":
            assert row["explanation_problem"] in next(p for p in printed if row["id"] in p)
    assert printed[-1].startswith(f"{len(within)} of {summary['expressible']} expressible rows")
    memory_md = (REPO / "docs" / "memory.md").read_text()
    assert f"{PUBLISHED_WITHIN_BAND} of {summary['expressible']} expressible rows" in memory_md


def test_an_explanation_counts_only_when_it_meets_every_part_of_the_rule(tmp_path):
    """Evidence with its line, the excess that puts the row in band, no constant fitted to the
    source, and a capped run for an under-estimate (docs/memory.md "The published record")."""
    from types import SimpleNamespace

    from bench.published import FITTED_SOURCES, explanation_problem

    line = {"repo": "peer/code", "path": "model.py", "commit": "a" * 40, "line": 9, "shows": "x"}
    gpu_doc = tmp_path / "gpu.md"
    gpu_doc.write_text("| capped | row-a ran every step capped at the estimate |\n")

    def judged(ratio, block, source="peer", row_id="row-a"):
        row = SimpleNamespace(id=row_id, kind="allocated", published_bytes=100, explained=block,
                              source={"name": source})  # fmt: skip
        got = SimpleNamespace(row=row, ratio=ratio, oomless_bytes=int(ratio * 100))
        return explanation_problem(got, gpu_doc)

    over = {"evidence": [line], "excess_bytes": 20}
    assert judged(1.25, over) is None  # 125 - 20 over 100: in band
    assert "still out of band" in judged(1.40, over)
    assert "line" in judged(1.25, {**over, "evidence": [{**line, "line": None}]})
    assert "capped run" in judged(0.80, {"evidence": [line], "excess_bytes": 20})
    assert judged(0.80, {"evidence": [line], "capped_run": "docs/gpu.md"}) is None
    assert "no capped run" in judged(0.8, {"evidence": [line], "capped_run": "x"}, row_id="b")
    fitted = next(iter(FITTED_SOURCES.values()))
    assert "fitted" in judged(1.25, over, source=fitted)


def test_host_memory_bench_takes_each_phase_from_the_rank_events():
    """bench.host_memory: VmHWM at each phase's end per rank, the ranks' summed Pss within it."""
    from bench.host_memory import phase_peaks

    ranks = [
        ({"rss": 100}, [{"t": 1, "event": "setup", "hwm": 150},
                        {"t": 2, "event": "resume_start", "hwm": 150},
                        {"t": 3, "event": "resume_end", "hwm": 260},
                        {"t": 4, "event": "step", "hwm": 300}]),
        ({"rss": 100}, [{"t": 1.1, "event": "setup", "hwm": 140},
                        {"t": 3.1, "event": "resume_end", "hwm": 250},
                        {"t": 4.2, "event": "step", "hwm": 280}]),
    ]  # fmt: skip
    samples = [(0.5, 90), (1.5, 120), (2.5, 330), (3.5, 250), (4.5, 400)]
    got = phase_peaks(ranks, samples)
    assert (got["rank_setup_bytes"], got["rank_load_bytes"], got["rank_step_bytes"]) == (
        50,
        160,
        200,
    )
    assert (got["node_setup_bytes"], got["node_load_bytes"], got["node_step_bytes"]) == (
        90,
        330,
        250,
    )
    assert got["node_run_bytes"] == 330  # up to the first rank's last step, not after


def test_dpo_step_one_loss_and_log_probs_equal_trl_s_on_the_same_batch(tmp_path):
    """bench.dpo_vs_trl --first-step: oomless's DPO and TRL's DPOTrainer from the same saved
    weights on the same 4 pairs: step 1's loss (ln 2) and mean chosen/rejected log-probs."""
    pytest.importorskip("trl")
    from argparse import Namespace

    from bench.dpo_vs_trl import first_step

    args = Namespace(model="llama-20m", micro=4, accum=1, prompt=15, answer=16, precision="fp32",
                     rounds=0, steps=1)  # fmt: skip
    got = first_step(args, tmp_path)
    ours, trl = got["oomless"], got["trl"]
    assert abs(ours["loss"] - math.log(2)) < 1e-6 and abs(trl["loss"] - ours["loss"]) < 1e-6, got
    for key in ("logps/chosen", "logps/rejected"):
        assert abs(ours[key] - trl[key]) <= 1e-5 * abs(trl[key]), got
    assert ours["logps/chosen"] != ours["logps/rejected"]  # a real comparison, not two zeros


def test_gpu_report_summarises_the_estimate_runs_done_before_a_time_limit(tmp_path):
    """The estimate part writes its JSON after every run; the report reads what is there."""
    from bench.gpu_report import describe

    def run(index, est_peak, allocated, est_total, reserved, context=650_969_088):
        return {
            "index": index,
            "estimate": {"peak_tensor_bytes": est_peak, "total_bytes": est_total},
            "measured": {"max_allocated_bytes": allocated, "max_reserved_bytes": reserved,
                         "context_bytes": context},
        }  # fmt: skip

    runs = [  # the H200's runs 4 and 5 (docs/gpu.md), and one that timed out
        run(4, 28_611_874_816, 27_295_860_736, 30_298_069_237, 32_359_055_360),
        run(5, 21_768_867_840, 21_819_600_896, 22_907_621_703, 27_086_815_232),
        {"index": 7, "error": "timed out after 180 s"},
    ]
    (tmp_path / "estimate_gpu.json").write_text(json.dumps({"runs": runs}))
    assert describe("estimate", tmp_path) == (
        "2 of 3 runs: peak error -0.2% to +4.8%, total (reserved + context) -17.4% to -8.2%"
    )


@pytest.mark.slow  # three rungs trained in one fresh process (DeepSpeed's among them)
def test_stream_vs_zero3_runs_small_on_cpu_and_learns_what_zero3_learns(tmp_path):
    out = tmp_path / "stream.json"
    r = run_bounded([PYTHON, "-m", "bench.stream_vs_zero3", "--cpu-smoke", "--json", str(out)],
                    timeout=600, cwd=REPO)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {row["strategy"]: row for row in result["rows"]}
    assert set(rows) == {"stream", "zero3_offload_params"}
    assert all(row["tokens_per_s"] > 0 and row["device_peak_bytes"] > 0 for row in rows.values())
    assert result["max_relative_loss_difference"] <= 1e-4 and result["host_adam_params_s"] > 0
    assert "| stream |" in r.stdout
