"""The shape of the code (DESIGN.md "Layers"): imports go one way, the bottom layer is torch-free,
and the ladder is one table that every reader follows."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The torch-free bottom layer that both packages import: every module in trainer/core/.
BOTTOM = tuple(
    "trainer.core." + path.stem if path.stem != "__init__" else "trainer.core"
    for path in sorted((REPO / "trainer" / "core").glob("*.py"))
)
# The few places where the launcher runs engine code, and why.
LAUNCHER_RUNS_ENGINE = {
    ("launcher.cli", "trainer.export"),  # oomless export
    ("launcher.model_shape", "trainer.model"),  # the decoder layers of a meta-device model
    ("launcher.plan_report", "trainer.backends.deepspeed_config"),  # --emit deepspeed
    ("launcher.supervisor", "trainer.checkpoint"),  # resume compatibility, before any write
    ("launcher.supervisor", "trainer.data"),  # ... and the training data's fingerprint
    ("launcher.supervisor", "trainer.engine"),  # the in-process run
    # a resume's compatibility (the checkpoint's config and data fingerprint), before launch
    ("launcher.supervisor", "trainer.checkpoint"),
    ("launcher.supervisor", "trainer.data"),
    ("launcher.preflight", "trainer.data"),  # the data tokenised once, before launch
    ("launcher.trace", "trainer.backends"),  # the traced step runs the backends' own code
    ("launcher.trace", "trainer.backends.common"),
    ("launcher.trace", "trainer.backends.fsdp"),
    ("launcher.trace", "trainer.levers"),  # chunked loss and activation offload, traced
    ("launcher.trace", "trainer.loss"),
    ("launcher.trace", "trainer.model"),
    ("launcher.trace", "trainer.phases"),  # the same phase markers as a profiled step
    ("launcher.trace", "trainer.finetune"),  # LoRA / QLoRA as the engine builds them
    ("launcher.trace", "trainer.optim"),  # 8-bit AdamW as the engine builds it
    # the activations of a block the analytic model does not know: one traced forward
    ("launcher.activations", "trainer.backends.common"),
    ("launcher.activations", "trainer.loss"),
    ("launcher.activations", "trainer.model"),
    ("launcher.timeline", "trainer.phases"),  # reads a profiled step's trace
    ("launcher.timeline", "trainer.profile"),
    ("launcher.report", "trainer.profile"),
}


def _imports(package: str) -> set[tuple[str, str]]:
    """(importing module, imported module) for every import in a package, nested ones too."""
    found = set()
    for path in sorted((REPO / package).rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {(module, alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
                found |= {(module, node.module)} | {
                    (module, name) for name in names if (REPO / name.replace(".", "/")).exists()
                }
    return found


def test_the_trainer_never_imports_the_launcher():
    wrong = sorted(f"{a} imports {b}" for a, b in _imports("trainer") if b.startswith("launcher"))
    assert not wrong, wrong


def test_the_launcher_runs_engine_code_only_in_the_named_places():
    engine_imports = {
        (a, b)
        for a, b in _imports("launcher")
        if b.startswith("trainer.") and not b.startswith(BOTTOM)
    }
    assert engine_imports <= LAUNCHER_RUNS_ENGINE, sorted(engine_imports - LAUNCHER_RUNS_ENGINE)


def test_the_bottom_layer_and_planning_import_no_torch():
    code = (
        "import sys\n"
        f"import {', '.join(BOTTOM)}\n"
        "import launcher.estimate, launcher.plan\n"
        "print(sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_a_rung_is_one_row_and_one_backend(monkeypatch, capsys):
    """A row added to the table (no other module edited) is a strategy the config accepts, a rung
    `oomless plan` weighs and explains, and a backend the registry builds."""
    from launcher.cli import main
    from trainer.backends import build_backend
    from trainer.core import strategies
    from trainer.core.config import load_config

    wide = strategies.Strategy(
        "fsdp_wide", "fsdp", "tests.fake_rung:EchoBackend", "a test rung", min_world=64
    )
    twin = strategies.Strategy(
        "fsdp_twin", "fsdp", "tests.fake_rung:EchoBackend", "another test rung",
        grad_comm=4.0, param_comm_per_micro=2.0,
    )  # fmt: skip
    monkeypatch.setattr(strategies, "TABLE", [*strategies.TABLE, wide, twin])
    monkeypatch.chdir(REPO)
    preset = ["configs/models/llama-3.1-8b.yaml", "hardware.devices_per_node=8"]
    preset += ["hardware.device=cuda", "hardware.device_memory=80GiB", "hardware.host_memory=1TiB"]

    assert main(["plan", *preset]) == 0
    rungs = capsys.readouterr().out.split("rungs:")[1]
    assert "fsdp_wide              no     needs 64+ ranks, has 8" in rungs
    twin_line = next(line for line in rungs.splitlines() if "fsdp_twin" in line)
    assert "fits" in twin_line and "step time" in twin_line

    assert main(["plan", *preset, "strategy=fsdp_twin", "--json"]) == 0
    assert '"strategy": "fsdp_twin"' in capsys.readouterr().out
    cfg = load_config(preset[0], [*preset[1:], "strategy=fsdp_twin"])
    backend = build_backend(cfg.strategy, ctx=None)
    assert type(backend).__name__ == "EchoBackend" and backend.name == "fsdp_twin"

    monkeypatch.setattr(strategies, "TABLE", strategies.TABLE[:-2])
    assert main(["plan", *preset, "strategy=fsdp_twin"]) == 2
    assert "'fsdp_twin' is not a strategy" in capsys.readouterr().err
