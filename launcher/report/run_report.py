"""`oomless report RUN_DIR`: pictures of a run — loss curves and where the memory goes.

Writes `loss.png` (training loss per step, eval loss where measured, labelled by the objective;
a preference run adds a panel of its reward accuracy and margin), when the run has a
plan `memory.png` (the estimate's per-device breakdown beside the measured peak), and when it
was profiled (`debug.profile`) `memory_timeline.png` (live bytes over one step by phase, the
estimate's per-phase prediction over it: launcher/report/timeline.py) into the run directory,
and prints the launch probe's first step against the estimate (probe.json).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from trainer.core.config import ConfigError, YamlLimitError, read_yaml
from trainer.core.contract import CONFIG_FILE, METRICS_FILE, PLAN_FILE, PROBE_FILE, trace_path
from trainer.core.files import read_json_object, read_jsonl, umask_mode, write_atomic
from trainer.core.units import GIB

log = logging.getLogger(__name__)

_PARTS = ("params", "grads", "optimizer", "activations", "temporary", "runtime_overhead")


def report_command(run_dir: str) -> int:
    root = Path(run_dir)
    metrics_path = root / METRICS_FILE
    if not metrics_path.is_file():
        raise ConfigError("RUN_DIR", f"'{root}' has no metrics.jsonl", "give a run directory")
    import matplotlib

    matplotlib.use("Agg")
    # lines that are not a step (cut off by a kill, edited) are left out of the pictures
    records = [r for r in read_jsonl(metrics_path, warn=False) if _is_step(r)]
    if not records:
        raise ConfigError(
            "RUN_DIR", f"'{metrics_path}' holds no complete step", "report after a step is done"
        )
    written = [plot_loss(records, root / "loss.png", objective_of(root, records))]
    plan_path = root / PLAN_FILE
    if plan_path.is_file():
        plan = read_json_object(plan_path)
        written += _drawn(lambda: plot_memory(plan, records, root / "memory.png"), plan_path)
    if trace_path(root, 0).is_file():  # a run with debug.profile
        from launcher.report.timeline import plot_memory_timeline

        out = root / "memory_timeline.png"
        written += _drawn(lambda: plot_memory_timeline(root, records, out), trace_path(root, 0))
    for path in written:
        print(path)
    probe = read_json_object(root / PROBE_FILE) if (root / PROBE_FILE).is_file() else {}
    if probe.get("ranks"):  # the launch probe's first step against the plan
        from launcher.report.probe_report import render

        print(render(probe))
    return 0


def _is_step(record: dict[str, Any]) -> bool:
    """A metrics.jsonl record with a step and a loss (anything else is not plotted)."""
    return all(_is_number(record.get(k)) for k in ("step", "loss"))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _drawn(draw: Callable[[], Path], source: Path) -> list[Path]:
    """[the picture drawn], or [] with one warning when `source` is not what a run writes."""
    try:
        return [draw()]
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        log.warning("%s: not a file oomless wrote (%s: %s); its picture is left out", source,
                    type(err).__name__, str(err).splitlines()[0] if str(err) else "")  # fmt: skip
        return []


def objective_of(root: Path, records: list[dict[str, Any]]) -> str:
    """The run's `objective.type` from its config.yaml; without one readable, `preference` when
    its records carry rewards, else `sft`."""
    try:
        tree = read_yaml((root / CONFIG_FILE).read_text())
        objective = tree["objective"]["type"]
        if isinstance(objective, str):
            return objective
    except (OSError, UnicodeDecodeError, YamlLimitError, yaml.YAMLError, KeyError, TypeError):
        pass
    return "preference" if any("reward_accuracy" in r for r in records) else "sft"


def loss_label(objective: str) -> str:
    """What `loss` is a mean of, for the y axis (docs/preference.md, docs/interface.md)."""
    if objective == "sft":
        return "loss (token-weighted mean)"
    name = objective.upper() if objective in ("dpo", "orpo", "simpo") else objective
    return f"{name} loss (mean over pairs)"


def plot_loss(records: list[dict[str, Any]], out: Path, objective: str = "sft") -> Path:
    return save_figure(loss_figure(records, objective), out)


def loss_figure(records: list[dict[str, Any]], objective: str = "sft") -> Any:
    """The loss per step (eval loss and exact match where measured); for a run with rewards a
    second panel of reward accuracy and margin."""
    import matplotlib.pyplot as plt

    rewards = [r for r in records if _is_number(r.get("reward_accuracy"))]
    if rewards:
        fig, (ax, below) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True)
        _plot_rewards(
            below, rewards, [r for r in records if _is_number(r.get("eval_reward_accuracy"))]
        )
    else:
        fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["loss"] for r in records], label="train loss", linewidth=1.2)
    evals = [r for r in records if _is_number(r.get("eval_loss"))]
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["eval_loss"] for r in evals],
            "o-",
            label="eval loss",
            markersize=4,
        )
    if not rewards:
        ax.set_xlabel("optimizer step")
    ax.set_ylabel(loss_label(objective))
    last = records[-1]
    ax.set_title(
        f"{last.get('strategy')} x {last.get('world_size')}, micro-batch "
        f"{last.get('micro_batch_size')} x accumulation {last.get('grad_accum')}"
    )
    if evals and all(_is_number(r.get("eval_exact_match")) for r in evals):
        _plot_exact_match(ax, evals)
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _plot_exact_match(ax: Any, evals: list[dict[str, Any]]) -> None:
    twin = ax.twinx()
    twin.plot(
        [r["step"] for r in evals],
        [100 * r["eval_exact_match"] for r in evals],
        "s--",
        color="tab:green",
        label="eval exact match (%)",
        markersize=4,
    )
    twin.set_ylabel("eval exact match (%)")
    twin.set_ylim(0, 100)
    twin.legend(loc="center right")


def _plot_rewards(ax: Any, records: list[dict[str, Any]], evals: list[dict[str, Any]]) -> None:
    """Reward accuracy (%, left) and reward margin (right) per step; held-out ones as markers."""
    steps = [r["step"] for r in records]
    ax.plot(steps, [100 * r["reward_accuracy"] for r in records], color="tab:blue",
            label="reward accuracy (%)", linewidth=1.2)  # fmt: skip
    if evals:
        ax.plot([r["step"] for r in evals], [100 * r["eval_reward_accuracy"] for r in evals],
                "o", color="tab:blue", label="eval reward accuracy (%)", markersize=4)  # fmt: skip
    ax.set_ylim(0, 100)
    ax.set_ylabel("reward accuracy (%)")
    ax.set_xlabel("optimizer step")
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    margins = [r for r in records if _is_number(r.get("reward_margin"))]
    twin.plot([r["step"] for r in margins], [r["reward_margin"] for r in margins],
              color="tab:orange", label="reward margin", linewidth=1.2)  # fmt: skip
    twin.set_ylabel("reward margin (chosen - rejected)")
    ax.legend(loc="upper left")
    twin.legend(loc="lower right")


def plot_memory(plan: dict[str, Any], records: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib.pyplot as plt

    device = plan.get("estimate", {}).get("device", {})
    breakdown = device.get("breakdown", {})
    fig, ax = plt.subplots(figsize=(6, 4))
    bottom = 0.0
    for part in _PARTS:
        value = breakdown.get(part, 0) / GIB
        ax.bar("estimate", value, bottom=bottom, label=part)
        bottom += value
    peaks = (r.get("peak_device_bytes") for r in records)
    measured = max((p for p in peaks if _is_number(p)), default=0) / GIB
    ax.bar("measured peak", measured, color="black", alpha=0.7)
    ax.set_ylabel("GiB per device")
    ax.set_title(f"{plan.get('strategy')}: estimated vs measured device memory")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, out)


def save_figure(fig: Any, out: Path) -> Path:
    """The PNG rendered in memory, then written atomically (a link at `out` is replaced, never
    written through); the figure closed."""
    import matplotlib.pyplot as plt

    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    try:
        return write_atomic(out, png.getvalue(), mode=umask_mode(0o666))
    except OSError as err:  # a read-only or full run dir: the pictures are not written
        raise ConfigError(
            "RUN_DIR",
            f"'{out}' cannot be written ({err.strerror or err})",
            "make the run directory writable, or report a copy of it",
        ) from None
