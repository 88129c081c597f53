"""The docs hold results, not history: every file a page or a docstring names exists, no commit
hashes in README.md or docs/, and docs/benchmarks.md stays short enough to read."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PACKAGES = ("launcher", "trainer", "bench", "tests")
TOP_DIRS = ("launcher", "trainer", "bench", "tests", "docs", "configs", "slurm")

# A repository path: starts at a top-level folder, not inside another path or a variable
# (`~/.cache/oomless/bench/...`, `$OUT/...` and URLs are not repository paths).
REPO_PATH = re.compile(r"(?<![\w./$~-])((?:" + "|".join(TOP_DIRS) + r")/[\w./-]*)")
# A bare file name (`INTERFACE.md`, `engine.py`): some file of the repository has that name.
# In code only `*.md` names: tests write `*.py` files of their own (a remote-code fixture).
BARE_NAME = re.compile(r"(?<![\w./$~{-])([\w-]+\.(?:md|py))\b")
BARE_DOC_NAME = re.compile(r"(?<![\w./$~{-])([\w-]+\.md)\b")
# A path below some folder (`backends/fsdp.py`): a file of the repository ends with it.
SUB_PATH = re.compile(r"(?<![\w./$~-])([\w-]+/[\w./-]*\.(?:py|md|yaml|yml|json|sh|tmpl|toml))\b")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
# Short (7-12) or full (40) hex with a digit and a letter: how a commit is named.
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])(?:[0-9a-f]{7,12}|[0-9a-f]{40})\b")

# Named on purpose, not files of this repository.
NOT_REPO_PATHS = {
    "configs/my_job.yaml": "the user's own job file in docs/slurm.md's example",
    "model/config.json": "a model dir made by tests/test_hostile_inputs.py",
    "hang/report.json": "written by a hung run into its run.dir (trainer/runtime/hang.py)",
    "exp/config.yaml": "a user's job file in the run.dir it names, which no run overwrites",
    "torch/distributed/distributed_c10d.py": "torch's source, named in a hang's line",
}
# Where a run or a bench writes: paths below these are outputs, not files of the repository.
OUTPUT_ROOTS = {"runs", "run_dir", "DIR", "OUT"}
NOT_REPO_NAMES = {
    "stage3.py": "DeepSpeed's source, docs/memory.md",
    "stage_1_and_2.py": "DeepSpeed's source, docs/memory.md",
    "partitioned_param_coordinator.py": "DeepSpeed's source, docs/memory.md",
    "_fsdp_collectives.py": "torch's FSDP2 source, docs/gpu.md",
    "summary.md": "written by bench/gpu_validate.sh into $OUT",
    "table.md": "written by bench/all_models.py --markdown",
    "notes.md": "a stray file in a data dir, made by tests/test_hostile_inputs.py",
}


def _sources() -> list[Path]:
    code = [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))]
    return PAGES + [p for p in code if p != Path(__file__).resolve()]


def missing_paths(text: str) -> list[str]:
    """The repository paths `text` names that do not exist."""
    refs = (m.group(1).rstrip(".") for m in REPO_PATH.finditer(text))
    return [r for r in refs if r not in NOT_REPO_PATHS and not (REPO / r).exists()]


def missing_names(text: str, names: set[str], pattern: re.Pattern = BARE_NAME) -> list[str]:
    """The bare file names (`pattern`) in `text` that no file of the repository has."""
    found = (m.group(1) for m in pattern.finditer(text))
    return [name for name in found if name not in names and name not in NOT_REPO_NAMES]


def missing_sub_paths(text: str, files: list[str]) -> list[str]:
    """The paths below a folder that is not top-level that no repository file ends with."""
    refs = (m.group(1) for m in SUB_PATH.finditer(text))
    outside = (r for r in refs if r.split("/")[0] not in (*TOP_DIRS, *OUTPUT_ROOTS))
    return [
        r
        for r in outside
        if r not in NOT_REPO_PATHS and not any(f == r or f.endswith("/" + r) for f in files)
    ]


@functools.cache
def _repo_files() -> list[str]:
    """Every file and folder of the checkout, relative, without hidden folders (.git, .venv)."""
    out = []
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        rel = Path(folder).relative_to(REPO)
        out += [str(rel / name) for name in dirs + files]
    return out


def _repo_file_names() -> set[str]:
    return {Path(f).name for f in _repo_files()}


def _where(path: Path, text: str, find: Callable[[str], list[str]]) -> list[str]:
    """`file:line: reference` for what `find` reports on each line of `text`."""
    return [
        f"{path.relative_to(REPO)}:{num}: {ref}"
        for num, line in enumerate(text.splitlines(), 1)
        for ref in find(line)
    ]


def test_the_checker_finds_a_missing_path_and_a_missing_name() -> None:
    text = "see launcher/plan/planner.py, launcher/nope.py, docs/planner.md. and INTERFACE.md"
    assert missing_paths(text) == ["launcher/nope.py"]
    assert missing_names(text, _repo_file_names()) == ["INTERFACE.md"]
    assert missing_paths("~/.cache/oomless/bench/x.json and $OUT/docs/x.md") == []
    files = _repo_files()
    text = "backends/fsdp.py, backends/nope.py, runs/demo/config.yaml"
    assert missing_sub_paths(text, files) == ["backends/nope.py"]


def test_every_repository_path_in_the_docs_and_the_code_exists() -> None:
    bad = [hit for p in _sources() for hit in _where(p, p.read_text(), missing_paths)]
    assert not bad, "named but not in the repository:\n" + "\n".join(bad)


def test_every_path_below_a_folder_is_a_file_of_the_repository() -> None:
    files = _repo_files()

    def find(line: str) -> list[str]:
        return missing_sub_paths(line, files)

    bad = [hit for p in _sources() for hit in _where(p, p.read_text(), find)]
    assert not bad, "no file of the repository ends with:\n" + "\n".join(bad)


def test_every_file_name_in_the_docs_and_the_code_exists() -> None:
    names = _repo_file_names()
    bad = []
    for path in _sources():
        pattern = BARE_NAME if path.suffix == ".md" else BARE_DOC_NAME
        find = functools.partial(missing_names, names=names, pattern=pattern)
        bad += _where(path, path.read_text(), find)
    assert not bad, "no file of the repository has this name:\n" + "\n".join(bad)


def test_every_relative_link_of_a_page_resolves() -> None:
    def broken(page: Path, line: str) -> list[str]:
        targets = (m.group(1).split("#")[0] for m in MARKDOWN_LINK.finditer(line))
        local = (t for t in targets if t and "://" not in t and not t.startswith("mailto:"))
        return [t for t in local if not (page.parent / t).exists()]

    bad = []
    for page in PAGES:
        bad += _where(page, page.read_text(), functools.partial(broken, page))
    assert not bad, "links to nothing:\n" + "\n".join(bad)


def test_readme_and_docs_name_no_commits() -> None:
    example = "at 5052f9a and ffa50b2, 8030261248 params, fingerprint 3f0c9a7e5b2d4e11"
    assert COMMIT_HASH.findall(example) == ["5052f9a", "ffa50b2"]
    bad = [hit for p in PAGES for hit in _where(p, p.read_text(), COMMIT_HASH.findall)]
    assert not bad, "commit hashes (history lives in commit messages):\n" + "\n".join(bad)


def test_the_benchmarks_page_is_under_2500_words() -> None:
    words = len((REPO / "docs" / "benchmarks.md").read_text().split())
    assert words < 2500, f"docs/benchmarks.md has {words} words"


def test_the_rungs_config_md_names_for_each_opt_in_are_those_that_run_it() -> None:
    """docs/config.md's rows for `finetune.method: qlora` and `train.optimizer: adamw_8bit`
    list exactly the rungs trainer/core/methods.py lets run them (QLoRA on zero3 was missing)."""
    from trainer.core.methods import supported_rungs

    rows = {
        line.split("|")[1].strip(" `"): line
        for line in (REPO / "docs" / "config.md").read_text().splitlines()
        if line.startswith("| `")
    }
    for key, (opt_in, rungs) in {
        "method": ("`qlora` (", supported_rungs("qlora")),
        "optimizer": ("`adamw_8bit` (", supported_rungs("full", "adamw_8bit")),
    }.items():
        said = rows[key].split(opt_in)[1].split(")")[0]
        named = [word.strip("`") for word in said.split("; ")[-1].split(", ")]
        assert named == list(rungs), (key, named, rungs)
