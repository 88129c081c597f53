"""A published row's job trained by oomless's engine on one GPU capped at oomless's estimate:
whether the estimate holds the job on oomless's own engine (docs/memory.md "The published
record": an under-estimate is explained only by such a run).

    python -m bench.capped_row ROW_ID [--steps 3]

The row's job (bench/published_rows.yaml) with the demo's tokenizer and data at the row's
sequence length, planned on this GPU (`oomless plan --json`), then `oomless train` for `--steps`
steps with the caching allocator capped (`debug.device_memory_fraction`) at the estimate's device
total less the CUDA context. Prints one JSON line: the cap, the exit code, the steps trained, the
peak allocated.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from bench.published import job_config, load_rows
from launcher.estimate.peak import CUDA_CONTEXT_BYTES

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.capped_row", description=__doc__)
    p.add_argument("row")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    (row,) = [r for r in load_rows() if r.id == args.row]
    job = job_config(row).to_dict()
    job["model"]["tokenizer"] = str(REPO / "configs" / "demo" / "tokenizer")
    job["data"].update(path=str(REPO / "configs" / "demo" / "train.jsonl"),
                       format="prompt_completion")  # fmt: skip
    job["hardware"].update(device_memory=None, host_memory=None)
    job["train"].update(steps=args.steps)
    work = Path(tempfile.mkdtemp(prefix="capped-row-"))
    job["run"]["dir"] = str(work / "run")
    config = work / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }

    def cli(*a: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "launcher.cli", *a], capture_output=True,
                              text=True, env=env, cwd=REPO)  # fmt: skip

    plan = json.loads(cli("plan", str(config), "--json").stdout)
    memory = plan["hardware"]["device_memory_bytes"]
    total = plan["estimate"]["device"]["total_bytes"]
    cap = (total - CUDA_CONTEXT_BYTES) / memory
    r = cli("train", str(config), f"debug.device_memory_fraction={cap}", "run.save_final=false",
            "run.max_restarts=0", "escalation.enabled=false")  # fmt: skip
    metrics = work / "run" / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    steps = [x for x in rows if "loss" in x]
    print(json.dumps({
        "row": row.id, "estimate_total_bytes": total,
        "estimate_peak_tensor_bytes": plan["estimate"]["device"]["peak_tensor_bytes"],
        "cap_bytes": int(cap * memory), "rc": r.returncode, "steps": len(steps),
        "peak_device_bytes": max((x.get("peak_device_bytes") or 0 for x in steps), default=None),
        "stderr_tail": r.stderr[-1500:],
    }))  # fmt: skip
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
