"""bench/estimate_gpu.py as far as a CPU allows: its smoke grid runs the engine's real steps
(single, fsdp, zero3_offload) through the same code path, and its table computes the errors."""

from __future__ import annotations

import json

import pytest

from bench.estimate_gpu import GPU_GRID, errors, table
from tests.conftest import PYTHON, REPO, python_env, run_bounded


def test_the_gpu_grid_has_a_dozen_runs_over_sizes_strategies_and_checkpointing():
    assert len(GPU_GRID) >= 12
    assert {r.model for r in GPU_GRID} == {"llama-1b", "llama-3b"}
    assert {"single", "fsdp", "zero3_offload"} <= {r.strategy for r in GPU_GRID}
    assert {r.activation_checkpointing for r in GPU_GRID} == {"none", "selective", "full"}


@pytest.mark.timeout(900)
def test_cpu_smoke_runs_real_engine_steps_and_writes_the_details(tmp_path):
    env = python_env() | {"OUT": str(tmp_path)}
    # zero3_offload may be the first DeepSpeed use on a fresh machine: its CPU Adam builds first
    proc = run_bounded(
        [PYTHON, "-m", "bench.estimate_gpu", "--cpu-smoke", "--timeout", "420"],
        timeout=840, cwd=REPO, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = proc.stdout.strip().splitlines()
    assert rows[0].split()[:3] == ["#", "model", "strategy"]
    assert [row.split()[2] for row in rows[1:4]] == ["single", "fsdp", "zero3_offload"]
    details = json.loads((tmp_path / "estimate_gpu.json").read_text())
    for run in details["runs"]:
        assert run["measured"]["step_s"] > 0  # a real optimizer step ran
        assert run["estimate"]["peak_tensor_bytes"] > 0
        assert "error" not in run


def test_errors_compare_peak_with_allocated_and_total_with_reserved_plus_context():
    result = {
        "index": 4,
        "run": {
            "model": "llama-1b",
            "strategy": "fsdp",
            "micro_batch_size": 2,
            "seq_len": 2048,
            "activation_checkpointing": "full",
        },
        "estimate": {"peak_tensor_bytes": 110, "total_bytes": 190},
        "measured": {"max_allocated_bytes": 100, "max_reserved_bytes": 150, "context_bytes": 50},
    }
    err = errors(result)
    assert round(err["peak"], 6) == 0.10 and round(err["total"], 6) == -0.05
    last = table([result]).splitlines()[-1]
    assert "over 1 runs: median |error| 10.0%" in last and "most under +10.0%" in last
