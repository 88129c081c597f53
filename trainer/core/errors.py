"""The one error a user's bad input raises, everywhere in oomless: its `str()` is the line printed
before exit 2 (the key, what is wrong, how to fix it)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad config value. `str()` is the one line the user sees: key, problem, fix."""

    def __init__(self, key: str, problem: str, fix: str):
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(f"config error: {key}: {problem}; {fix}")


def not_writable(
    key: str, path: object, err: OSError, what: str = "cannot be written"
) -> ConfigError:
    """The one line for a directory the user named that cannot be written."""
    return ConfigError(
        key, f"'{path}' {what} ({err.strerror})", f"point {key} at a writable directory"
    )
