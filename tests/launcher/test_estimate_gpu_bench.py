"""bench/estimate_gpu.py as far as a CPU allows: its smoke grid runs the engine's real steps
through the same code path, and its table computes the errors."""

from __future__ import annotations

import json

import pytest

from bench.estimate_gpu import CPU_SMOKE_GRID, GPU_GRID, errors, main, table
from tests.conftest import REPO, python_env


def test_the_gpu_grid_has_a_dozen_runs_over_sizes_strategies_and_checkpointing():
    assert len(GPU_GRID) >= 12
    assert {r.model for r in GPU_GRID} == {"llama-1b", "llama-3b"}
    assert {"single", "fsdp", "zero3_offload"} <= {r.strategy for r in GPU_GRID}
    assert {r.activation_checkpointing for r in GPU_GRID} == {"none", "selective", "full"}
    assert [r.strategy for r in CPU_SMOKE_GRID] == ["single", "fsdp", "zero3_offload"]


@pytest.mark.timeout(600)
def test_cpu_smoke_runs_real_engine_steps_and_writes_the_details(tmp_path, monkeypatch, capsys):
    """Row 0 of the smoke grid (single), measured in a process of its own as the bench measures
    every row: the table and estimate_gpu.json. The other rows' steps run elsewhere on one CPU
    process, through the bench (tests/test_bench.py: gpu_validate's fsdp and zero3_offload
    parts) and through the engine (tests/trainer/test_distributed.py: fsdp1_from_fsdp2; two
    ranks of zero3_offload); measuring them here again cost two more starts, one of DeepSpeed."""
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", python_env()["PYTHONPATH"])  # the run imports this checkout
    # the bench sets the launcher's allocator mode in its own environment when none is set:
    # set here, so that it is taken back after the test and no later test sees it
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.chdir(REPO)
    code = main(["--cpu-smoke", "--only", "0", "--timeout", "300"])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    rows = out.strip().splitlines()
    assert rows[0].split()[:3] == ["#", "model", "strategy"]
    assert rows[1].split()[:3] == ["0", "llama-tiny", "single"]
    assert len(rows) == 2  # no error summary: a CPU has no max_memory_allocated to compare
    details = json.loads((tmp_path / "estimate_gpu.json").read_text())
    assert [run["index"] for run in details["runs"]] == [0]
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


def test_reserve_causes_sum_what_each_stream_mapped_by_the_frame_that_asked():
    """`--history` (CUDA): the bytes of segments allocated or mapped, per stream and per the
    innermost frame of oomless, torch.distributed, torch.optim or transformers."""
    from bench.estimate_gpu import reserve_causes

    def event(action, stream, size, *files):
        frames = [{"filename": f, "line": 7, "name": "fn"} for f in files]
        return {"action": action, "stream": stream, "size": size, "frames": frames}

    collectives = "/x/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py"
    snapshot = {"device_traces": [[
        event("segment_map", 0, 2 << 20, "/x/torch/nn/functional.py", "/r/trainer/step.py"),
        event("segment_map", 0, 6 << 20, "/x/torch/nn/functional.py", "/r/trainer/step.py"),
        event("alloc", 0, 1 << 30, "/r/trainer/step.py"),  # served from a segment: no growth
        event("segment_alloc", 77, 4 << 20, "/x/torch/cuda/memory.py", collectives),
        event("segment_map", 0, 1 << 20, "/x/site/functional.py"),
        event("segment_free", 77, 4 << 20, collectives),
    ]]}  # fmt: skip
    causes = reserve_causes(snapshot)
    assert causes["0"] == [
        {"site": "step.py:7 fn", "bytes": 8 << 20},
        {"site": "functional.py:7 fn", "bytes": 1 << 20},
    ]
    assert causes["77"] == [{"site": "_fsdp_collectives.py:7 fn", "bytes": 4 << 20}]
