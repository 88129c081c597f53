"""Every causal LM type of the installed transformers, tiny: estimated / traced / trained.

    python -m bench.all_models [--types gpt2,falcon] [--steps 4] [--timeout 120] [--no-fsdp]
                               [--work DIR] [--phase all|single|fsdp|collect] [--reverse]
                               [--json rows.json] [--markdown table.md]

(A walk split over two processes: `--phase single --work A` and `--phase single --reverse
--work B`, the results copied into one dir, then `--phase fsdp --work DIR`: docs/models.md.)

For each type in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` a tiny config is built from the type's own
config class (hidden 64, 2 layers, 4 heads, vocabulary 256, 4 experts top-2 where it has
experts; every other key at the class's default), and four things are tried:

- estimated: `model_shape` + `with_activations` + `estimate` (single, micro-batch 2) answers;
  the column says how its activations were counted (analytic / traced / bound);
- traced: one step of the engine traced under fake tensors (`launcher/estimate/trace.py`), and the
  analytic peak's error against it;
- single: `steps` optimizer steps of the real engine, fp32, one CPU process (finite losses);
- fsdp x2: the same steps under FSDP2 on two CPU processes (one torchrun launch for all types),
  and the largest per-step loss difference from the single run.

Types run one after another in one worker process (imports paid once); a type that takes longer
than `--timeout` seconds is killed and the walk goes on in a fresh worker with the next type.
The first line of every failure is reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from trainer.core.step_spec import StepSpec

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo"
SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
    "head_dim": 16,
    "max_position_embeddings": 512,
    # mixture of experts
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
}
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
SEQ_LEN = 32
COLUMNS = ("estimated", "traced", "single", "fsdp x2")


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str) -> dict[str, Any]:
    """The inline `model.config` of a tiny `model_type`: SMALL's keys that its config class has
    (directly or through its attribute map), the rest at the class's defaults."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    params: dict[str, Any] = {}
    for key, value in {**SMALL, **TOKEN_IDS}.items():
        if hasattr(default, key) and getattr(default, key) is not None and _settable(cls, key):
            params[key] = value
    for key, value in default.to_dict().items():  # rotary and low-rank widths within a head
        small_width = key.endswith(("_head_dim", "rotary_dim", "lora_rank"))
        if small_width and isinstance(value, int) and value > 16 and _settable(cls, key):
            params[key] = 16
    for key, value in default.to_dict().items():  # no dropout: runs must compare step by step
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0:
            params[key] = 0.0
    if getattr(default, "layer_types", None) is not None and _settable(cls, "layer_types"):
        params["layer_types"] = list(default.layer_types)[: SMALL["num_hidden_layers"]]
    cls(**params)  # valid?
    return {"model_type": model_type, **params}


def _settable(cls: type, key: str) -> bool:
    """Not a derived, read-only property of the config class (falcon's head_dim)."""
    attr = getattr(cls, key, None)
    return not (isinstance(attr, property) and attr.fset is None)


def job(model_type: str, work: Path, steps: int, config: dict[str, Any]) -> Path:
    import yaml

    path = work / f"{model_type}.yaml"
    body = {
        "model": {"config": config, "tokenizer": str(DEMO / "tokenizer")},
        "data": {
            "path": str(DEMO / "train.jsonl"),
            "format": "prompt_completion",
            "seq_len": SEQ_LEN,
            "cache_dir": str(work / "cache"),
        },
        "train": {"steps": steps, "global_batch_size": 4, "micro_batch_size": 2, "lr": 3e-3},
        "precision": "fp32",
        "memory": {"activation_checkpointing": "none"},
        "hardware": {"device": "cpu", "devices_per_node": 1},
        "run": {"dir": str(work / "runs" / model_type), "save_final": False},
    }
    path.write_text(yaml.safe_dump(body))
    return path


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:160]


def _losses(run_dir: Path) -> list[float]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["loss"] for line in path.read_text().splitlines() if line]


def check_one(model_type: str, work: Path, steps: int) -> dict[str, Any]:
    """estimated / traced / single for one type (in the worker process)."""
    out: dict[str, Any] = {"type": model_type}
    try:
        config = tiny_config(model_type)
    except Exception as err:
        return {**out, "config": _first_line(err)}
    out["config"] = "ok"
    path = job(model_type, work, steps, config)
    from launcher.estimate.activations import with_activations
    from launcher.estimate.peak import estimate
    from launcher.estimate.shape import model_shape
    from trainer.core.config import load_config

    cfg = load_config(path, ["strategy=single", f"run.dir={work / 'runs' / model_type / 'single'}"])
    analytic = None
    try:
        shape = with_activations(model_shape(cfg.model, cache_dir=work / "shapes"), cfg)
        analytic = estimate(
            shape,
            StepSpec(
                strategy="single",
                world_size=1,
                devices_per_node=1,
                micro_batch_size=2,
                seq_len=SEQ_LEN,
                activation_checkpointing="none",
                precision="fp32",
                device="cpu",
                grad_accum=1,
            ),
        )
        source = shape.activations.source if shape.activations else "analytic"
        out["estimated"] = f"ok ({source})"
        out["moe"] = bool(shape.num_experts)
    except Exception as err:
        out["estimated"] = _first_line(err)
    try:
        from launcher.estimate.trace import trace_step

        traced = trace_step(
            dict(cfg.model.config),
            StepSpec(
                strategy="single",
                world_size=1,
                micro_batch_size=2,
                seq_len=SEQ_LEN,
                activation_checkpointing="none",
                precision="fp32",
            ),
            attn_implementation=cfg.model.attn_implementation,
        )
        if analytic is not None:
            error = (analytic.peak_tensor_bytes - traced.peak_bytes) / traced.peak_bytes
            out["traced"] = f"ok ({error:+.1%})"
            out["trace_error"] = error
        else:
            out["traced"] = "ok"
    except Exception as err:
        out["traced"] = _first_line(err)
    try:
        from launcher.run.preflight import tokenize_data
        from trainer.engine import run_training

        tokenize_data(cfg)
        code = run_training(cfg)
        losses = _losses(Path(cfg.run.dir))
        out["single_losses"] = losses
        finite = len(losses) == steps and all(math.isfinite(x) for x in losses)
        falling = finite and losses[-1] < losses[0]
        out["single"] = "ok" if code == 0 and finite else f"exit {code}, losses {losses}"
        if out["single"] == "ok" and not falling:
            out["single"] = f"ok (loss not falling: {losses[0]:.3f} -> {losses[-1]:.3f})"
    except Exception as err:
        out["single"] = _first_line(err)
    return out


def fsdp_one(model_type: str, work: Path, steps: int) -> dict[str, Any]:
    """The same training under fsdp on this torchrun launch's two ranks (in the worker)."""
    from trainer.core.config import load_config
    from trainer.engine import run_training

    path = work / f"{model_type}.yaml"
    run_dir = work / "runs" / model_type / "fsdp"
    cfg = load_config(path, ["strategy=fsdp", "hardware.devices_per_node=2", f"run.dir={run_dir}"])
    code = run_training(cfg)
    return {"code": code, "losses": _losses(run_dir)}


def worker(argv: list[str]) -> int:
    """`--worker single|fsdp WORK TYPE...`: check types one by one, each result to WORK/NAME."""
    kind, work, types = argv[0], Path(argv[1]), argv[2:]
    steps = int(os.environ.get("ALL_MODELS_STEPS", "4"))
    rank = int(os.environ.get("RANK", "0"))
    import logging

    logging.disable(logging.WARNING)
    for model_type in types:
        (work / "current").write_text(model_type) if rank == 0 else None
        if kind == "single":
            result = check_one(model_type, work, steps)
            (work / f"{model_type}.single.json").write_text(json.dumps(result))
        else:
            try:
                result = fsdp_one(model_type, work, steps)
            except Exception as err:
                result = {"error": _first_line(err), "trace": traceback.format_exc()[-500:]}
            if rank == 0:
                (work / f"{model_type}.fsdp.json").write_text(json.dumps(result))
    return 0


def _walk(kind: str, types: list[str], work: Path, timeout: float, steps: int) -> None:
    """Run the worker over `types`; a type past `timeout` is killed and recorded, the walk goes
    on with the next one in a fresh worker."""
    env = dict(os.environ, PYTHONPATH=str(REPO), ALL_MODELS_STEPS=str(steps),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")  # fmt: skip
    left = list(types)
    while left:
        if kind == "single":
            argv = [sys.executable, "-m", "bench.all_models", "--worker", kind, str(work), *left]
        else:
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", "-m", "bench.all_models", "--worker", kind,
                    str(work), *left]  # fmt: skip
        (work / "current").unlink(missing_ok=True)
        log = (work / f"{kind}.log").open("a")
        proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=log,
                                start_new_session=True)  # fmt: skip
        current, since = None, time.monotonic()
        while proc.poll() is None:
            time.sleep(0.5)
            now = (work / "current").read_text() if (work / "current").exists() else None
            if now != current:
                current, since = now, time.monotonic()
            if time.monotonic() - since > timeout:
                os.killpg(proc.pid, 9)
                proc.wait()
                break
        done = {t for t in left if (work / f"{t}.{kind}.json").exists()}
        if current and current not in done:  # it timed out or crashed the worker
            (work / f"{current}.{kind}.json").write_text(
                json.dumps({"type": current, "error": f"timeout or crash after {timeout:.0f} s"})
            )
            done.add(current)
        left = [t for t in left if t not in done]
        if left and current is None:  # the worker died before its first type
            for t in left:
                (work / f"{t}.{kind}.json").write_text(
                    json.dumps({"type": t, "error": "worker failed to start"})
                )
            return


def collect(types: list[str], work: Path, fsdp: bool) -> list[dict[str, Any]]:
    rows = []
    for t in types:
        single = json.loads((work / f"{t}.single.json").read_text())
        row = {"type": t, **single}
        if "error" in single:
            row.update({c: single["error"] for c in ("estimated", "traced", "single")})
        if single.get("config", "ok") != "ok":
            row.update({c: "config: " + single["config"] for c in ("estimated", "traced")})
            row["single"] = "-"
        row["fsdp x2"] = "-"
        if fsdp and str(row.get("single", "")).startswith("ok"):
            if not (work / f"{t}.fsdp.json").exists():
                row["fsdp x2"] = "not run"
                rows.append(row)
                continue
            f = json.loads((work / f"{t}.fsdp.json").read_text())
            if "error" in f:
                row["fsdp x2"] = f["error"]
            elif f.get("code") != 0 or len(f["losses"]) != len(single["single_losses"]):
                row["fsdp x2"] = f"exit {f.get('code')}, {len(f.get('losses', []))} steps"
            else:
                diff = max(
                    abs(a - b) for a, b in zip(f["losses"], single["single_losses"], strict=True)
                )
                row["fsdp_max_loss_diff"] = diff
                row["fsdp x2"] = f"ok (max loss diff {diff:.1e})" if diff <= 1e-4 else (
                    f"losses differ by {diff:.1e}")  # fmt: skip
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    counts = {c: sum(str(r.get(c, "")).startswith("ok") for r in rows) for c in COLUMNS}
    lines = [
        f"{len(rows)} causal LM types; " + ", ".join(f"{c}: {n}" for c, n in counts.items()),
        "",
        "| type | " + " | ".join(COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    for r in rows:
        cells = [str(r.get(c, "-")).replace("|", "/") for c in COLUMNS]
        lines.append(f"| {r['type']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types (default: all)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per type")
    parser.add_argument("--no-fsdp", action="store_true")
    parser.add_argument("--work", help="working directory (default: a temporary one)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument(
        "--phase",
        choices=("all", "single", "fsdp", "collect"),
        default="all",
        help="run one phase over --work (a walk split over several processes)",
    )
    parser.add_argument("--reverse", action="store_true", help="walk the types last to first")
    args = parser.parse_args()
    types = args.types.split(",") if args.types else causal_lm_types()
    types = types[::-1] if args.reverse else types
    work = Path(args.work or tempfile.mkdtemp(prefix="all_models_"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if args.phase in ("all", "single"):
        _walk("single", types, work, args.timeout, args.steps)
    types = sorted(t for t in types if (work / f"{t}.single.json").exists())
    fsdp = not args.no_fsdp
    if fsdp and args.phase in ("all", "fsdp"):
        ok = [t for t in types if not (work / f"{t}.fsdp.json").exists()
              and str(json.loads((work / f"{t}.single.json").read_text()).get("single", ""))
              .startswith("ok")]  # fmt: skip
        _walk("fsdp", ok, work, args.timeout, args.steps)
    rows = collect(types, work, fsdp)
    table = markdown(rows)
    print(table)
    print(f"{time.monotonic() - started:.0f} s; work dir {work}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
