"""A job file read: bounded YAML (1.2 numbers), KEY=VALUE overrides, paths relative to the file,
then validated (`load_config`); the resolved config written back (`write_config`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from trainer.core.config.checks import build_config
from trainer.core.config.paths import exists, has_local_parent
from trainer.core.config.schema import JobConfig
from trainer.core.contract import CONFIG_FILE
from trainer.core.errors import ConfigError


class _YamlLoader(yaml.SafeLoader):
    """`yaml.safe_load` without YAML 1.1's base-60 numbers: `time: 12:00:00` stays a string.

    PyYAML reads `12:00:00` as the integer 43200 (sexagesimal), which would turn a Slurm time of
    twelve hours into 43200 minutes; and it reads `1e-4` as a string (no dot). Numbers resolve
    as in YAML 1.2 instead; everything else as in `yaml.safe_load`.
    """


_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(
    _INT_TAG,
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_YamlLoader.add_implicit_resolver(  # after int: YAML 1.2 floats, `1e-4` and `3e5` included
    _FLOAT_TAG,
    re.compile(
        r"^(?:[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


# Bounds on a job file: a real one is a few KiB with a few hundred values. A file over the size
# limit, or whose aliases expand past the value limit (a "billion laughs" file is a few hundred
# bytes that expand to 10**9 values), is refused before anything walks the tree.
MAX_CONFIG_BYTES = 2**20
MAX_YAML_VALUES = 100_000


class YamlLimitError(ValueError):
    """YAML that parses but is over a bound (aliases that expand too far, nesting too deep)."""


class _BoundedYamlLoader(_YamlLoader):
    def construct_document(self, node: yaml.Node) -> Any:
        if _num_values(node, {}, set()) > MAX_YAML_VALUES:
            raise YamlLimitError(
                f"expands to more than {MAX_YAML_VALUES:,} values through its aliases (*name)"
            )
        return super().construct_document(node)


def _num_values(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """Values under `node` with every alias expanded, counted once per distinct node (so a
    billion-laughs file costs its size, not its expansion); capped just above the limit."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_nodes:
        raise YamlLimitError("holds an alias that refers to itself")
    open_nodes.add(id(node))
    children: list[yaml.Node] = []
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [part for pair in node.value for part in pair]
    total = 1
    for child in children:
        total = min(total + _num_values(child, sizes, open_nodes), MAX_YAML_VALUES + 1)
    open_nodes.discard(id(node))
    sizes[id(node)] = total
    return total


def read_yaml(text: str) -> Any:
    """Parse YAML safely (no Python objects), without base-60 numbers; YamlLimitError when its
    aliases expand past MAX_YAML_VALUES values or it nests too deep to parse."""
    try:
        return yaml.load(text, Loader=_BoundedYamlLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise YamlLimitError("nests too deep to read") from None


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(
                ".".join(parts[: i + 1]),
                f"is a value, not a section, so '{dotted}' cannot be set",
                "override the whole key instead",
            )
        node = child
    node[parts[-1]] = value


_MAX_KEY_PARTS = 32


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=value` overrides in order; values parse as YAML."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        shown = item if len(item) <= 80 else item[:77] + "..."
        if not sep or not key or any(not p for p in key.split(".")):
            raise ConfigError(
                shown, "is not a KEY=VALUE override", "write it like train.lr=1e-4 or strategy=fsdp"
            )
        if key.count(".") >= _MAX_KEY_PARTS:
            raise ConfigError(
                shown, f"has more than {_MAX_KEY_PARTS} dotted parts", "no key is that deep"
            )
        try:
            value = read_yaml(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        except YamlLimitError as err:
            raise ConfigError(key, f"the value {err}", "write the value out in full") from None
        _set_dotted(tree, key.strip(), value)
    return tree


def load_config(path: str | Path, overrides: list[str] | None = None) -> JobConfig:
    """Read YAML (safe_load), apply overrides, validate. Relative paths resolve against the file."""
    path = Path(path)
    text = read_config_text(path)
    try:
        tree = read_yaml(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(str(path), f"is not valid YAML{where}", "fix the syntax") from None
    except YamlLimitError as err:
        raise ConfigError(
            str(path), str(err), "write the values out, without such aliases"
        ) from None
    if not isinstance(tree, dict):
        raise ConfigError(str(path), "top level must be a mapping", "start with model:, data:")
    tree = apply_overrides(tree, overrides or [])
    _resolve_relative(tree, path.parent)
    return build_config(tree)


def read_config_text(path: Path) -> str:
    """A job file's text: a readable UTF-8 file of at most MAX_CONFIG_BYTES, else ConfigError."""
    try:
        if not path.is_file():
            raise ConfigError(
                str(path), "config file not found", "pass the path of a YAML job file"
            )
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ConfigError(str(path), f"cannot be read ({err.strerror})", "check the path") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            str(path),
            f"is over {MAX_CONFIG_BYTES // 2**20} MiB, which no job file needs",
            "pass the job's YAML file (data goes in data.path, not in the config)",
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ConfigError(
            str(path),
            f"line {line} is not UTF-8 text (byte 0x{raw[err.start]:02x})",
            "save the file as UTF-8",
        ) from None


def _resolve_relative(tree: dict[str, Any], base: Path) -> None:
    """Paths in a job file are relative to the file (or the CWD when they exist there)."""
    for section, key in (
        ("data", "path"),
        ("data", "eval_path"),
        ("model", "name_or_path"),
        ("model", "tokenizer"),
    ):
        part = tree.get(section)
        value = part.get(key) if isinstance(part, dict) else None  # else: validation says
        if not isinstance(value, str) or value.startswith(("/", "~")):
            continue
        if exists(Path(value)):
            tree[section][key] = str(Path(value).resolve())
        elif exists(base / value):
            tree[section][key] = str((base / value).resolve())
        elif not has_local_parent(Path(value)) and has_local_parent(base / value, base):
            # `data/train` beside the job file, missing: a local path, named in full in the error
            tree[section][key] = str((base / value).resolve())


def dump_config(cfg: JobConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def write_config(cfg: JobConfig, run_dir: str | Path) -> Path:
    """run_dir/config.yaml, replaced in one rename after an fsync (0600: it holds paths)."""
    from trainer.core.files import write_atomic

    return write_atomic(Path(run_dir) / CONFIG_FILE, dump_config(cfg))
