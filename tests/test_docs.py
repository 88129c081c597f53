"""The docs hold results, not history: every file a page or a docstring names exists, no commit
hashes in README.md or docs/, and docs/benchmarks.md stays short enough to read."""

from __future__ import annotations

import re
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
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
# Short (7-12) or full (40) hex with a digit and a letter: how a commit is named.
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])(?:[0-9a-f]{7,12}|[0-9a-f]{40})\b")

# Named on purpose, not files of this repository.
NOT_REPO_PATHS = {
    "configs/my_job.yaml": "the user's own job file in docs/slurm.md's example",
}
NOT_REPO_NAMES = {
    "stage3.py": "DeepSpeed's source, docs/memory.md",
    "stage_1_and_2.py": "DeepSpeed's source, docs/memory.md",
    "summary.md": "written by bench/gpu_validate.sh into $OUT",
    "table.md": "written by bench/all_models.py --markdown",
}


def _sources() -> list[Path]:
    code = [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))]
    return PAGES + [p for p in code if p != Path(__file__).resolve()]


def missing_paths(text: str, root: Path = REPO) -> list[str]:
    """The repository paths `text` names that do not exist under `root`."""
    missing = []
    for match in REPO_PATH.finditer(text):
        ref = match.group(1).rstrip(".")
        if ref not in NOT_REPO_PATHS and not (root / ref).exists():
            missing.append(ref)
    return missing


def missing_names(text: str, names: set[str], pattern: re.Pattern = BARE_NAME) -> list[str]:
    """The bare file names (`pattern`) in `text` that no file of the repository has."""
    found = (m.group(1) for m in pattern.finditer(text))
    return [name for name in found if name not in names and name not in NOT_REPO_NAMES]


def _repo_file_names() -> set[str]:
    skip = {".git", ".venv", "__pycache__"}
    return {p.name for p in REPO.rglob("*") if not skip.intersection(p.relative_to(REPO).parts)}


def _where(path: Path, text: str, find) -> list[str]:
    return [
        f"{path.relative_to(REPO)}:{num}: {ref}"
        for num, line in enumerate(text.splitlines(), 1)
        for ref in find(line)
    ]


def test_the_checker_finds_a_missing_path_and_a_missing_name() -> None:
    text = "see launcher/plan.py, launcher/nope.py, docs/planner.md. and INTERFACE.md"
    assert missing_paths(text) == ["launcher/nope.py"]
    assert missing_names(text, _repo_file_names()) == ["INTERFACE.md"]
    assert missing_paths("~/.cache/oomless/bench/x.json and $OUT/docs/x.md") == []


def test_every_repository_path_in_the_docs_and_the_code_exists() -> None:
    bad = [hit for p in _sources() for hit in _where(p, p.read_text(), missing_paths)]
    assert not bad, "named but not in the repository:\n" + "\n".join(bad)


def test_every_file_name_in_the_docs_and_the_code_exists() -> None:
    names = _repo_file_names()

    def find(path: Path):
        pattern = BARE_NAME if path.suffix == ".md" else BARE_DOC_NAME
        return lambda line: missing_names(line, names, pattern)

    bad = [hit for p in _sources() for hit in _where(p, p.read_text(), find(p))]
    assert not bad, "no file of the repository has this name:\n" + "\n".join(bad)


def test_every_relative_link_of_a_page_resolves() -> None:
    def broken(page: Path, line: str) -> list[str]:
        targets = (m.group(1).split("#")[0] for m in MARKDOWN_LINK.finditer(line))
        local = (t for t in targets if t and "://" not in t and not t.startswith("mailto:"))
        return [t for t in local if not (page.parent / t).exists()]

    bad = [hit for p in PAGES for hit in _where(p, p.read_text(), lambda ln, p=p: broken(p, ln))]
    assert not bad, "links to nothing:\n" + "\n".join(bad)


def test_readme_and_docs_name_no_commits() -> None:
    example = "at 5052f9a and ffa50b2, 8030261248 params, fingerprint 3f0c9a7e5b2d4e11"
    assert COMMIT_HASH.findall(example) == ["5052f9a", "ffa50b2"]
    bad = [hit for p in PAGES for hit in _where(p, p.read_text(), COMMIT_HASH.findall)]
    assert not bad, "commit hashes (history lives in commit messages):\n" + "\n".join(bad)


def test_the_benchmarks_page_is_under_2500_words() -> None:
    words = len((REPO / "docs" / "benchmarks.md").read_text().split())
    assert words < 2500, f"docs/benchmarks.md has {words} words"
