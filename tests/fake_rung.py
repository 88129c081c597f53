"""A trivial backend for tests/test_architecture.py's "adding a rung is one row" check."""

from __future__ import annotations

from typing import Any


class EchoBackend:
    """Knows its name and context; the plan never runs it."""

    def __init__(self, strategy: str, ctx: Any):
        self.name, self.ctx = strategy, ctx
