"""`oomless submit --k8s`: the TrainJob written to run.dir/trainjob.yaml, then `kubectl apply -f`.

Everything is checked and planned before anything is written (exit 2 or 3 leave run.dir as it was);
without kubectl on PATH the file is written and one line says how to apply it; `--dry-run` prints
the manifest and writes nothing. The data and the model are read in the pods, not here.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from launcher.k8s.trainjob import MANIFEST_FILE, check_k8s, render_trainjob
from launcher.plan.job import resolve_plan
from launcher.run.preflight import check_run_dir, ensure_run_dir
from trainer.core.config import JobConfig
from trainer.core.files import absolute_path, write_atomic
from trainer.core.run_lock import check_run_lock


def submit_k8s_command(cfg: JobConfig, dry_run: bool) -> int:
    """Plan, write run.dir/trainjob.yaml, `kubectl apply -f` it when kubectl is here."""
    check_k8s(cfg, "oomless submit --k8s")
    cfg = cfg.model_copy(
        update={"run": cfg.run.model_copy(update={"dir": absolute_path(cfg.run.dir)})}
    )
    run_dir = Path(cfg.run.dir)
    path = run_dir / MANIFEST_FILE
    if not dry_run:
        check_run_dir(run_dir)
        check_run_lock(run_dir)  # a live local run's directory stays as it is
    resolved, plan_json = resolve_plan(cfg)
    manifest = render_trainjob(resolved, plan_json, str(path))
    if dry_run:
        sys.stdout.write(manifest)
        return 0
    ensure_run_dir(run_dir)
    write_atomic(path, manifest)  # 0600: it holds paths and the config
    if shutil.which("kubectl") is None:
        print(f"wrote {path}; kubectl is not on PATH: apply it with: kubectl apply -f {path}")
        return 0
    out = subprocess.run(["kubectl", "apply", "-f", str(path)], capture_output=True, text=True)
    if out.returncode != 0:
        why = " ".join(out.stderr.split()) or f"exit {out.returncode}"
        print(f"oomless submit: kubectl apply -f {path} failed: {why}", file=sys.stderr)
        return out.returncode
    sys.stdout.write(out.stdout)
    return 0
