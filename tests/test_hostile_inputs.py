"""Hostile inputs: job files, overrides, data files, command lines and run-dir states
that a careless or hostile user could hand oomless. Each case runs the CLI as a user does, in a
process of its own, and asserts what the user would notice: the exit code is 0, 2 or 143; stderr
holds no traceback; an exit 2 is ONE line that names the key or the file and says what is wrong
(the expected words); and the run directory that was there before is byte for byte as it was.

Most cases stop at validation (`oomless config` / `plan`, or `train`'s checks before anything is
written) and run `main` in this process, so the battery runs in well under two minutes; a case of
each kind also runs as a process of its own, as a user runs it.

The cases that need a training on several ranks, a mounted disk or a signal live beside what
they exercise, in the shared runs of those modules (CI's budget: no launch of their own here):
- 8-bit AdamW moments across every move: tests/trainer/test_lowbit.py (by resume: ddp<->fsdp,
  single->fsdp_offload, fsdp->single, LoRA) and tests/test_escalation.py (single->fsdp_offload);
- bf16_pure with 8-bit moments: test_lowbit.py; sequence parallelism on OPT and BioGPT:
  tests/trainer/test_sequence_parallel.py;
- full disk on two ranks, at the final save, export onto a full disk, damaged manifests, a
  read-only report, export racing the pruning, rollback: tests/trainer/test_trust_checkpoints.py;
- signals (during a checkpoint write, at launch, torchrun's traceback) and kill -9 of a rank:
  tests/test_cli_train.py, tests/test_rank_killed.py, tests/launcher/test_torchrun_output.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from launcher.cli import main
from tests.conftest import REPO, oomless, write_demo_job

OK, BAD, STOPPED = 0, 2, 143


@dataclass(frozen=True)
class Space:
    """A user's working directory: a job file, a run dir from an earlier run, room for data."""

    root: Path
    job: Path
    run: Path

    def write(self, name: str, content: bytes | str) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return path


@dataclass(frozen=True)
class Case:
    id: str
    argv: Callable[[Space], list[str]]  # the command line after `oomless`
    code: int  # the exit code expected
    says: str = ""  # words the one line holds (for exit 2)
    process: bool = False  # run as a process of its own (else in this one: the same main())


def config(*overrides: str) -> Callable[[Space], list[str]]:
    return lambda s: ["config", str(s.job), *overrides]


def plan(*overrides: str) -> Callable[[Space], list[str]]:
    return lambda s: ["plan", str(s.job), *overrides]


def estimate(*overrides: str) -> Callable[[Space], list[str]]:
    return lambda s: ["estimate", str(s.job), *overrides]


CPU2 = ("hardware.device=cpu", "hardware.devices_per_node=2")
SP3 = (
    "hardware.device=cpu",
    "hardware.devices_per_node=3",
    "sequence_parallel=3",
    "train.global_batch_size=6",
)
GPUS_64 = (
    "hardware.device=cuda",
    "hardware.nodes=8",
    "hardware.devices_per_node=8",
    "hardware.device_memory=80GiB",
    "hardware.host_memory=1TiB",
    "train.global_batch_size=64",
)


def submit_k8s(*overrides: str) -> Callable[[Space], list[str]]:
    return lambda s: ["submit", str(s.job), *overrides, "--k8s"]


K8S_OK = ("k8s.image=ghcr.io/acme/oomless:0.1", "k8s.pvc=runs")


def job_file(content: bytes | str, command: str = "config") -> Callable[[Space], list[str]]:
    return lambda s: [command, str(s.write("hostile.yaml", content))]


def train_on(name: str, content: bytes | str, *overrides: str) -> Callable[[Space], list[str]]:
    """`oomless train` on a data file written as given, into the earlier run's dir."""

    def argv(s: Space) -> list[str]:
        data = s.write(name, content)
        return ["train", str(s.job), f"data.path={data}", *overrides]

    return argv


def train_with(setup: Callable[[Space], list[str]]) -> Callable[[Space], list[str]]:
    """`oomless train` with the overrides that `setup` returns after preparing files."""
    return lambda s: ["train", str(s.job), *setup(s)]


def jsonl(*rows: object) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


PC = {"prompt": "1+1=", "completion": "2"}
CHAT = "data.format=chat"
NOT_UTF8_JSONL = jsonl(PC).encode() + b'{"prompt": "\xff", "completion": "3"}\n'
NOT_UTF8_TXT = b"1+1=2\n\n2+2=4 \xc3\x28\n"
LONG_LINE = jsonl(PC, {"prompt": "1" * 2**21, "completion": "2"})
ALL_CUT_OFF = jsonl(*[{"prompt": "1+2=" * 30, "completion": "3"}] * 20)
ODD_ROLE = jsonl(
    {"messages": [{"role": "root", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
)
LIST_ROLE = jsonl(
    {"messages": [{"role": ["user"], "content": "hi"}, {"role": "assistant", "content": "ok"}]}
)
NO_ASSISTANT = jsonl({"messages": [{"role": "user", "content": "hi"}]})
ODD_BUT_VALID = "".join(
    json.dumps({"prompt": f"{i}+{i}=\u2028", "completion": f"{2 * i}\x0c"}, ensure_ascii=False)
    + "\r\n"
    for i in range(8)
)
PY_TAG = '!!python/object/apply:os.system ["touch pwned"]\n'


def _job_with_anchor(s: Space) -> list[str]:
    """A job that uses YAML anchors and aliases the ordinary way: fine."""
    tree = yaml.safe_load(s.job.read_text())
    tree.pop("train", None)
    text = yaml.safe_dump(tree) + "train:\n  lr: &rate 0.003\n  eps: *rate\n"
    return ["config", str(s.write("anchors.yaml", text))]


def _bomb(levels: int = 9) -> str:
    lines = ["a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for i in range(1, levels):
        prev, name = chr(ord("a") + i - 1), chr(ord("a") + i)
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 10)}]")
    return "\n".join(lines) + "\n"


def _flow_bomb() -> str:
    parts = ["a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for i in range(1, 6):
        prev, name = chr(ord("a") + i - 1), chr(ord("a") + i)
        parts.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 10)}]")
    return "{" + ", ".join(parts) + "}"


def _resume_from_a_file(s: Space) -> list[str]:
    return [f"run.resume={s.write('step_3', 'not a checkpoint')}"]


def _resume_from_empty_dir(s: Space) -> list[str]:
    (s.root / "not_a_checkpoint").mkdir()
    return [f"run.resume={s.root / 'not_a_checkpoint'}"]


def _export_missing(s: Space) -> list[str]:
    return ["export", str(s.root / "nope"), str(s.root / "out")]


def _model_dir(config_json: str | bytes) -> Callable[[Space], list[str]]:
    """`oomless plan` of a pretrained model dir whose config.json is as given."""

    def argv(s: Space) -> list[str]:
        s.write("model/config.json", config_json)
        return ["plan", str(s.job), "model.config=null", f"model.name_or_path={s.root / 'model'}"]

    return argv


def _cache_dir_is_a_file(s: Space) -> list[str]:
    return [f"data.cache_dir={s.write('cache_file', 'x')}"]


def _run_dir_is_a_file(s: Space) -> list[str]:
    return [f"run.dir={s.write('a_file', 'x')}"]


def _data_dir(files: dict[str, str]) -> Callable[[Space], list[str]]:
    def setup(s: Space) -> list[str]:
        for name, content in files.items():
            s.write(f"corpus/{name}", content)
        return [f"data.path={s.root / 'corpus'}", "data.format=text"]

    return setup


CASES = [
    # ---- job files
    Case("file-over-1MiB", job_file("# padding\n" * 120_000), BAD, "is over 1 MiB"),
    Case("billion-laughs", job_file(_bomb()), BAD, "expands to more than 100,000", process=True),
    Case("alias-to-itself", job_file("model: &m [*m]\n"), BAD, "refers to itself"),
    Case("nested-1500-deep", job_file("[" * 1500 + "]" * 1500), BAD, "nests too deep"),
    Case("not-utf8", job_file(b"model:\n  config: {x: \xff}\n"), BAD, "line 2 is not UTF-8"),
    Case("binary-garbage", job_file(bytes(range(256)) * 8), BAD, "not UTF-8"),
    Case("top-level-list", job_file("- model\n- data\n"), BAD, "top level must be a mapping"),
    Case("python-object-tag", job_file(PY_TAG), BAD, "not valid YAML", process=True),
    Case("tab-indented", job_file("model:\n\tconfig: 1\n"), BAD, "not valid YAML at line 2"),
    Case("empty-file", job_file(""), BAD, "model: is required"),
    Case("sections-as-list", job_file("model: [1, 2]\ndata: {path: x}\n"), BAD, "model: is a list"),
    Case("config-is-a-dir", lambda s: ["config", str(s.root)], BAD, "config file not found"),
    Case("config-missing", lambda s: ["plan", str(s.root / "no.yaml")], BAD, "file not found"),
    Case("anchors-used-sensibly", _job_with_anchor, OK),
    # ---- overrides
    Case("model=list", config("model=[1,2]"), BAD, "model: is a list [1, 2]", process=True),
    Case("data=number", plan("data=5"), BAD, "data: is the number 5, not a section"),
    Case("train=null", config("train=null"), BAD, "train: is null, not a section"),
    Case("lr=.inf", plan("train.lr=.inf"), BAD, "train.lr: is inf (not a finite", process=True),
    Case("lr=nan", config("train.lr=nan"), BAD, "train.lr: is nan"),
    Case("lr=quoted-inf", config('train.lr="inf"'), BAD, "train.lr: is inf"),
    Case("betas-nan", config("train.betas=[0.9, .nan]"), BAD, "train.betas[1]: is nan"),
    Case("model-config-inf", plan("model.config.rope_theta=.inf"), BAD, "rope_theta: is inf"),
    # a rope type's own keys, by transformers' check, before config.yaml or plan.json is written
    Case(
        "rope-llama3-without-its-keys",
        train_with(lambda s: ["model.rope_scaling={rope_type: llama3, factor: 8}"]),
        BAD,
        "model.rope_scaling: transformers refuses it (Missing required keys",
    ),
    Case(
        "rope-yarn-unknown-key",
        train_with(lambda s: ["model.rope_scaling={rope_type: yarn, factor: 2, beta_fast: x}"]),
        BAD,
        "model.rope_scaling: transformers refuses it",
    ),
    Case(
        "rope-factor-1e308",
        config("model.rope_scaling={rope_type: yarn, factor: 1e308}"),
        BAD,
        "model.rope_scaling: factor 1e+308 x",
        process=True,
    ),
    Case(
        "rope-factor-nan",
        plan("model.rope_scaling={rope_type: linear, factor: .nan}"),
        BAD,
        "factor: is nan",
    ),
    Case(
        "rope-original-huge",
        estimate(
            f"model.rope_scaling={{rope_type: yarn, factor: 2, "
            f"original_max_position_embeddings: {10**30}}}"
        ),
        BAD,
        "model.rope_scaling: factor 2 x",
    ),
    Case("memory-1e400", plan("hardware.device_memory=1e400"), BAD, "device_memory: is inf"),
    Case("memory-400-digits", plan(f"hardware.device_memory={'9' * 400}.0GiB"), BAD, "memory"),
    Case("deepspeed-inf", config("deepspeed.overrides.x=-.inf"), BAD, "overrides.x: is -inf"),
    Case("huge-global-batch", plan(f"train.global_batch_size={10**30}"), BAD, "global_batch"),
    # ---- values of the wrong type: the valid choices, and a boolean is not a number
    Case("sp=2.5", config("sequence_parallel=2.5"), BAD, "use one of 'auto' or a whole number"),
    Case("sp=mapping", plan("sequence_parallel={a: 1}"), BAD, '{"a": 1} is not allowed; use'),
    Case("tiled-mlp=maybe", config("memory.tiled_mlp=maybe"), BAD, "use one of 'auto', true or"),
    Case(
        "target-modules=5",
        config("finetune.lora.target_modules=5"),
        BAD,
        "use one of 'all-linear' or a list of names",
    ),
    Case("lora-alpha=true", config("finetune.lora.alpha=true"), BAD, "alpha: is the boolean true"),
    Case("lr=false", plan("train.lr=false"), BAD, "train.lr: is the boolean false, not a number"),
    # datasets logged its own error twice before the one line
    Case("not-parquet", train_on("d.parquet", b"not parquet"), BAD, "cannot read", process=True),
    # ---- what can be checked before launch is checked in plan, estimate, submit and train
    Case("sp=3-of-4-heads", plan(*SP3), BAD, "3 does not divide the model's 4 attention heads"),
    Case("sp=3-estimate", estimate(*SP3), BAD, "use sequence_parallel=1"),
    Case("sp=3-submit", lambda s: ["submit", str(s.job), *SP3, "--dry-run"], BAD, "4 attention"),
    Case(
        "sp=3-train", lambda s: ["train", str(s.job), *SP3], BAD, "4 attention heads", process=True
    ),
    Case("sp-of-seq-63", plan(*CPU2, "sequence_parallel=2", "data.seq_len=63"), BAD, "seq_len=63"),
    Case("sp=2-on-1-rank", estimate("sequence_parallel=2"), BAD, "2 does not divide the 1 ranks"),
    Case("sp=64-on-64-gpus", plan(*GPUS_64, "sequence_parallel=64"), BAD, "64 does not divide"),
    Case("flash-on-cpu", plan("model.attn_implementation=flash_attention_2"), BAD, "needs a CUDA"),
    Case(
        "flex-on-cpu",
        train_with(lambda s: ["model.attn_implementation=flex_attention"]),
        BAD,
        "flex_attention needs a CUDA GPU for its backward",
    ),
    Case(
        "two-nodes-outside-slurm",
        train_with(lambda s: ["hardware.nodes=2", "strategy=fsdp"]),
        BAD,
        "hardware.nodes: 2 nodes: `oomless train` starts processes on this machine only",
    ),
    Case("override-alias-bomb", config(f"model.config.x={_flow_bomb()}"), BAD, "expands to"),
    Case("override-deep", config("model.config.x=" + "[" * 1500 + "]" * 1500), BAD, "too deep"),
    Case("override-5000-parts", config("a." * 5000 + "b=1"), BAD, "more than 32 dotted parts"),
    Case("override-no-value", config("train.lr"), BAD, "is not a KEY=VALUE override"),
    Case("override-no-key", config("=5"), BAD, "is not a KEY=VALUE override"),
    Case("override-under-value", config("train.lr.x=1"), BAD, "train.lr: is a value, not a"),
    Case("override-typo", config("train.lrr=1"), BAD, "did you mean 'train.lr'"),
    Case("strategy-typo", config("strategy=fdsp"), BAD, "did you mean 'fsdp'"),
    Case("tokenizer-name-too-long", config("model.tokenizer=" + "t" * 5000), OK),
    Case("max-line-bytes-text", config("data.max_line_bytes=lots"), BAD, "data.max_line_bytes"),
    Case("max-line-bytes-zero", config("data.max_line_bytes=0"), BAD, "data.max_line_bytes"),
    # ---- command lines
    Case("no-arguments", lambda s: [], BAD, "arguments are required", process=True),
    Case("unknown-command", lambda s: ["frobnicate"], BAD, "invalid choice"),
    Case("plan-without-config", lambda s: ["plan"], BAD, "arguments are required"),
    Case("emit-unknown", lambda s: ["plan", str(s.job), "--emit", "x"], BAD, "invalid choice"),
    Case("probe-and-json", plan("--probe", "--json"), BAD, "--probe: runs one step"),
    Case("headroom-too-big", plan("plan.headroom=0.95"), BAD, "plan.headroom"),
    Case("probe-scale-zero", plan("debug.probe_scale=0"), BAD, "debug.probe_scale"),
    Case("export-no-checkpoint", _export_missing, BAD, "is not a complete checkpoint"),
    Case("report-not-a-run", lambda s: ["report", str(s.root / "no")], BAD, "no metrics.jsonl"),
    # ---- data files (train stops before anything is written into run.dir)
    Case(
        "jsonl-not-utf8",
        train_on("d.jsonl", NOT_UTF8_JSONL),
        BAD,
        "d.jsonl line 2 is not UTF-8",
        process=True,
    ),
    Case(
        "txt-not-utf8",
        train_on("d.txt", NOT_UTF8_TXT, "data.format=text"),
        BAD,
        "d.txt line 3 is not",
    ),
    Case(
        "line-over-limit",
        train_on("d.jsonl", LONG_LINE),
        BAD,
        "line 2 is longer than data.max_line_bytes=1,048,576",
        process=True,
    ),
    Case(
        "line-over-raised-limit",
        train_on("d.jsonl", LONG_LINE, "data.max_line_bytes=2MiB"),
        BAD,
        "max_line_bytes=2,097,152",
    ),
    Case(
        "all-cut-off",
        train_on("d.jsonl", ALL_CUT_OFF, "data.seq_len=16"),
        BAD,
        "has no token to learn from within data.seq_len=16",
        process=True,
    ),
    Case(
        "chat-odd-role",
        train_on("d.jsonl", ODD_ROLE, CHAT),
        BAD,
        'message 1 has role "root"',
        process=True,
    ),
    Case(
        "chat-list-role",
        train_on("d.jsonl", LIST_ROLE, CHAT),
        BAD,
        "not one of system, user, assistant, tool",
    ),
    Case(
        "chat-no-assistant", train_on("d.jsonl", NO_ASSISTANT, CHAT), BAD, "has no assistant turn"
    ),
    Case(
        "json-nested-deep",
        train_on("d.jsonl", "[" * 10**5 + "]" * 10**5),
        BAD,
        "row 1 is not a JSON object",
    ),
    Case("json-array-broken", train_on("d.json", f"[{json.dumps(PC)},"), BAD, "is not valid JSON"),
    Case("empty-data", train_on("d.jsonl", ""), BAD, "has no usable rows"),
    Case(
        "field-is-a-number",
        train_on("d.jsonl", jsonl({**PC, "completion": 2})),
        BAD,
        "is a int, not text",
    ),
    Case(
        "completion-blank",
        train_on("d.jsonl", jsonl({**PC, "completion": " "})),
        BAD,
        "'completion' is empty",
    ),
    Case("dir-without-data", train_with(_data_dir({"notes.md": "x"})), BAD, "has no"),
    Case(
        "dir-mixed-kinds", train_with(_data_dir({"a.txt": "x", "b.jsonl": jsonl(PC)})), BAD, "mixes"
    ),
    Case(
        "data-path-missing",
        train_with(lambda s: [f"data.path={s.root / 'no.jsonl'}"]),
        BAD,
        "does not exist",
    ),
    Case("cache-dir-is-a-file", train_with(_cache_dir_is_a_file), BAD, "data.cache_dir: "),
    Case("cache-dir-in-proc", train_with(lambda s: ["data.cache_dir=/proc/oomless"]), BAD, "cache"),
    # ---- inline models transformers cannot build (found before the launch, not in every rank)
    Case(
        "heads-do-not-divide",
        train_with(lambda s: ["model.config.num_attention_heads=3"]),
        BAD,
        "not a multiple of the number of attention heads",
        process=True,
    ),
    Case(
        "no-decoder-layers",
        train_with(lambda s: ["model.config.num_hidden_layers=0"]),
        BAD,
        "model.config.num_hidden_layers: is 0",
    ),
    Case(
        "unknown-model-type",
        train_with(lambda s: ["model.config.model_type=llamma"]),
        BAD,
        "'llamma'",
    ),
    Case(
        "negative-vocab",
        train_with(lambda s: ["model.config.vocab_size=-3"]),
        BAD,
        "model.config.vocab_size: is -3",
    ),
    Case("model-dir-broken-json", _model_dir('{"model_type": "llama",'), BAD, "is not valid JSON"),
    Case("model-dir-json-list", _model_dir("[1, 2]"), BAD, "holds a list, not a JSON object"),
    Case("model-dir-not-utf8", _model_dir(b"\xff\xfe{}"), BAD, "config.json is not valid JSON"),
    # ---- Kubernetes (a TrainJob): refused before a plan, a file or kubectl
    Case("trainjob-no-image", plan("--emit", "trainjob"), BAD, "k8s.image: is not set"),
    Case("submit-k8s-no-image", submit_k8s(), BAD, "k8s.image: is not set", process=True),
    Case("submit-k8s-no-pvc", submit_k8s("k8s.image=r/i:1"), BAD, "k8s.pvc: is not set"),
    Case("k8s-pvc-upper", submit_k8s(*K8S_OK, "k8s.pvc=My_Runs"), BAD, "k8s.pvc: 'My_Runs' is not"),
    Case("k8s-pvc-dash", submit_k8s(*K8S_OK, "k8s.pvc=-runs"), BAD, "is not a Kubernetes name"),
    Case("k8s-ns-dot", submit_k8s(*K8S_OK, "k8s.namespace=a.b"), BAD, "k8s.namespace: 'a.b' is"),
    Case("k8s-queue-long", submit_k8s(*K8S_OK, f"k8s.queue={'q' * 64}"), BAD, "at most 63"),
    Case("k8s-image-blank", submit_k8s("k8s.image=a b"), BAD, "k8s.image: 'a b' is not an image"),
    Case("k8s-image-null", submit_k8s("k8s.image="), BAD, "k8s.image: is not set"),
    Case("k8s-image-empty", submit_k8s('k8s.image=""'), BAD, "k8s.image: '' is not an"),
    Case("k8s-unknown-key", submit_k8s(*K8S_OK, "k8s.pv=x"), BAD, "k8s.pv: unknown key"),
    Case(
        "k8s-token-in-config",
        submit_k8s(*K8S_OK, "run.name=hf_abcdefghijklmnopqrstuvwx"),
        BAD,
        "run.name: holds what looks like a Hugging Face token",
    ),
    # ---- runs that survive the cluster: refused before anything runs
    Case("min-nodes-above", plan("elastic.min_nodes=2"), BAD, "elastic.min_nodes: 2 is above"),
    Case("min-nodes-0", config("elastic.min_nodes=0"), BAD, "elastic.min_nodes: "),
    Case("hang-timeout-0", config("run.hang_timeout_s=0"), BAD, "run.hang_timeout_s: must be >= 1"),
    Case(
        "hang-timeout-over-dist",
        plan("run.hang_timeout_s=900"),
        BAD,
        "run.hang_timeout_s: 900 is not below dist.timeout_s=600",
    ),
    Case(
        "hang-timeout-below-a-step",
        lambda s: [
            "plan",
            str(REPO / "configs/models/llama-3.1-8b.yaml"),
            *GPUS_64,
            "run.hang_timeout_s=5",
        ],  # fmt: skip
        BAD,
        "run.hang_timeout_s: 5 s is shorter than a step (",
    ),
    Case("max-restarts-neg", config("run.max_restarts=-1"), BAD, "run.max_restarts: must be >= 0"),
    Case("inject-hang-step-0", config("debug.inject_hang={step: 0}"), BAD, "inject_hang.step"),
    Case(
        "inject-hang-rank-beyond-the-world",
        plan(*CPU2, "debug.inject_hang={step: 3, rank: 2}"),
        BAD,
        "debug.inject_hang.rank: 2 is not a rank of the job, which runs on 2 (ranks 0 to 1)",
    ),
    Case(
        "inject-oom-rank-beyond-the-world",
        train_with(lambda s: ["debug.inject_oom={step: 1, rank: 1}"]),
        BAD,
        "debug.inject_oom.rank: 1 is not a rank of the job, which runs on 1 (ranks 0 to 0)",
    ),
    # ---- run-dir states
    Case("run-dir-is-a-file", train_with(_run_dir_is_a_file), BAD, "is a file"),
    Case("resume-from-non-checkpoint", train_with(_resume_from_empty_dir), BAD, "run.resume: "),
    Case("resume-from-a-file", train_with(_resume_from_a_file), BAD, "neither auto, never nor"),
    # ---- odd but valid: trains (exit 0) and leaves the earlier run's other files alone
    Case("crlf-u2028-form-feed", train_on("d.jsonl", ODD_BUT_VALID), OK, process=True),
]


def _snapshot(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every path under `root`: (mode, bytes of a file)."""
    return {
        str(p.relative_to(root)): (p.lstat().st_mode, p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def space(tmp_path: Path) -> Space:
    run = tmp_path / "run"
    job = write_demo_job(
        tmp_path / "job.yaml",
        run={"dir": str(run), "save_final": False},
        train={"steps": 1, "global_batch_size": 4},
        data={"eval_path": None},
    )
    run.mkdir(mode=0o700)  # an earlier run's files, which no bad input may touch
    (run / "config.yaml").write_text("earlier: run\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    (run / "notes.txt").write_text("mine\n")
    return Space(tmp_path, job, run)


def in_process(argv: list[str]) -> tuple[int, str]:
    """(exit code, stderr) of `oomless ARGV` run by this process's `main`, as the interpreter
    would end it: an escaping exception prints its traceback and exits 1."""
    err, root = io.StringIO(), logging.getLogger()
    handlers, level = list(root.handlers), root.level
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        except Exception:
            traceback.print_exc(file=err)
            code = 1
    root.handlers[:], root.level = handlers, level  # main() set up logging to `err`
    return code, err.getvalue()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input(space: Space, case: Case) -> None:
    before = _snapshot(space.run)
    argv = case.argv(space)
    if case.process:
        r = oomless(*argv, timeout=120)
        code, stderr = r.returncode, r.stderr
    else:
        code, stderr = in_process(argv)
    assert code in (OK, BAD, STOPPED), stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert code == case.code, stderr[-3000:]
    if code == BAD:
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1, stderr[-3000:]
        assert lines[0].startswith(("config error: ", "oomless: ")), lines[0]
        assert case.says in lines[0], lines[0]
        assert len(lines[0]) < 600, lines[0]  # a line a user reads, not a dump of the input
    if code == OK and argv[0] == "train":  # the run owns its files; the user's own stay
        assert (space.run / "notes.txt").read_text() == "mine\n"
        last = json.loads((space.run / "metrics.jsonl").read_text().splitlines()[-1])
        assert last["tokens"] > 0 and 0 < last["loss"] < 100  # it learned from the rows
    else:
        assert _snapshot(space.run) == before  # nothing lost, nothing written
    assert not (REPO / "pwned").exists()  # no YAML tag ran a command


def test_the_battery_is_big_enough() -> None:
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)


def test_plan_and_estimate_need_no_run_time_extras_and_train_names_them(space, monkeypatch):
    """Planning a cluster job from a laptop needs none of what only the run imports (torchao,
    bitsandbytes, peft); `train` checks them on the machine that runs it, in one line."""
    import importlib.util

    find_spec = importlib.util.find_spec
    missing = ("torchao", "bitsandbytes", "peft")
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in missing else find_spec(name, *a),
    )
    opt_ins = ["precision=bf16_pure", "train.optimizer=adamw_8bit", "finetune.method=lora"]
    for command in ("plan", "estimate"):
        code, stderr = in_process([command, str(space.job), *opt_ins])
        assert code == OK, stderr[-3000:]
    before = _snapshot(space.run)
    code, stderr = in_process(["train", str(space.job), *opt_ins])
    assert code == BAD and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip() == (
        "config error: finetune.method: lora needs peft, which is not installed on this "
        "machine; pip install 'oomless[lora]'"
    )
    assert _snapshot(space.run) == before


@pytest.mark.parametrize(
    "overrides",
    [SP3, (*CPU2, "sequence_parallel=2", "data.seq_len=63"), (*GPUS_64, "sequence_parallel=64")],
)
def test_a_suggested_sequence_parallel_passes_the_same_checks(space, overrides):
    """The fix an exit 2 names for a split that cannot run is one that plans."""
    code, stderr = in_process(["plan", str(space.job), *overrides])
    assert code == BAD, stderr
    suggested = stderr.strip().rsplit("use sequence_parallel=", 1)[1].split(" or ")
    assert suggested and all(size.isdigit() for size in suggested), stderr
    for size in suggested:
        code, err = in_process(["plan", str(space.job), *overrides, f"sequence_parallel={size}"])
        assert code == OK, (size, err)


@pytest.fixture
def full_disk(tmp_path: Path):
    """A 1 MiB tmpfs filled to the last byte."""
    import subprocess

    mount = tmp_path / "full"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=False)
    if r.returncode != 0:
        pytest.skip("mounting a tmpfs needs root: the full-disk cases cannot make a full disk")
    with contextlib.suppress(OSError), (mount / "filler").open("wb") as f:
        while True:
            f.write(b"\0" * 4096)
            f.flush()
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize(
    ("override", "says"),
    [
        (
            "run.dir={disk}/run",
            "config error: run.dir: could not write the run's marker to {disk}/run",
        ),
        ("data.cache_dir={disk}/cache", "config error: data.cache_dir: could not write the tok"),
    ],
    ids=["run-lock", "data-cache"],
)
def test_a_full_disk_is_one_line_with_the_bytes_and_leaves_nothing(
    space: Space, full_disk: Path, override: str, says: str
) -> None:
    """Before: a traceback in run_lock; for the cache exit 2 with "(None)" and a partial
    tokens.npy left."""
    code, stderr = in_process(["train", str(space.job), override.format(disk=full_disk)])
    # the tokenising progress line, then one line
    lines = [line for line in stderr.splitlines() if not line.startswith("data tokenised in")]
    assert code == BAD and len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert lines[0].startswith(says.format(disk=full_disk)), lines[0]
    assert "No space left on device (needs about " in lines[0] and " free)" in lines[0], lines[0]
    left = [p for p in full_disk.rglob("*") if p.is_file() and p.name != "filler"]
    assert left == [] and "(None)" not in lines[0], left


IN_BACKWARD_2GIB = (
    "train.optimizer_in_backward=true",
    "train.grad_clip=0",
    "hardware.device=cuda",
    "hardware.device_memory=2GiB",
    "train.global_batch_size=4096",
    "hardware.host_memory=16GiB",
)


@pytest.mark.parametrize("devices", [1, 2, 4])
def test_exit_3_names_the_key_that_forbids_a_fit_and_every_hint_plans(devices):
    """The step in backward allows no accumulation: the exit-3 line says so, its device count
    holds that constraint (it said 2, then 4, then 8), and every change it names plans."""
    demo = str(REPO / "configs" / "demo.yaml")
    job = [demo, *IN_BACKWARD_2GIB, f"hardware.devices_per_node={devices}"]
    code, stderr = in_process(["plan", *job])
    line = stderr.strip()
    assert code == 3 and len(line.splitlines()) == 1, stderr
    assert "train.optimizer_in_backward allows no accumulation, so each rank's" in line, line
    hints = []
    for offer in line.split("; "):
        words = offer.removeprefix("or ").split()
        if "such devices" in offer:  # "fsdp would fit on 8 such devices (8 nodes x 1)"
            nodes, per_node = offer.rsplit("(", 1)[1].rstrip(")").split(" nodes x ")
            hints.append([f"hardware.nodes={nodes}", f"hardware.devices_per_node={per_node}"])
        elif "=" in words[0] and "would fit on" in offer:
            hints.append(offer.removeprefix("or ").split(" would fit on")[0].split(" and "))
    assert len(hints) >= 2, line
    for hint in hints:
        code, err = in_process(["plan", *job, *hint])
        assert code == OK, (hint, err)


LLAMA_8B_128K = (
    "hardware.device=cuda",
    "hardware.devices_per_node=1",
    "hardware.host_memory=1TiB",
    "data.seq_len=131072",
)


@pytest.mark.parametrize(
    ("overrides", "hint"),
    [
        # sdpa's dense mask of the packed documents is what does not fit (was: no hint at all;
        # under the default `auto` the planner takes an implementation without it and plans)
        (
            ("hardware.device_memory=76GiB", "model.attn_implementation=sdpa"),
            "model.attn_implementation=flash_attention_2",
        ),
        # nothing else fits: the longest sequence that does, as a last resort
        (
            (
                "hardware.device_memory=16GiB",
                "model.attn_implementation=flash_attention_2",
                "finetune.method=lora",
            ),
            "data.seq_len=",
        ),  # fmt: skip
    ],
    ids=["flash-attention", "longest-sequence"],
)
def test_exit_3_at_128k_tokens_says_what_would_fit_and_it_plans(overrides, hint):
    job = [str(REPO / "configs" / "models" / "llama-3.1-8b.yaml"), *LLAMA_8B_128K, *overrides]
    code, stderr = in_process(["plan", *job])
    line = stderr.strip()
    assert code == 3 and len(line.splitlines()) == 1, stderr
    offers = [o.removeprefix("or ") for o in line.split("; ")[1:]]
    named = [o.split(" would fit on")[0] for o in offers if o.startswith(hint)]
    assert named, line
    code, err = in_process(["plan", *job, named[0]])
    assert code == OK, (named[0], err)


def test_16m_tokens_on_8000_gpus_names_the_splits_then_what_fits_and_each_plans(tmp_path):
    """Llama-3.1-8B's shape at 16Mi positions, 1,000 sequences on 1,000 x 8 GPUs: it exited 3
    with no reason. One such sequence fits a rank only split, so the planner splits it before it
    judges the batch (it was exit 2 naming the splits): exit 3 naming the longest sequence under
    sdpa and the longer one under flash attention, with the split left to the planner or forced
    to the largest; each change applied plans."""
    config = json.loads((REPO / "trainer/core/presets/llama-3.1-8b.json").read_text())
    tokens = 16 * 2**20
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "model": {"config": {**config, "max_position_embeddings": tokens},
                  "tokenizer": str(REPO / "configs/demo/tokenizer")},
        "data": {"path": str(REPO / "configs/demo/train.jsonl"), "format": "prompt_completion",
                 "seq_len": tokens},
        "train": {"global_batch_size": 1000},
        "precision": "bf16",
        "hardware": {"device": "cuda", "nodes": 1000, "devices_per_node": 8,
                     "device_memory": "80GiB", "host_memory": "2TiB"},
    }))  # fmt: skip
    for split in ([], ["sequence_parallel=32"]):
        code, stderr = in_process(["plan", str(job), *split])
        line = stderr.strip()
        assert code == 3 and len(line.splitlines()) == 1, stderr
        offers = [o.removeprefix("or ").split(" would fit on")[0] for o in line.split("; ")[1:]]
        assert [o.split("=")[0] for o in offers] == ["data.seq_len", "model.attn_implementation"]
        for offer in offers:
            code, err = in_process(["plan", str(job), *split, *offer.split(" and ")])
            assert code == OK, (offer, err)


def test_a_read_only_checkpoints_dir_is_one_line_before_training(space):
    """It trained 2 steps, then a traceback."""
    import subprocess

    checkpoints = space.run / "checkpoints"
    checkpoints.mkdir()
    read_only = ["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(checkpoints)]
    mounted = subprocess.run(read_only, check=False)
    if mounted.returncode != 0:
        pytest.skip("mounting a tmpfs needs root: no read-only checkpoints dir to make")
    try:
        code, stderr = in_process(["train", str(space.job), "run.checkpoint_every=1"])
    finally:
        subprocess.run(["umount", "-l", str(checkpoints)], check=False)
    assert code == BAD and "Traceback" not in stderr, stderr[-3000:]
    lines = [x for x in stderr.splitlines() if not x.startswith("data tokenised in")]
    assert lines == [
        f"config error: run.dir: '{checkpoints}' cannot be written (Read-only file system); "
        "point run.dir at a writable directory"
    ], stderr
    assert not (space.run / "checkpoints" / "step_1").exists()
