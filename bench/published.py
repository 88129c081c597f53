"""oomless's estimate against peak memory that others measured and published for the same jobs.

Each row of `bench/published_rows.yaml` is one published measurement (torchtune, torchtitan,
Answer.AI's fsdp_qlora, LitGPT, the PEFT docs): the source and its commit, the model, the job as
oomless overrides, what the figure measures and the figure. The job is estimated as `oomless
estimate --json` would with those overrides (in process, `estimates_for` of
launcher/report/estimate_report.py), and the figure of the same kind is compared:
`peak_tensor_bytes` with an allocated or active figure; with a reserved one, that peak plus what
the caching allocator reserves beyond it in the mode the source ran (`allocator_slack_bytes` of
launcher/estimate/peak.py: expandable segments or the default); with an nvidia-smi one, that plus
the CUDA context (`total_bytes` when the mode is oomless's own, expandable segments). A row whose
job oomless cannot express says why instead. Pure arithmetic, no GPU.

Each expressible row is in band, explained or out. A row out of band counts as explained only
when its `explained:` block passes every rule (`explanation_problem`): the peer's own code or
docs show the extra memory (each piece of evidence names repository, path, 40-hex commit and
line); either the excess is computed and taking it off puts the row in band, or oomless's engine
ran the same job on a GPU capped at the estimate and it completed (docs/gpu.md names the row on
a `capped` line); an under-estimate only by such a capped run; and no constant of the estimate
was fitted to the row's own source (`FITTED_SOURCES`).

    python -m bench.published [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from launcher.estimate.activations import with_activations
from launcher.estimate.peak import CUDA_CONTEXT_BYTES, Estimate, allocator_slack_bytes
from launcher.estimate.shape import model_shape
from launcher.plan.hardware import detect_hardware
from launcher.report.estimate_report import estimates_for
from trainer.core.config import JobConfig
from trainer.core.config.checks import build_config
from trainer.core.config.loader import apply_overrides
from trainer.core.units import GIB

ROWS_FILE = Path(__file__).with_name("published_rows.yaml")
GB = 10**9
UNITS = {"GiB": GIB, "GB": GB}
# oomless / published that counts as agreement (the "Done when"): a tensor figure within
# 10%; a reserved one (what decides an OOM) at most 5% under and 15% over.
BANDS = {
    "allocated": (0.90, 1.10),
    "active": (0.90, 1.10),
    "reserved": (0.95, 1.15),
    "nvidia-smi": (0.95, 1.15),
}
TENSOR_KINDS = ("allocated", "active")
# The sources (rows file names, or `oomless-h200`: oomless's own engine on a GPU, docs/gpu.md)
# each fitted constant of the estimate rests on (docs/memory.md "Where the constants come from");
# a row of one of these sources is never explained.
FITTED_SOURCES = {
    "ALLOCATOR_SLACK_RATIO['default']": "oomless-h200",
    "ALLOCATOR_SLACK_RATIO['expandable']": "oomless-h200",
    "CUDA_CONTEXT_BYTES": "oomless-h200",
}
GPU_DOC = Path(__file__).resolve().parents[1] / "docs" / "gpu.md"
# What every row's job starts from: one CUDA device, `single`, unpacked text (no block-causal
# mask: the peers pad, or mask packed documents with flash or flex attention), every lever off.
BASE_JOB: dict[str, Any] = {
    "strategy": "single",
    "data": {"path": "HuggingFaceH4/no_robots", "format": "text", "pack": False},
    "hardware": {"device": "cuda", "nodes": 1, "devices_per_node": 1, "host_memory": "2TiB"},
    "memory": {"chunked_loss": False, "offload_activations": False, "tiled_mlp": False},
    "sequence_parallel": 1,
}


@dataclass(frozen=True)
class Row:
    """One published measurement and the job it measured, as oomless overrides."""

    id: str
    source: dict[str, str]
    model: dict[str, Any]
    kind: str
    figure: float
    unit: str
    job: dict[str, Any]
    cannot: str | None = None
    note: str | None = None
    out_of_band: str | None = None  # why an expressible row is out of band (docs/memory.md)
    # evidence [{repo, path, commit, line, shows}], excess_bytes (what the peer holds beyond
    # oomless's engine, or the reverse for an over-estimate), capped_run (where docs/gpu.md says)
    explained: dict[str, Any] | None = None

    @property
    def published_bytes(self) -> int:
        return int(self.figure * UNITS[self.unit])

    @property
    def source_ref(self) -> str:
        s = self.source
        return f"{s['repo']}/{s['path']}@{s['commit'][:7]}"


@dataclass
class Result:
    """A row beside oomless's estimate of its job (None where oomless cannot express it)."""

    row: Row
    estimate: Estimate | None = None

    @property
    def oomless_bytes(self) -> int | None:
        if self.estimate is None:
            return None
        est = self.estimate
        b = est.device_breakdown
        # paged 8-bit states live in CUDA managed memory, which the caching allocator's counts
        # (allocated, active, reserved) never include; nvidia-smi sees them
        paged = self.row.job.get("train.optimizer") == "paged_adamw_8bit"
        managed = b["optimizer"] if paged else 0
        if self.row.kind in TENSOR_KINDS:
            return est.peak_tensor_bytes - managed
        transient = b["activations"] + b["temporary"]  # the peak less the persistent states
        expandable = self.row.source["allocator"].startswith("expandable")
        reserved = est.peak_tensor_bytes + allocator_slack_bytes(transient, expandable)
        if self.row.kind == "nvidia-smi":
            return reserved + CUDA_CONTEXT_BYTES
        return reserved - managed

    @property
    def ratio(self) -> float | None:
        got = self.oomless_bytes
        return None if got is None else got / self.row.published_bytes

    @property
    def within(self) -> bool | None:
        if self.ratio is None:
            return None
        low, high = BANDS[self.row.kind]
        return low <= self.ratio <= high

    @property
    def status(self) -> str | None:
        """'in band', 'explained' (its explanation passes the rule) or 'out'."""
        if self.ratio is None:
            return None
        if self.within:
            return "in band"
        return "out" if explanation_problem(self) else "explained"


def explanation_problem(result: Result, gpu_doc: Path = GPU_DOC) -> str | None:
    """Why an out-of-band row's `explained:` block does not explain it (None: it does)."""
    row, block = result.row, result.row.explained
    if not block:
        return "no explanation"
    evidence = block.get("evidence") or []
    if not evidence:
        return "no evidence from the peer's own code or docs"
    for e in evidence:
        commit, line = str(e.get("commit", "")), e.get("line")
        if not (e.get("repo", "").count("/") == 1 and e.get("path") and len(commit) == 40
                and isinstance(line, int) and line > 0 and e.get("shows")):  # fmt: skip
            return f"evidence {e} lacks its repo, path, 40-hex commit, line or what it shows"
    fitted = sorted(k for k, src in FITTED_SOURCES.items() if src == row.source["name"])
    if fitted:
        return f"{', '.join(fitted)} fitted to this row's own source"
    low, high = BANDS[row.kind]
    under = result.ratio < low
    if block.get("capped_run"):
        lines = [x for x in gpu_doc.read_text().splitlines() if row.id in x and "capped" in x]
        return None if lines else f"docs/gpu.md has no capped run of {row.id}"
    excess = block.get("excess_bytes")
    # the peer's extra bytes off its figure (under), or oomless's extra off the estimate (over)
    got, published = result.oomless_bytes, row.published_bytes
    ratio = None if excess is None else (
        got / (published - excess) if under else (got - excess) / published
    )  # fmt: skip
    with_excess = "" if ratio is None else f" (with the excess taken off: {ratio:.2f})"
    if under:
        return f"an under-estimate is explained only by a capped run{with_excess}"
    if ratio is None:
        return "neither an excess nor a capped run"
    if not low <= ratio <= high:
        return f"still out of band{with_excess}"
    return None


def load_rows(path: Path = ROWS_FILE) -> list[Row]:
    """The rows of the data file, each with its source, model and presets resolved."""
    data = yaml.safe_load(path.read_text())
    sources, models, presets = data["sources"], data["models"], data.get("presets", {})
    rows = []
    for r in data["rows"]:
        job: dict[str, Any] = {}
        for name in r.get("presets", []):
            job |= presets[name]
        job |= r.get("job", {})
        rows.append(
            Row(
                id=r["id"],
                source={"name": r["source"], **sources[r["source"]]},
                model=models[r["model"]],
                kind=r["kind"],
                figure=float(r["figure"]),
                unit=r["unit"],
                job=job,
                cannot=r.get("cannot"),
                note=r.get("note"),
                out_of_band=r.get("out_of_band"),
                explained=r.get("explained"),
            )
        )
    return rows


def job_config(row: Row) -> JobConfig:
    """The row's job as a validated oomless config: the base job, the model, the overrides; the
    global batch is one micro-batch per rank unless the row says otherwise."""
    tree = json.loads(json.dumps(BASE_JOB))
    tree["model"] = dict(row.model)
    if "config" in tree["model"]:
        tree["model"]["tokenizer"] = "meta-llama/Llama-3.1-8B"  # never read by the estimate
    overrides = [f"{k}={json.dumps(v)}" for k, v in row.job.items()]
    tree = apply_overrides(tree, overrides)
    train = tree.setdefault("train", {})
    if "global_batch_size" not in train:
        hw = tree["hardware"]
        world = hw["nodes"] * hw["devices_per_node"]
        train["global_batch_size"] = train.get("micro_batch_size", 1) * world
    return build_config(tree)


def estimate_row(row: Row) -> Result:
    """The forced job's estimate, as `oomless estimate --json` computes it."""
    if row.cannot:
        return Result(row)
    cfg = job_config(row)
    hw = detect_hardware(cfg.hardware)
    shape = with_activations(model_shape(cfg.model), cfg)
    (est,) = estimates_for(cfg, hw, shape)
    return Result(row, est)


def run(rows: list[Row]) -> list[Result]:
    """Every row's estimate, in the file's order."""
    return [estimate_row(r) for r in rows]


def summary(results: list[Result]) -> dict[str, Any]:
    expressible = [r for r in results if r.estimate is not None]
    return {
        "rows": len(results),
        "sources": len({r.row.source_ref for r in results}),
        "repositories": len({r.row.source["repo"] for r in results}),
        "expressible": len(expressible),
        "within_band": sum(bool(r.within) for r in expressible),
        "explained": sum(r.status == "explained" for r in expressible),
        "out": sum(r.status == "out" for r in expressible),
        "cannot": len(results) - len(expressible),
    }


def _job_words(row: Row) -> str:
    j = row.job
    hw_world = j.get("hardware.nodes", 1) * j.get("hardware.devices_per_node", 1)
    method = j.get("finetune.method", "full")
    micro = j.get("train.micro_batch_size", 1)
    accum = j.get("train.global_batch_size", micro * hw_world) // (micro * hw_world)
    parts = [
        f"{j.get('strategy', 'single')} x{hw_world}",
        method if method == "full" else f"{method} r{j.get('finetune.lora.r', 16)}",
        f"b{micro} s{j.get('data.seq_len', 2048)}" + (f" x{accum} accum." if accum > 1 else ""),
        f"AC {j.get('memory.activation_checkpointing', 'none')}"
        + (" (ops)" if j.get("memory.selective") == "ops" else ""),
        j.get("precision", "bf16"),
    ]
    parts += [name for key, name in _FLAGS if j.get(key)]
    if j.get("train.optimizer", "adamw") != "adamw":
        parts.append(j["train.optimizer"])
    return ", ".join(parts)


_FLAGS = (
    ("train.compile", "compile"),
    ("memory.chunked_loss", "chunked loss"),
    ("memory.offload_activations", "act. offload"),
    ("train.optimizer_in_backward", "opt. in bwd"),
)


def render(results: list[Result]) -> str:
    """The markdown table and its summary line."""
    lines = [
        "| row | source | model | job | kind | published | oomless | ratio | within band? |",
        "|---|---|---|---|---|---:|---:|---:|---|",
    ]
    for r in results:
        row = r.row
        model = row.model.get("name_or_path") or _model_words(row.model["config"])
        published = f"{row.figure:g} {row.unit}"
        if r.estimate is None:
            got, ratio, within = "—", "—", f"cannot: {row.cannot}"
        else:
            got = f"{r.oomless_bytes / GIB:.2f} GiB"
            ratio = f"{r.ratio:.2f}"
            within = "yes" if r.within else f"no: {row.out_of_band}" if row.out_of_band else "no"
            if r.status == "explained":
                within = f"explained: {row.out_of_band}"
            elif not r.within and row.explained:
                within += f" (not explained: {explanation_problem(r)})"
        lines.append(
            f"| {row.id} | {row.source['name']} | {model} | {_job_words(row)} | {row.kind} | "
            f"{published} | {got} | {ratio} | {within} |"
        )
    s = summary(results)
    lines.append("")
    lines.append(
        f"{s['within_band']} of {s['expressible']} expressible rows within band; "
        f"{s['explained']} explained; {s['out']} out ({s['rows']} rows from {s['sources']} "
        f"sources in {s['repositories']} repositories; {s['cannot']} oomless cannot express)"
    )
    return "\n".join(lines)


def _model_words(config: dict[str, Any]) -> str:
    return (
        f"{config['model_type']} h{config['hidden_size']} L{config['num_hidden_layers']} "
        f"V{config['vocab_size']}"
    )


def to_json(results: list[Result]) -> dict[str, Any]:
    out = []
    for r in results:
        row = r.row
        entry = {
            "id": row.id,
            "source": row.source,
            "kind": row.kind,
            "published_bytes": row.published_bytes,
            "job": row.job,
            "cannot": row.cannot,
            "note": row.note,
            "out_of_band": row.out_of_band,
        }
        if r.estimate is not None:
            entry |= {
                "oomless_bytes": r.oomless_bytes,
                "peak_tensor_bytes": r.estimate.peak_tensor_bytes,
                "total_bytes": r.estimate.device_total_bytes,
                "breakdown": r.estimate.device_breakdown,
                "ratio": round(r.ratio, 4),
                "within_band": r.within,
                "status": r.status,
                "explained": row.explained,
                "explanation_problem": None if r.within else explanation_problem(r),
            }
        out.append(entry)
    return {"rows": out, "summary": summary(results), "bands": BANDS}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.published", description=__doc__)
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON ('-': stdout)")
    args = p.parse_args(argv)
    results = run(load_rows())
    if args.json == "-":
        print(json.dumps(to_json(results), indent=2))
        return 0
    print(render(results))
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(results), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
