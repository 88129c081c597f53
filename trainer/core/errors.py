"""The one error a user's bad input raises, everywhere in oomless: its `str()` is the line printed
before exit 2 (the key, what is wrong, how to fix it)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad config value. `str()` is the one line the user sees: key, problem, fix."""

    def __init__(self, key: str, problem: str, fix: str):
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(f"config error: {key}: {problem}; {fix}")
