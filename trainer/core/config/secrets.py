"""Secrets in a job file: refused, each named by its key and the variable to hold it instead."""

from __future__ import annotations

import re
from typing import Any

from trainer.core.errors import ConfigError

# Secrets come from the environment only (docs/config.md names the variables): a config value
# that holds one is refused, so that no run file, checkpoint, sbatch script or log line carries
# it, and the workers read exactly the config that was validated (nothing is redacted).
SECRET_ENV_VARS = ("HF_TOKEN", "WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN")
_SECRET_KEY_RE = re.compile(
    r"^((hf|hub|auth|access|api)_)?token$|secret|password|passwd|api_?key", re.IGNORECASE
)
_TOKEN_VALUE_RES = (
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}"), "a Hugging Face token", "HF_TOKEN"),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{20,}"), "an API key", "the variable its tool reads"),
    (re.compile(r"\b(gh[pousr]|github_pat)_[A-Za-z0-9_]{20,}"), "a GitHub token", "GH_TOKEN"),
    (re.compile(r"\bAKIA[0-9A-Z]{16}\b"), "an AWS access key", "AWS_ACCESS_KEY_ID"),
)
# NAME=VALUE where NAME says token/key/secret/password and VALUE is a literal (not `$VAR`)
_ASSIGNED_SECRET_RE = re.compile(
    r"\b([A-Za-z_]*(?:TOKEN|KEY|SECRET|PASSWORD|PASSWD)[A-Za-z_]*)\s*=\s*"
    r"['\"]?([^\s'\"$][^\s'\"]{11,})",
    re.IGNORECASE,
)


def check_no_secrets(tree: Any, key: str = "") -> None:
    """ConfigError naming the first config value that holds a secret (never the secret itself)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            child = f"{key}.{k}" if key else str(k)
            if _SECRET_KEY_RE.search(str(k)) and v not in (None, "", [], {}):
                raise _secret_error(child, "holds a secret", _env_var_for(child))
            check_no_secrets(v, child)
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            check_no_secrets(v, f"{key}[{i}]")
    elif isinstance(tree, str):
        for pattern, what, env in _TOKEN_VALUE_RES:
            if pattern.search(tree):
                raise _secret_error(key, f"holds what looks like {what}", env)
        m = _ASSIGNED_SECRET_RE.search(tree)
        if m and _looks_random(m.group(2)):
            raise _secret_error(key, f"sets {m.group(1)} to a literal secret", m.group(1))


def _env_var_for(key: str) -> str:
    for hint, env in (("wandb", "WANDB_API_KEY"), ("mlflow", "MLFLOW_TRACKING_TOKEN")):
        if hint in key.lower():
            return env
    if re.search(r"\b(hf|hub|huggingface)", key.lower()):
        return "HF_TOKEN"
    return f"the variable its library reads ({', '.join(SECRET_ENV_VARS)}, ...)"


def _looks_random(value: str) -> bool:
    """Letters and digits mixed, as in keys and tokens (not a path or a word)."""
    return (
        any(c.isdigit() for c in value)
        and any(c.isalpha() for c in value)
        and "/" not in value
        and len(set(value)) >= 8
    )


def _secret_error(key: str, problem: str, env: str) -> ConfigError:
    return ConfigError(
        key,
        f"{problem}; config values end up in run files, checkpoints and logs",
        f"put it in the environment as {env} and remove it from the config "
        "(docs/config.md#secrets)",
    )
